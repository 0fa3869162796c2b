"""railyard's warnings reach Python's logging, under the logger ``railyard``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A process of its own: the warning is once per process, and other tests start engines.
SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, time
    os.environ.pop("RAILYARD_SECRET_FILE", None)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("railyard").addHandler(Keep())
    import railyard

    with railyard.Engine("logged", listen="0.0.0.0:0", fabric="soft"):
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            time.sleep(0.01)
    for record in records:
        print(record.name, record.levelname, record.getMessage(), sep="|")
    """
)


def test_a_warning_of_the_engine_reaches_the_railyard_logger():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = [line.split("|", 2) for line in done.stdout.splitlines()]
    warned = [
        (name, level, message)
        for name, level, message in lines
        if "not authenticated" in message
    ]
    assert len(warned) == 1, done.stdout
    name, level, message = warned[0]
    assert name == "railyard.engine"
    assert level == "WARNING"
    assert "--secret-file FILE or RAILYARD_SECRET_FILE=FILE" in message
    assert "listen=" in message and ":0 " not in message, message
