"""Transfer backends by name: the spec's ``backend`` picks one from this registry.

Each backend is one module with a ``create(transport, BackendOptions) -> TransferBackend``
factory, registered here behind a function that imports the module on first use, so its engine
bindings (Mooncake, MORI, NIXL: native wheels) load only when a spec asks for that backend. A new engine
backend is one new module and one registration here.
"""

from __future__ import annotations

from collections.abc import Callable

from pdfabric_agent.transfer.base import BackendOptions, TransferBackend
from pdfabric_agent.transfer.nixl import PATHS as NIXL_PATHS
from pdfabric_core.policy.types import Transport

BackendFactory = Callable[[Transport, BackendOptions], "TransferBackend"]

_REGISTRY: dict[str, BackendFactory] = {}
_PATHS: dict[str, tuple[str, ...]] = {}


def register_backend(name: str, factory: BackendFactory, *, paths: tuple[str, ...]) -> None:
    """`paths`: every `path` metric label the backend's instances can report (their ``paths``);
    with the side channel's, the closed set a peer's byte report may name."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = factory
    _PATHS[name] = paths


def path_labels() -> frozenset[str]:
    """The `path` labels of every registered backend."""
    return frozenset(p for paths in _PATHS.values() for p in paths)


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def make_backend(
    name: str, transport: Transport, *, host: str, gpu: int, max_batch_entries: int, timeout_s: float = 30.0
) -> TransferBackend:
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(backend_names())}")
    return factory(transport, BackendOptions(host, gpu, max_batch_entries, timeout_s))


def _mooncake(transport: Transport, opts: BackendOptions) -> TransferBackend:
    from pdfabric_agent.transfer import mooncake

    return mooncake.create(transport, opts)


def _mori(transport: Transport, opts: BackendOptions) -> TransferBackend:
    from pdfabric_agent.transfer import mori

    return mori.create(transport, opts)


def _nixl(transport: Transport, opts: BackendOptions) -> TransferBackend:
    from pdfabric_agent.transfer import nixl

    return nixl.create(transport, opts)


register_backend("mooncake", _mooncake, paths=("mooncake", "nvlink-kernel"))  # engine; fast path over it
register_backend("mori", _mori, paths=("mori",))
register_backend("nixl", _nixl, paths=NIXL_PATHS)  # one label per transport; the module loads NIXL only in a backend
