"""The protocol tables UCX prints with ``UCX_PROTO_INFO=y`` (to a process's log), read for the ones
that select a protocol for a GPU write: what shows which UCX transport moved GPU bytes (CUDA IPC,
or tcp emulation). Shared by the NIXL GPU test and the NIXL GPU benchmark; the format is UCX
1.23's, as NIXL 1.5.1 bundles it."""

from __future__ import annotations

import re

# The header of UCX's protocol table for a GPU write (UCX_PROTO_INFO=y): "remote memory write by
# ucp_put*(...) from contiguous cuda/GPU0 to ...".
GPU_WRITE = re.compile(r"remote memory write.* from .*cuda")


def cells(line: str) -> str:
    """A table line without UCX's log prefix and its outer bars."""
    return line[line.find("|") :].strip().strip("|").strip()


def ucx_tables(text: str) -> list[tuple[str, list[str]]]:
    """The tables UCX prints (``UCX_PROTO_INFO=y``) that select a protocol for a GPU write, as
    (header, rows): the header names the endpoint configuration and the operation with its memory
    types, each row a size range, the protocol and its transport/device. A table is a border, the
    header (the line with ``cfg#``, then the operation on the next line), a border, the
    Range/Description/Config line, a border, the rows, a border."""
    out: list[tuple[str, list[str]]] = []
    header: list[str] = []
    rows: list[str] = []
    in_rows = False

    def flush() -> None:
        if header and GPU_WRITE.search(" ".join(header)):
            out.append((" ".join(cells(h) for h in header), rows))

    for line in text.splitlines():
        if "cfg#" in line:  # a table begins: its endpoint configuration, then the operation
            flush()
            header, rows, in_rows = [line.strip()], [], False
        elif not header or ("+-" in line and "|" not in line):  # outside a table, or a border
            continue
        elif "|" in line:
            if "Range" in line and "Config" in line:
                in_rows = True
            elif in_rows:
                rows.append(" | ".join(c.strip() for c in cells(line).split("|")))
            else:
                header.append(line.strip())
        else:
            flush()
            header, rows, in_rows = [], [], False
    flush()
    return out
