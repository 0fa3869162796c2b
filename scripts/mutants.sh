#!/usr/bin/env bash
# Mutation testing of the core state machines (`make mutants`): cargo-mutants changes one
# operator, guard or return value of a core file at a time and runs the unit tests of the
# crate that owns the file (settings in .cargo/mutants.toml). A mutant the tests do not
# catch is a behaviour no test pins down.
#
# Prints caught / timed out / missed / allowed / unviable per file and the missed mutants
# that are not listed in mutants-allowed.txt (scripts/mutants_summary.py), and fails when a
# file's score — caught over viable, allowed equivalents left out — is under 90 %.
#
# Usage: scripts/mutants.sh [file ...]   (default: every core file below)
# Output: target/mutation/<crate>.log (cargo-mutants' progress) and
# target/mutation/<crate>/mutants.out (its logs per mutant, outcomes.json).
set -euo pipefail
cd "$(dirname "$0")/.."

# The version whose mutants mutants-allowed.txt names.
CARGO_MUTANTS_VERSION=27.1.0

# The tests that judge each crate's mutants: the control plane's and the data plane's unit
# tests (the sans-IO core and the poller's rules on virtual time), and the topology crate's
# unit and integration tests (its planner is tested on machine fixtures in topology/tests).
declare -A TESTS=(
  [railyard-control]=--lib
  [railyard-dataplane]=--lib
  [railyard-topology]=--tests
)

# The core files, by owning crate.
declare -A CORE=(
  [railyard-control]="control/src/endpoint.rs control/src/wire.rs
    control/src/handshake/state.rs control/src/handshake/admission.rs
    control/src/handshake/descriptors.rs control/src/handshake/queue_pairs.rs
    control/src/handshake/liveness.rs control/src/handshake/retirement.rs"
  [railyard-dataplane]="dataplane/src/ring.rs dataplane/src/batch.rs dataplane/src/epoch.rs
    dataplane/src/poller/rule.rs dataplane/src/poller/credits.rs
    dataplane/src/poller/deadline.rs dataplane/src/poller/inflight.rs"
  [railyard-topology]="topology/src/plan.rs"
)

if ! command -v python3 >/dev/null; then
  echo "mutants: python3 is needed for the summary (apt-get install python3)" >&2
  exit 1
fi

# shellcheck disable=SC2206 # split the lists into words
all_core=(${CORE[*]})
wanted=("$@")
for file in "${wanted[@]}"; do
  if [[ " ${all_core[*]} " != *" $file "* ]]; then
    echo "mutants: $file is not a core file; they are: ${all_core[*]}" >&2
    exit 2
  fi
done

installed=$(cargo mutants --version 2>/dev/null || true)
if [[ "$installed" != "cargo-mutants $CARGO_MUTANTS_VERSION" ]]; then
  echo "mutants: installing cargo-mutants $CARGO_MUTANTS_VERSION" >&2
  cargo install --locked --quiet "cargo-mutants@$CARGO_MUTANTS_VERSION"
fi

# Not target/mutants: that is where cargo puts what the `mutants` profile builds.
out_root=target/mutation
mkdir -p "$out_root"
status=0
outcomes=()
judged=()
for crate in railyard-control railyard-dataplane railyard-topology; do
  files=()
  for file in ${CORE[$crate]}; do
    if [[ ${#wanted[@]} -eq 0 || " ${wanted[*]} " == *" $file "* ]]; then
      files+=("$file")
    fi
  done
  [[ ${#files[@]} -eq 0 ]] && continue
  args=(--package "$crate" --cargo-arg="${TESTS[$crate]}" --output "$out_root/$crate"
    --jobs "${MUTANTS_JOBS:-1}" --no-shuffle)
  for file in "${files[@]}"; do
    args+=(--file "$file")
  done
  echo "mutants: $crate: ${files[*]}" >&2
  # Exit 2 (mutants missed) and 3 (timeouts) leave the judging to the summary below; any
  # other failure (4: the unmutated tree fails its tests) means no mutant was judged.
  rc=0
  cargo mutants "${args[@]}" >"$out_root/$crate.log" 2>&1 || rc=$?
  if [[ $rc -ne 0 && $rc -ne 2 && $rc -ne 3 ]]; then
    # (Exit 4: the tests fail without any mutant.)
    echo "mutants: cargo-mutants failed for $crate (exit $rc); see $out_root/$crate.log" >&2
    tail -20 "$out_root/$crate.log" >&2
    status=1
    continue
  fi
  outcomes+=("$out_root/$crate/mutants.out/outcomes.json")
  judged+=("${files[@]}")
done
if [[ ${#judged[@]} -eq 0 ]]; then
  exit 1 # every run failed, as said above
fi
python3 scripts/mutants_summary.py mutants-allowed.txt "${outcomes[@]}" -- "${judged[@]}" || status=1
exit $status
