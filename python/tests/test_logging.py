"""railyard's warnings reach Python's logging, under the logger ``railyard``."""

from __future__ import annotations

import math
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


# A storm of one kind of warning: connections to the handshake port that send bytes no
# railyard process sends, each closed with a warning of kind `connection`.
STORM = textwrap.dedent(
    """
    import logging, os, re, socket, time
    os.environ.pop("RAILYARD_SECRET_FILE", None)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("railyard").addHandler(Keep())
    import railyard

    CONNECTIONS = 40
    started = time.monotonic()
    with railyard.Engine("stormed", listen="127.0.0.1:0", fabric="soft") as engine:
        host, port = engine.session_id.rsplit(":", 1)
        for _ in range(CONNECTIONS):
            with socket.create_connection((host, int(port)), timeout=5) as probe:
                probe.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
        emitted = 0
        deadline = time.monotonic() + 20
        while emitted < CONNECTIONS and time.monotonic() < deadline:
            found = re.search(
                r'railyard_warnings_total\\{[^}]*kind="connection"[^}]*\\} (\\d+)',
                engine.metrics_text(),
            )
            emitted = int(found.group(1)) if found else 0
            time.sleep(0.05)
        time.sleep(0.5)  # what got through reaches Python
    took = time.monotonic() - started
    logged = sum(
        "kind=connection" in message and "suppressed" not in message for message in records
    )
    print(emitted, logged, took)
    """
)


def test_a_storm_of_warnings_reaches_python_rate_limited():
    done = subprocess.run(
        [sys.executable, "-c", STORM], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr
    emitted, logged, took = done.stdout.split()
    assert int(emitted) >= 40, done.stdout
    # The engine's limit: a burst of 5 per kind per 10 s window (the rest are counted and
    # reported with the next one let through); a storm that took longer than one window
    # may have met two or more.
    windows = 1 + math.ceil(float(took) / 10)
    assert 1 <= int(logged) <= 5 * windows < 40, done.stdout
