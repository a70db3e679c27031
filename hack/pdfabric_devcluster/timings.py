"""What the harness started and how long each start and stop took: control planes, agent fabrics,
SGLang servers, Prometheus. A test session sets ``TIMINGS_ENV`` to a file; each start appends one
JSON line to it (from any worker process: one short O_APPEND write is atomic), and the session's
summary adds them up by kind (tests/conftest.py, docs/testing.md). Unset, nothing is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

TIMINGS_ENV = "PDFABRIC_TIMINGS"


def record(kind: str, seconds: float) -> None:
    path = os.environ.get(TIMINGS_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "s": round(seconds, 3)}) + "\n"
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as fh:
        fh.write(line)


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Record how long the block took under ``kind`` (also when it raised: a failed start cost too)."""
    started = time.monotonic()
    try:
        yield
    finally:
        record(kind, time.monotonic() - started)


def totals(path: Path) -> dict[str, tuple[int, float]]:
    """{kind: (how many, seconds in all)} of the lines in ``path``."""
    out: dict[str, tuple[int, float]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            entry = json.loads(line)
            kind, seconds = str(entry["kind"]), float(entry["s"])
        except (ValueError, KeyError, TypeError):
            continue
        count, total = out.get(kind, (0, 0.0))
        out[kind] = (count + 1, total + seconds)
    return out
