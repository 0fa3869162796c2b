#!/usr/bin/env python3
"""Per-file summary of a cargo-mutants run (scripts/mutants.sh).

Usage: mutants_summary.py ALLOWED_LIST OUTCOMES_JSON... -- FILE...

Prints caught / timed out / missed / allowed / unviable per file and the score: caught
(a test failed, or the tests ran past cargo-mutants' timeout: an endless loop) over viable
mutants, the mutants ALLOWED_LIST names as equivalent left out. Lists every missed mutant
that is not allowed, every allowed one that was caught, and every allowed line of these
files that names no mutant (the list should lose both). Exits 1 when a file scores under the
bar or had no mutant judged at all (a wrong path, or a run that failed).

ALLOWED_LIST has one mutant per line, `FILE: DESCRIPTION # reason`, where DESCRIPTION is
cargo-mutants' name of the mutant without its line and column (so that edits elsewhere in
the file do not invalidate it; a line excuses every mutant of that name in the file, and is
reported when all of them are caught); blank lines and lines starting with `#` are comments.
"""

import json
import re
import sys

BAR = 0.90

# cargo-mutants' outcome summaries.
CAUGHT = "CaughtMutant"
TIMEOUT = "Timeout"
MISSED = "MissedMutant"
UNVIABLE = "Unviable"


def key_of(name):
    """`FILE:LINE:COL: DESCRIPTION` -> `FILE: DESCRIPTION`."""
    return re.sub(r"^([^:]+):\d+:\d+: ", r"\1: ", name)


def read_allowed(path):
    allowed = {}
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                mutant, sep, reason = line.rpartition(" # ")
                if not sep or not reason.strip():
                    sys.exit(f"{path}:{number}: expected `FILE: MUTANT # reason`")
                allowed[mutant.strip()] = reason.strip()
    except FileNotFoundError:
        pass
    return allowed


def main():
    args = sys.argv[1:]
    if "--" not in args or len(args) < 4:
        sys.exit(__doc__)
    split = args.index("--")
    allowed_path, outcome_paths, files = args[0], args[1:split], args[split + 1 :]
    outcomes = []
    for path in outcome_paths:
        with open(path, encoding="utf-8") as f:
            outcomes += json.load(f)["outcomes"]
    allowed = read_allowed(allowed_path)
    failed = False
    print(
        f"{'file':34} {'caught':>6} {'timeout':>7} {'missed':>6} {'allowed':>7}"
        f" {'unviable':>8} {'score':>7}"
    )
    for file in files:
        counts = {CAUGHT: 0, TIMEOUT: 0, MISSED: 0, UNVIABLE: 0}
        excused, unexcused, seen, missed_keys = 0, [], set(), set()
        for outcome in outcomes:
            mutant = outcome["scenario"]
            if not isinstance(mutant, dict) or mutant["Mutant"]["file"] != file:
                continue
            name = mutant["Mutant"]["name"]
            summary = outcome["summary"]
            key = key_of(name)
            seen.add(key)
            if summary == MISSED:
                missed_keys.add(key)
            if summary == MISSED and key in allowed:
                excused += 1
            elif summary in counts:
                counts[summary] += 1
                if summary == MISSED:
                    unexcused.append(name)
        caught = counts[CAUGHT] + counts[TIMEOUT]
        judged = caught + counts[MISSED]
        score = caught / judged if judged else 0.0
        low = score < BAR
        failed |= low
        print(
            f"{file:34} {counts[CAUGHT]:6} {counts[TIMEOUT]:7} {counts[MISSED]:6} {excused:7}"
            f" {counts[UNVIABLE]:8} {score:7.1%}"
            + ("" if judged else "  no mutant judged")
            + ("  < 90 %" if low else "")
        )
        for name in unexcused:
            print(f"    missed: {name}")
        for key in allowed:
            if not key.startswith(file + ": "):
                continue
            if key not in seen:
                print(f"    in {allowed_path}, no such mutant: {key}")
            elif key not in missed_keys:
                print(f"    in {allowed_path}, yet caught: {key}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
