# railyard: the two commands a new machine needs are `make run` and `make test`.
# Both install missing system packages first (scripts/deps.sh).

CARGO ?= cargo

# Incremental caches doubled the debug build's size on disk (3 GB of 14 GB); a fresh machine
# builds once. Export CARGO_INCREMENTAL=1 to keep them while iterating.
export CARGO_INCREMENTAL ?= 0

.PHONY: deps build run test test-rdma loom mutants bench lint fmt clean python-dev python-test

# etcd (the etcd directory's tests run a real one) and protoc (etcd-client's build).
ETCD_PACKAGES = etcd-server protobuf-compiler libprotobuf-dev

# The Python module (python/, built with maturin) and its tests use a project virtualenv.
VENV = $(CURDIR)/.venv

deps:
	@scripts/deps.sh $(ETCD_PACKAGES)
	@scripts/python-venv.sh $(VENV)

build: deps
	$(CARGO) build --release --workspace --features etcd

# The main job: `railyard bench` with its defaults (starts its own target; 5 s of KV-cache writes).
run: build
	./target/release/railyard bench

test: deps
	$(CARGO) test --workspace --all-targets --features etcd,sabotage
	$(CARGO) test --workspace --doc --features etcd,sabotage
	$(MAKE) --no-print-directory loom
	$(MAKE) --no-print-directory python-test

# Builds railyard._native (release, into python/target) and installs the package into .venv.
python-dev: deps
	VIRTUAL_ENV=$(VENV) PATH="$(VENV)/bin:$$PATH" $(VENV)/bin/maturin develop --release -m python/Cargo.toml

# The Python tests: two processes on loopback, the Mooncake shim, and a throughput print
# beside `railyard bench` (built here in release, as `make run` builds it).
python-test: python-dev
	$(CARGO) build --release --bin railyard
	$(VENV)/bin/python -m pytest -q python/tests

# The verbs data path on real hardware: RAILYARD_TEST_VERBS_DEVICE=<device> make test-rdma
# (a NIC, or SoftRoCE: `rdma link add rxe0 type rxe netdev <if>`).
test-rdma: deps
	$(CARGO) test -p railyard-dataplane --test verbs_hardware -- --include-ignored
	$(CARGO) test --test engine -- --include-ignored two_processes_over_the_verbs_fabric

# Loom models of the SPSC ring and of the control/poller epoch hand-off: the real ring code
# with loom's atomics (dataplane/src/sync.rs).
# A separate target dir keeps the --cfg loom build from invalidating the normal one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test -p railyard-dataplane --release --lib

# Mutation testing of the core state machines (cargo-mutants, installed on first use; about
# 35 minutes on 2 cores): caught / missed / unviable per file, failing under 90 % caught.
# Not part of `make test`; run it when you change a core file (docs/mutation-testing.md).
# `make mutants FILES="control/src/wire.rs"` runs one file.
mutants: deps
	scripts/mutants.sh $(FILES)

# Criterion benches: ring vs ArrayQueue and sync_channel; slice path vs the bare ring;
# prepared lists vs plain submissions, register_many vs register; protecting a control frame
# (HMAC, AES-256-GCM) against the 1 µs budget. Then soft-fabric
# bandwidth between two processes beside process_vm_writev and memcpy.
bench: deps
	$(CARGO) bench --bench ring --bench slice_path --bench prepared --bench control_frames
	$(CARGO) run --release --example soft_bandwidth

# No import cycle between files (scripts/import_cycles.py), Markdown links and README examples
# (scripts/check_docs.py), then rustfmt, clippy and rustdoc.
lint: deps
	python3 scripts/import_cycles.py
	python3 scripts/check_docs.py
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features etcd,sabotage -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --features etcd
	$(CARGO) fmt --manifest-path python/Cargo.toml -- --check
	$(CARGO) clippy --manifest-path python/Cargo.toml --release -- -D warnings

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path python/Cargo.toml

clean:
	$(CARGO) clean
	rm -rf python/target
