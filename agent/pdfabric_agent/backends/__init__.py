"""Transfer backends; ``make_backend`` picks one by the spec's backend name."""

from __future__ import annotations

from pdfabric_agent.backend import TransferBackend
from pdfabric_core.policy.types import Transport


def make_backend(name: str, transport: Transport, *, host: str, gpu: int, max_batch_entries: int) -> TransferBackend:
    if name == "mooncake":
        from pdfabric_agent.backends.mooncake import MooncakeBackend

        backend = MooncakeBackend(transport, host=host, gpu=gpu, max_batch_entries=max_batch_entries)
        if transport is Transport.NVLINK_INTRA:
            # NVLink gather/scatter kernels for GPU pools of agents on this node; engine as fallback.
            from pdfabric_agent.fastpath.backend import maybe_fast_path

            return maybe_fast_path(backend, gpu=gpu)
        return backend
    if name == "mori":
        from pdfabric_agent.backends.mori import MoriBackend

        return MoriBackend(transport, host=host, gpu=gpu, max_batch_entries=max_batch_entries)
    raise ValueError(f"unknown backend {name!r}: mooncake or mori")
