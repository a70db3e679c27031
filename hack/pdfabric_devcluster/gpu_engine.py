"""A serving engine's own memory on a GPU, for GPU tests and benchmarks: one rank's K and V buffer
per layer and its state per state layer on ``cuda:N`` (torch allocations the agent opens by CUDA
IPC), its aux rows in a shared-memory file of the agent's directory (SGLang keeps its
MetadataBuffers on the CPU unless its pool is INTRA_NODE_NVLINK), registered with the rank's agent
(``POST /v1/memory``) as SGLang's manager registers its KVArgs. Pages are token-major
(``[page][token][head][head bytes]``), as SGLang's."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from typing import Any

from pdfabric_agent.client.api import AgentClient
from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import MemoryAnswer
from pdfabric_agent.protocol.wire import BufferShare, ShareKind


class GpuEngineRank:
    """One engine rank's buffers: ``k[layer]``, ``v[layer]`` of shape (pages, page bytes) and
    ``state[layer]`` of (slots, slot bytes), uint8 on the GPU; ``aux[item]`` (slots, row bytes), uint8
    on the CPU in shared memory."""

    def __init__(
        self,
        rank_id: str,
        *,
        layers: int,
        heads: int,
        head_bytes: int,
        page_tokens: int,
        pages: int,
        aux_row_bytes: Sequence[int],
        aux_slots: int,
        shm_dir: str,
        state_layers: int = 0,
        state_slot_bytes: int = 0,
        state_slots: int = 0,
        gpu: int = 0,
    ) -> None:
        import torch

        from pdfabric_agent.memory import ipc

        self.rank_id, self.gpu = rank_id, gpu
        self.page_tokens, self.heads, self.head_bytes = page_tokens, heads, head_bytes
        self.page_bytes = page_tokens * heads * head_bytes
        dev = f"cuda:{gpu}"
        self.k = [torch.zeros((pages, self.page_bytes), dtype=torch.uint8, device=dev) for _ in range(layers)]
        self.v = [torch.zeros((pages, self.page_bytes), dtype=torch.uint8, device=dev) for _ in range(layers)]
        self.state = [
            torch.zeros((state_slots, state_slot_bytes), dtype=torch.uint8, device=dev)
            for _ in range(state_layers if state_slot_bytes else 0)
        ]
        self.aux_row_bytes = list(aux_row_bytes)
        self.path = os.path.join(shm_dir, f"gpuengine-{os.getpid()}-{rank_id}")
        size = sum(aux_slots * row for row in aux_row_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.aux: list[Any] = []
        aux_shares, off = [], 0
        for row in aux_row_bytes:
            self.aux.append(
                torch.frombuffer(self._mem, dtype=torch.uint8, count=aux_slots * row, offset=off).view(aux_slots, row)
            )
            aux_shares.append(BufferShare(ShareKind.SHM, aux_slots * row, off, path=self.path))
            off += aux_slots * row

        def share(t: Any) -> BufferShare:
            export = ipc.export_pool(t.data_ptr(), t.nbytes, gpu)
            return BufferShare(ShareKind.CUDA_IPC, t.nbytes, export.offset, export=dict(export.to_json()))

        torch.cuda.synchronize(gpu)  # the zeros are there before the agent reads anything
        self.registration = MemoryRegistration(
            rank_id, PageOrder.TOKEN_MAJOR, page_tokens, self.page_bytes,
            [share(t) for t in self.k], [share(t) for t in self.v],
            state_slot_bytes, [share(t) for t in self.state], self.aux_row_bytes, aux_shares,
        )  # fmt: skip

    def register(self, client: AgentClient) -> MemoryAnswer:
        return client.register_memory(self.registration)

    def page_view(self, buffer: Any) -> Any:
        """(pages, tokens, heads, head bytes) of one K or V buffer."""
        return buffer.view(-1, self.page_tokens, self.heads, self.head_bytes)

    def close(self) -> None:
        self.aux.clear()
        with contextlib.suppress(BufferError):  # a view still exported: the OS unmaps at exit
            self._mem.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
