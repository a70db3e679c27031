"""SGLang's own classes over its stock ``MetadataBuffers`` (issue 24): the pdfabric manager registers
KVArgs as SGLang's scheduler fills them (its KV pool's buffers, and ``MetadataBuffers.get_buf_infos()``
of a real ``MetadataBuffers`` of SGLang's row sizes, private CPU memory as SGLang allocates it unless
its pool is INTRA_NODE_NVLINK), SGLang's senders and receivers move a room through real agents on
tcp loopback, and decode finds the KV and every metadata row byte-exact where SGLang reads them,
nothing else touched. ``cuda:0``: the KV pools on the GPU (the agents map them by CUDA IPC, the
sender stages them for Mooncake's TCP); ``cpu``: in the agents' shared-memory directory."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdfabric_core.policy.types import Role  # noqa: E402
from pdfabric_core.rankmap import Rank, replica_ranks  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from tests.e2e.sglang_rooms import poll_until  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 16, 16
# No auxRowBytes: the spec's default is SGLang 0.5.23's ten MetadataBuffers rows, which the real
# buffers below (float32 hidden states of 4096) must match at registration.
MODEL = {"layers": LAYERS, "kvHeads": HEADS, "headDim": HEAD_DIM, "dtype": "float32", "pageSizeTokens": PAGE}
HIDDEN = 4096
POOL_PAGES, META_ROWS, PAGES = 32, 8, 6
ROOM = 9090
DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
]


def metadata_buffers() -> Any:
    from sglang.srt.disaggregation.utils import MetadataBuffers

    # As SGLang's scheduler builds them on tcp (no custom pool): CPU tensors of torch's own memory.
    return MetadataBuffers(META_ROWS, hidden_size=HIDDEN, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)


class Rank_:
    """One engine rank: a KV pool on ``device``, stock MetadataBuffers, the pdfabric manager."""

    def __init__(self, lc: LocalFabric, rank: Rank, heads: int, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from pdfabric_sglang.conn import PdfabricKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.pool = KVPool(layers=LAYERS, local_heads=heads, head_dim=HEAD_DIM, num_pages=POOL_PAGES,
                           page_size=PAGE, device=device, aux_device="cpu", shm_dir=lc.shm_dir)  # fmt: skip
        self.meta = metadata_buffers()
        args = kv_args(self.pool, engine_rank=rank.tp_rank, page_size=PAGE, kv_head_num=heads,
                       total_kv_head_num=HEADS, gpu_id=0)  # fmt: skip
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
        mode = DisaggregationMode.PREFILL if rank.role is Role.PREFILL else DisaggregationMode.DECODE
        self.manager = PdfabricKVManager(args, mode, None, False)
        reg = self.manager.registration
        assert reg.aux_inline and not reg.aux and reg.aux_slots == META_ROWS, reg  # private rows, inline
        assert reg.aux_row_bytes == list(args.aux_item_lens) == list(lc.spec.model.aux_row_bytes)

    def meta_rows(self) -> list[bytes]:
        """Every MetadataBuffers tensor's bytes, as SGLang's decode reads them."""
        ptrs, lens, _ = self.meta.get_buf_infos()

        return [ctypes.string_at(ptr, n) for ptr, n in zip(ptrs, lens, strict=True)]

    def close(self) -> None:
        self.manager.close()
        self.pool.close()


@pytest.mark.parametrize("device", DEVICES)
def test_stock_metadata_buffers_and_kv_move_byte_exact_through_sglangs_classes(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer, PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    spec = {"prefill": {"tp": 1}, "decode": {"tp": 2}, "transfer": {"transport": "tcp", "timeoutSeconds": 20},
            "model": MODEL}  # fmt: skip
    gen = torch.Generator().manual_seed(24)
    with LocalFabric(spec) as lc:
        token = tmp_path / "token"
        token.write_text(lc.token)
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token))
        (p,) = replica_ranks(lc.spec, Role.PREFILL, 0)
        decodes = replica_ranks(lc.spec, Role.DECODE, 0)
        src = Rank_(lc, p, HEADS, device, monkeypatch)
        ranks = [src]
        server = PdfabricKVBootstrapServer("127.0.0.1", 0)  # the prefill server's, asking its agent
        try:
            dst = {d: Rank_(lc, d, HEADS // 2, device, monkeypatch) for d in decodes}
            ranks.extend(dst.values())
            for buf in (*src.pool.k_buffers, *src.pool.v_buffers):
                buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.device))
            src_row, dst_row = 5, 2  # every metadata item's row of the room, as SGLang's set_buf writes them
            for tensor in vars(src.meta).values():
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
                    tensor[src_row] = torch.randint(0, 2**15, tensor[src_row].shape, generator=gen).to(tensor.dtype)
            before = {d: r.meta_rows() for d, r in dst.items()}

            receivers = {d: PdfabricKVReceiver(r.manager, f"127.0.0.1:{server.port}", ROOM) for d, r in dst.items()}
            for rx in receivers.values():
                rx.init(0)
            assert poll_until(list(receivers.values()), {KVPoll.WaitingForInput}, 60.0) == [KVPoll.WaitingForInput] * 2
            dst_pages = {d: r.pool.allocate_pages(PAGES)[::-1] for d, r in dst.items()}
            for d, rx in receivers.items():
                rx.send_metadata(np.asarray(dst_pages[d], np.int32), dst_row, None)
            sender = PdfabricKVSender(src.manager, f"127.0.0.1:{server.port}", ROOM)
            assert poll_until([sender], {KVPoll.WaitingForInput}, 60.0) == [KVPoll.WaitingForInput]
            src_pages = src.pool.allocate_pages(PAGES)
            sender.init(PAGES, src_row)
            sender.send(np.asarray(src_pages[:3], np.int32))  # a chunked prefill's first chunk
            sender.send(np.asarray(src_pages[3:], np.int32))  # the last
            done = poll_until([sender, *receivers.values()], {KVPoll.Success}, 60.0)
            assert done == [KVPoll.Success] * 3, [o.reason for o in (sender, *receivers.values())]

            want_meta = src.meta_rows()
            for i, (d, rank) in enumerate(dst.items()):
                heads = slice(i * HEADS // 2, (i + 1) * HEADS // 2)  # this decode rank's KV heads
                for got_buf, want_buf in zip(
                    (*rank.pool.k_buffers, *rank.pool.v_buffers),
                    (*src.pool.k_buffers, *src.pool.v_buffers),
                    strict=True,
                ):
                    got = got_buf.cpu().view(POOL_PAGES, PAGE, HEADS // 2, HEAD_DIM)
                    want = want_buf.cpu().view(POOL_PAGES, PAGE, HEADS, HEAD_DIM)
                    expect = torch.zeros_like(got)
                    expect[dst_pages[d]] = want[src_pages][:, :, heads]
                    assert torch.equal(got, expect), f"KV differs on {d.rank_id}"
                for item, (got_all, was, want_all, size) in enumerate(
                    zip(rank.meta_rows(), before[d], want_meta, rank.manager.kv_args.aux_item_lens, strict=True)
                ):
                    row = slice(dst_row * size, (dst_row + 1) * size)
                    assert got_all[row] == want_all[src_row * size : (src_row + 1) * size], f"metadata item {item}"
                    assert got_all[: row.start] + got_all[row.stop :] == was[: row.start] + was[row.stop :]
            moved = lc.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
            assert moved == 2 * LAYERS * PAGES * PAGE * HEADS * HEAD_DIM * 4, moved  # K and V, every head once
        finally:
            for rank in ranks:
                rank.close()
            server.close()
