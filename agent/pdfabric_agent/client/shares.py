"""How the agent reaches a buffer of this process: the shared-memory file behind a CPU pointer, or
the CUDA IPC export of the allocation behind a GPU pointer. Private memory cannot be shared: an
engine must allocate CPU buffers in shared memory for the agent (docs/sglang.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric_agent.protocol.wire import BufferShare, ShareKind


class UnshareableBuffer(ValueError):
    """A buffer the agent cannot map (private CPU memory, a GPU allocation without IPC)."""


@dataclass(frozen=True)
class Mapping_:
    start: int
    end: int
    offset: int
    path: str


def file_mappings(maps_text: str) -> list[Mapping_]:
    """The file-backed lines of /proc/<pid>/maps."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append(Mapping_(lo, hi, int(parts[2], 16), parts[5].removesuffix(" (deleted)")))
    return out


def shm_share(ptr: int, nbytes: int, mappings: list[Mapping_]) -> BufferShare | None:
    """The file range behind [ptr, ptr + nbytes), if one shared file mapping holds all of it."""
    for m in mappings:
        if m.start <= ptr < m.end:
            if ptr + nbytes > m.end:
                raise UnshareableBuffer(f"buffer at {ptr:#x} ({nbytes} bytes) runs past its mapping of {m.path}")
            return BufferShare(ShareKind.SHM, nbytes, m.offset + (ptr - m.start), path=m.path)
    return None


def share_of(ptr: int, nbytes: int, gpu: int | None, mappings: list[Mapping_]) -> BufferShare:
    """CPU pointers by their shared-memory file; with ``gpu`` set, pointers no file maps by CUDA IPC."""
    share = shm_share(ptr, nbytes, mappings)
    if share is not None:
        return share
    if gpu is None:
        raise UnshareableBuffer(
            f"buffer at {ptr:#x} ({nbytes} bytes) is private memory of this process: the agent can only "
            "reach CPU buffers in a shared-memory file (for example under /dev/shm)"
        )
    from pdfabric_agent.memory import cuda, ipc

    try:
        export = ipc.export_pool(ptr, nbytes, gpu)
    except cuda.CudaError as exc:
        raise UnshareableBuffer(
            f"GPU buffer at {ptr:#x} on cuda:{gpu} has no CUDA IPC handle ({exc}); "
            "run SGLang without expandable segments (PYTORCH_CUDA_ALLOC_CONF)"
        ) from None
    return BufferShare(ShareKind.CUDA_IPC, nbytes, export.offset, export=dict(export.to_json()))


def process_mappings() -> list[Mapping_]:
    with open("/proc/self/maps", encoding="utf-8") as fh:
        return file_mappings(fh.read())
