# railyard: the two commands a new machine needs are `make run` and `make test`.
# Both install missing system packages first (scripts/deps.sh).

CARGO ?= cargo

.PHONY: deps build run test lint fmt clean

deps:
	@scripts/deps.sh

build: deps
	$(CARGO) build --release --workspace

# The main job. Until `railyard bench` exists it shows this machine's rails and plan.
run: build
	./target/release/railyard topology

test: deps
	$(CARGO) test --workspace --all-targets
	$(CARGO) test --workspace --doc

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
