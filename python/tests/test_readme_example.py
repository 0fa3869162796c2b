"""The README's Python example runs as written: readme_example.py holds it between its README
markers (scripts/check_docs.py keeps the README's block identical) and runs here as a script
of its own, within a bound."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "readme_example.py"


def test_the_readme_example_runs():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'prefill-0': [b'req-17 ready']}"], done.stdout
