"""Transfer backends; ``make_backend`` picks one by the spec's backend name."""

from __future__ import annotations

from pdfabric_agent.backend import TransferBackend
from pdfabric_core.policy.types import Transport


def make_backend(name: str, transport: Transport, *, host: str, gpu: int, max_batch_entries: int) -> TransferBackend:
    if name == "mooncake":
        from pdfabric_agent.backends.mooncake import MooncakeBackend

        return MooncakeBackend(transport, host=host, gpu=gpu, max_batch_entries=max_batch_entries)
    if name == "mori":
        from pdfabric_agent.backends.mori import MoriBackend

        return MoriBackend(transport, host=host, gpu=gpu, max_batch_entries=max_batch_entries)
    raise ValueError(f"unknown backend {name!r}: mooncake or mori")
