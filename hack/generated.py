"""Generated files: write one, or (``--check``) fail when the committed copy is stale."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(out: Path, text: str, *, check: bool, script: str) -> int:
    if check:
        if not out.exists() or out.read_text() != text:
            print(f"{out.relative_to(ROOT)} is stale: run python {script}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0
