"""NIC registrations of an engine's GPU memory (GPUDirect RDMA by dma-buf), per rank.

An engine hands over one dma-buf fd per GPU allocation of its KV and state
(``protocol.handover``); ``NicMemory.hand_over`` checks each fd is a dma-buf at least as large as
the engine says, opens the node's RDMA device once (``memory.verbs``) and registers every fd with
``ibv_reg_dmabuf_mr`` at the engine's own device address as iova. What this node cannot honour is
refused (422) with the reason: ``layout_mismatch`` for an fd that is not a dma-buf or is smaller
than declared, ``nic_refused`` for no libibverbs, no RDMA device, an rdma-core without dma-buf
verbs, a kernel or NIC driver without dma-buf MRs (EOPNOTSUPP), or a registration the driver
refused. A rank's new hand-over replaces its previous registrations once every new one holds.

The registrations live in the agent's own protection domain; the caller closes the fds (the
kernel keeps its own reference to each registered dma-buf).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence

from pdfabric_agent.memory.dmabuf import dmabuf_exporter, fd_size
from pdfabric_agent.memory.verbs import MemoryRegion, NicDomain, Verbs, VerbsError
from pdfabric_agent.protocol.errors import layout_mismatch, malformed, nic_refused, unknown_rank
from pdfabric_agent.protocol.handover import DmabufHandover, HandoverAnswer, Registered

log = logging.getLogger("pdfabric.nic")


def open_first_device(device: str | None = None) -> NicDomain:
    return Verbs.load().open(device)


class NicMemory:
    """The agent's NIC registrations of engine GPU memory: rank id -> its memory regions."""

    def __init__(
        self,
        ranks: Collection[str],
        open_domain: Callable[[], NicDomain] = open_first_device,
        *,
        exporter_of: Callable[[int], str | None] = dmabuf_exporter,
        size_of: Callable[[int], int | None] = fd_size,
    ) -> None:
        self.ranks = frozenset(ranks)
        self._open_domain = open_domain
        self._exporter_of, self._size_of = exporter_of, size_of
        self._domain: NicDomain | None = None
        self._by_rank: dict[str, list[MemoryRegion]] = {}
        self._lock = threading.Lock()  # one hand-over at a time: registrations are rare and short

    def hand_over(self, msg: DmabufHandover, fds: Sequence[int]) -> HandoverAnswer:
        if msg.rank not in self.ranks:
            raise unknown_rank(f"rank {msg.rank!r} is not served by this agent; it serves {sorted(self.ranks)}")
        if len(fds) != len(msg.allocations):
            raise malformed(f"{len(msg.allocations)} allocations named, {len(fds)} fds attached: one fd each")
        exporters = []
        for i, (alloc, fd) in enumerate(zip(msg.allocations, fds, strict=True)):
            exporter = self._exporter_of(fd)
            if exporter is None:
                raise layout_mismatch(
                    f"allocations[{i}]: the fd handed over is not a dma-buf (no exporter in its fdinfo): export "
                    "it with cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)"
                )
            size = self._size_of(fd)
            if size is not None and size < alloc.nbytes:
                raise layout_mismatch(f"allocations[{i}]: the dma-buf holds {size} bytes, {alloc.nbytes} named")
            exporters.append(exporter)
        with self._lock:
            domain = self._domain_or_refuse()
            made: list[MemoryRegion] = []
            try:
                for alloc, fd in zip(msg.allocations, fds, strict=True):
                    made.append(domain.register_dmabuf(fd, 0, alloc.nbytes, alloc.base))
            except VerbsError as exc:
                for region in made:
                    domain.deregister(region)
                raise nic_refused(f"allocations[{len(made)}] of {msg.rank}: {exc} ({exc.failure.value})") from None
            for region in self._by_rank.pop(msg.rank, []):
                domain.deregister(region)
            self._by_rank[msg.rank] = made
        log.info("%s: %d GPU allocations registered with %s by dma-buf", msg.rank, len(made), domain.name)
        return HandoverAnswer(
            msg.rank,
            tuple(
                Registered(a.nbytes, exp, r.device, r.iova, r.lkey, r.rkey)
                for a, exp, r in zip(msg.allocations, exporters, made, strict=True)
            ),
        )

    def _domain_or_refuse(self) -> NicDomain:
        if self._domain is None:
            try:
                self._domain = self._open_domain()
            except VerbsError as exc:
                raise nic_refused(
                    f"GPU memory cannot be registered with a NIC here: {exc} ({exc.failure.value})"
                ) from None
        return self._domain

    def regions(self, rank: str) -> tuple[MemoryRegion, ...]:
        with self._lock:
            return tuple(self._by_rank.get(rank, ()))

    def forget(self, rank: str) -> None:
        """Drop a rank's registrations (its engine exited)."""
        with self._lock:
            regions = self._by_rank.pop(rank, [])
            if self._domain is not None:
                for region in regions:
                    self._domain.deregister(region)

    def close(self) -> None:
        with self._lock:
            self._by_rank.clear()
            if self._domain is not None:
                self._domain.close()
                self._domain = None
