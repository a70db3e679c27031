"""SGLang's CPU engine keeps its KV pool and ``MetadataBuffers`` in private process memory, which the
node agent cannot map. With pdfabric as the transfer backend on ``--device cpu``, the plugin runs
the two constructors that allocate them inside ``shared_cpu_allocations``: each CPU tensor they
create with ``torch.zeros`` / ``torch.empty`` is a file in the agent's shared-memory directory
(``PDFABRIC_SHM_DIR``) mapped shared, so ``KVArgs`` points into memory the agent maps too. Nothing
else changes: same shapes, dtypes and zeroed contents; GPU tensors are untouched.

The files are named after the process and removed when it exits. A killed process cannot remove
its own: the next SGLang process to allocate in the directory removes those of processes that are
gone (``remove_orphans``), so a crash loop cannot fill the shared memory.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pdfabric_core.engines.launch import EngineEnv

ENV_SHM_DIR = EngineEnv.SHM_DIR.value
PREFIX = "pdfabric-engine-"

_lock = threading.Lock()
_created: list[str] = []


def shm_dir() -> str:
    return os.environ.get(ENV_SHM_DIR) or "/dev/shm"


def _remove_created() -> None:
    for path in _created:
        with contextlib.suppress(OSError):
            os.unlink(path)


atexit.register(_remove_created)


def remove_orphans(directory: str) -> list[str]:
    """Remove this module's files in ``directory`` whose process is gone; the paths removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.startswith(PREFIX):
                continue
            pid_text = name[len(PREFIX) :].split("-", 1)[0]
            if not pid_text.isdigit() or _alive(int(pid_text)):
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def shared_tensor(shape: tuple[int, ...], dtype: Any, directory: str) -> Any:
    """A zeroed CPU tensor backed by a new file in ``directory``, mapped shared."""
    import torch

    numel = math.prod(shape)
    path = shared_file(numel * torch.empty((), dtype=dtype).element_size(), directory)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def shared_file(nbytes: int, directory: str) -> str:
    """A new zeroed file of ``nbytes`` in ``directory``, removed when this process exits (or, after
    a crash, by the next one's ``remove_orphans``)."""
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    with _lock:
        _created.append(path)
    return path


def _shape_of(size: tuple[Any, ...]) -> tuple[int, ...] | None:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if all(isinstance(n, int) for n in size):
        return tuple(size)
    return None


def _is_cpu(device: Any) -> bool:
    return device is not None and str(device) == "cpu"


@contextlib.contextmanager
def shared_cpu_allocations(directory: str | None = None) -> Iterator[None]:
    """Within the block, ``torch.zeros`` and ``torch.empty`` with an explicit CPU device (and no
    other option than dtype) return tensors in shared-memory files of ``directory``."""
    import torch

    where = directory or shm_dir()
    remove_orphans(where)
    real: dict[str, Callable[..., Any]] = {"zeros": torch.zeros, "empty": torch.empty}

    def redirect(name: str) -> Callable[..., Any]:
        def alloc(*size: Any, **kwargs: Any) -> Any:
            if not size and "size" in kwargs:  # torch.zeros(size=...), as SGLang's MambaPool calls it
                size, kwargs = (kwargs["size"],), {k: v for k, v in kwargs.items() if k != "size"}
            shape = _shape_of(size)
            if shape is None or not _is_cpu(kwargs.get("device")) or set(kwargs) - {"device", "dtype"}:
                return real[name](*size, **kwargs)
            if math.prod(shape) == 0:
                return real[name](*size, **kwargs)
            return shared_tensor(shape, kwargs.get("dtype") or torch.get_default_dtype(), where)

        return alloc

    torch.zeros, torch.empty = redirect("zeros"), redirect("empty")
    try:
        yield
    finally:
        torch.zeros, torch.empty = real["zeros"], real["empty"]
