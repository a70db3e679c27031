"""Engine-owned memory (ranks/engine_memory.py): a registration is checked against the PDCluster's
model and the devices the agent's transport takes before anything is mapped (GPU KV on tcp and the
NVLink transports, host memory on rdma; refusals name the transport actually chosen), mapped
buffers are the engine's bytes, and token-major head slices plan exactly the bytes a per-token
copy moves."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
from dataclasses import replace
from pathlib import Path

import pytest

from pdfabric_agent.memory.plan import MemoryMap, TransferSide, decode_targets, plan_transfer, sender_duties
from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_memory import EngineMemory, MemoryRules, engine_layout
from pdfabric_core.policy.types import MemPool, Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import parse_spec

MODEL = {"layers": 2, "kvHeads": 4, "headDim": 16, "dtype": "float32", "pageSizeTokens": 16,
         "stateBytesPerRequest": 0, "auxRowBytes": [64, 64]}  # fmt: skip
PAGE = 16 * 4 * 16 * 4  # tokens x heads x dim x bytes at TP 1


def spec(tp: int = 1, **model: object) -> object:
    return parse_spec({"prefill": {"tp": tp}, "decode": {"tp": tp}, "transfer": {"transport": "tcp"},
                       "model": {**MODEL, **model}})  # fmt: skip


def shm_file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "engine-pool"
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def registration(
    path: Path, *, pages: int = 4, page_bytes: int = PAGE, layers: int = 2, aux: tuple[int, ...] = (64, 64)
) -> MemoryRegistration:
    off = 0
    k, v, a = [], [], []
    for _ in range(layers):
        for side in (k, v):
            side.append(BufferShare(ShareKind.SHM, pages * page_bytes, off, path=str(path)))
            off += pages * page_bytes
    for row in aux:
        a.append(BufferShare(ShareKind.SHM, 8 * row, off, path=str(path)))
        off += 8 * row
    return MemoryRegistration("prefill-0-tp0-cp0", PageOrder.TOKEN_MAJOR, 16, page_bytes, k, v, 0, [], list(aux), a)


TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)


def layout_of(reg: MemoryRegistration, s: object, rules: MemoryRules = TCP) -> object:
    return engine_layout(reg, s, Rank(Role.PREFILL, 0, 0), rules)  # type: ignore[arg-type]


def refused(reg: MemoryRegistration, s: object, rules: MemoryRules = TCP) -> ApiError:
    with pytest.raises(ApiError) as exc:
        layout_of(reg, s, rules)
    assert (exc.value.status, exc.value.reason) == (422, "layout_mismatch")
    return exc.value


def test_a_fitting_registration_gives_the_engine_layout(tmp_path: Path) -> None:
    lay = layout_of(registration(tmp_path / "f"), spec())
    assert (lay.layers, lay.local_heads, lay.kv_pages, lay.aux_slots, lay.page_order) == (
        2,
        4,
        4,
        8,
        PageOrder.TOKEN_MAJOR,
    )
    assert lay.page_bytes == PAGE and lay.token_head_bytes == 16 * 4


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"page_bytes": PAGE // 2}, "KV bytes per page"),
        ({"layers": 3}, "3 K, 3 V and 0 latent buffers"),
    ],
)
def test_a_registration_that_does_not_fit_the_model_names_the_mismatch(
    tmp_path: Path, change: dict[str, object], named: str
) -> None:
    assert named in refused(registration(tmp_path / "f", **change), spec()).message  # type: ignore[arg-type]


def gpu_share(nbytes: int) -> BufferShare:
    export = {"handle": "ab", "offset": 0, "nbytes": nbytes, "device": 0, "owner_pid": 1}
    return BufferShare(ShareKind.CUDA_IPC, nbytes, 0, export=export)


def with_gpu(reg: MemoryRegistration, *, kv: bool = True, aux: bool = False) -> MemoryRegistration:
    """The registration with its KV (and aux) buffers as CUDA IPC shares of the same sizes."""
    k = [gpu_share(b.nbytes) for b in reg.k] if kv else reg.k
    v = [gpu_share(b.nbytes) for b in reg.v] if kv else reg.v
    a = [gpu_share(b.nbytes) for b in reg.aux] if aux else reg.aux
    return MemoryRegistration(reg.rank, reg.page_order, 16, PAGE, k, v, 0, [], [64, 64], a)


def rules(transport: str, requested: str | None = None, pool: str = "NONE", gpu: bool = True) -> MemoryRules:
    return MemoryRules(Transport(transport), Transport(requested or transport), MemPool(pool), engine_moves_gpu=gpu)


@pytest.mark.parametrize(
    ("rule", "kv_gpu", "aux_gpu"),
    [
        (rules("tcp"), True, False),
        (rules("tcp"), False, False),
        (rules("rdma"), False, False),
        (rules("nvlink-intra", pool="INTRA_NODE_NVLINK"), True, True),
        # placement.fallback TCP: the agent runs tcp, so the GPU engine is served, its aux wherever
        # the pool puts metadata (INTRA_NODE_NVLINK: on the GPU; NVLINK: on the CPU).
        (rules("tcp", "nvlink-intra", pool="INTRA_NODE_NVLINK"), True, True),
        (rules("tcp", "nvlink", pool="NVLINK"), True, False),
    ],
    ids=[
        "tcp-gpu-kv",
        "tcp-cpu-kv",
        "rdma-cpu-kv",
        "nvlink-intra-gpu",
        "fallback-from-nvlink-intra",
        "fallback-from-nvlink",
    ],
)
def test_engine_kv_is_taken_on_the_devices_of_the_transport_the_agent_runs(
    tmp_path: Path, rule: MemoryRules, kv_gpu: bool, aux_gpu: bool
) -> None:
    reg = with_gpu(registration(tmp_path / "f"), kv=kv_gpu, aux=aux_gpu)
    assert layout_of(reg, spec(), rule).kv_pages == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("rule", "kv_gpu", "aux_gpu", "message"),
    [
        (rules("rdma"), True, False, "KV buffers must be cpu memory on this agent's transport (rdma; memPool NONE); "
         "one is shared as cuda-ipc (an engine's GPU KV moves on tcp, nvlink-intra, nvlink)"),
        (rules("nvlink-intra", pool="INTRA_NODE_NVLINK"), False, True, "KV buffers must be cuda memory on this "
         "agent's transport (nvlink-intra; memPool INTRA_NODE_NVLINK); one is shared as shm"),
        (rules("tcp"), True, True, "aux buffers must be cpu memory on this agent's transport (tcp; memPool NONE); "
         "one is shared as cuda-ipc"),
        # A fallback refusal names tcp, the transport the agent runs, and what it fell back from.
        (rules("tcp", "nvlink", pool="NVLINK"), True, True, "aux buffers must be cpu memory on this agent's "
         "transport (tcp, the declared fallback from nvlink; memPool NVLINK); one is shared as cuda-ipc"),
        (rules("tcp", "nvlink-intra", pool="INTRA_NODE_NVLINK", gpu=False), True, True, "KV buffers are GPU memory, "
         "but the transfer engine of this agent's transport (tcp, the declared fallback from nvlink-intra; memPool "
         "INTRA_NODE_NVLINK) moves host memory only"),
        # The backend says why it moves host memory only, and what to do instead.
        (replace(rules("nvlink-intra", gpu=False), host_only_because="the nixl backend moves GPU memory only in the "
         "agent's own pools"), True, False, "moves host memory only: the nixl backend moves GPU memory only in the "
         "agent's own pools"),
    ],
    ids=["rdma-gpu-kv", "nvlink-intra-cpu-kv", "tcp-gpu-aux", "fallback-gpu-aux", "fallback-engine-without-cuda",
         "backend-says-why"],
)  # fmt: skip
def test_a_refusal_names_the_transport_the_agent_runs(
    tmp_path: Path, rule: MemoryRules, kv_gpu: bool, aux_gpu: bool, message: str
) -> None:
    reg = with_gpu(registration(tmp_path / "f"), kv=kv_gpu, aux=aux_gpu)
    assert message in refused(reg, spec(), rule).message


def test_the_cpu_agents_mooncake_is_the_build_without_cuda() -> None:
    """This environment's Mooncake is the CPU agent image's (mooncake-transfer-engine-non-cuda): GPU
    memory is refused before it reaches an engine that would read a device pointer as host memory."""
    pytest.importorskip("mooncake.engine")
    from pdfabric_agent.transfer.mooncake import cuda_build

    assert cuda_build() is False


def test_mapped_buffers_are_the_engines_bytes_and_files_elsewhere_are_refused(tmp_path: Path) -> None:
    reg = registration(tmp_path / "f")
    size = sum(b.nbytes for b in (*reg.k, *reg.v, *reg.aux))
    path = shm_file(tmp_path, size)
    reg = registration(path)
    lay = layout_of(reg, spec())
    mem = EngineMemory.map(reg, lay, shm_dir=str(tmp_path), gpu=0)  # type: ignore[arg-type]
    try:
        with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), size) as engine:
            engine[reg.v[1].offset + 5 : reg.v[1].offset + 8] = b"abc"  # the engine writes
            assert mem.kv[3].read(5, 3) == b"abc"  # (layer 1, V) in (layer, K/V) order
            mem.aux[1].write(0, b"xy")  # the agent writes (a side-channel row)
            assert engine[reg.aux[1].offset : reg.aux[1].offset + 2] == b"xy"
        assert mem.memory_map.kv[1] - mem.memory_map.kv[0] == reg.v[0].offset - reg.k[0].offset
    finally:
        mem.close()
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(ApiError, match="not in the agent's shared-memory directory"):
        EngineMemory.map(reg, lay, shm_dir=str(other), gpu=0)  # type: ignore[arg-type]


def test_token_major_head_slices_move_each_tokens_heads(tmp_path: Path) -> None:
    """Prefill TP 1 -> decode TP 2 in SGLang's [token][head][dim] pages: decode rank 1 gets heads
    2..3 of every token, at its own token rows, and nothing else."""
    s = parse_spec({"prefill": {"tp": 1}, "decode": {"tp": 2}, "transfer": {"transport": "tcp"}, "model": MODEL})
    src_reg, dst_reg = registration(tmp_path / "a"), registration(tmp_path / "b", page_bytes=PAGE // 2)
    src = layout_of(src_reg, s)
    dst = engine_layout(dst_reg, s, Rank(Role.DECODE, 0, 1), TCP)
    tokens, heads, row = 16, 4, 16 * 4  # per token: 4 heads x 64 bytes at the source, 2 at decode
    src_buf = (ctypes.c_uint8 * (4 * PAGE * 4))()
    dst_buf = (ctypes.c_uint8 * (4 * PAGE * 2))()
    src_map = MemoryMap(tuple(ctypes.addressof(src_buf) + i * 4 * PAGE for i in range(4)), (), tuple(range(1, 3)))
    dst_map = MemoryMap(tuple(ctypes.addressof(dst_buf) + i * 2 * PAGE for i in range(4)), (), tuple(range(1, 3)))
    for i in range(len(src_buf)):
        src_buf[i] = (i * 7 + 3) % 251
    target = decode_targets(s, 0)[1]
    duties = sender_duties(s, target, 0, 2)
    assert duties is not None
    plan = plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None), TransferSide(dst, dst_map, [0, 2], [], None))  # fmt: skip
    for b in plan.kv:
        ctypes.memmove(b.dst, b.src, b.length)
    for buf in range(4):
        for sp, dp in ((3, 0), (1, 2)):
            for t in range(tokens):
                s_off = buf * 4 * PAGE + sp * PAGE + t * heads * row + 2 * row  # heads 2..3 of token t
                d_off = buf * 2 * PAGE + dp * (PAGE // 2) + t * 2 * row
                assert bytes(dst_buf[d_off : d_off + 2 * row]) == bytes(src_buf[s_off : s_off + 2 * row])
    assert sum(b.length for b in plan.kv) == 4 * 2 * tokens * 2 * row  # buffers x pages x tokens x slice
    # A head-major peer cannot take token-major pages: refused when planned, naming both orders.
    with pytest.raises(ValueError, match="page layouts differ"):
        plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None), TransferSide(type(dst)(**{**vars(dst), "page_order": PageOrder.HEAD_MAJOR}), dst_map, [0, 2], [], None))  # fmt: skip


def test_the_engines_aux_rows_are_taken_from_its_registration(tmp_path: Path) -> None:
    """auxRowBytes is not typed by hand: the engine's rows are the rank's (prefill and decode are
    held equal on each room's info), whatever the spec's prediction figure says."""
    lay = layout_of(registration(tmp_path / "f", aux=(64, 512, 16)), spec())
    assert (lay.aux_items, lay.aux_slots) == ((64, 512, 16), 8)


def test_private_aux_rows_get_rows_of_the_agents_own(tmp_path: Path) -> None:
    """An engine that keeps its aux buffers private (SGLang's CPU MetadataBuffers) registers their
    row sizes and count; the agent makes rows of its own in its shared-memory directory, takes a
    send's row into them and reads a landed row back out, and removes them with the memory."""
    reg = registration(tmp_path / "f", aux=())
    size = sum(b.nbytes for b in (*reg.k, *reg.v))
    path = shm_file(tmp_path, size)
    reg = dataclasses.replace(registration(path, aux=()), aux_row_bytes=[64, 32], aux_slots=5)
    assert reg.aux_inline and MemoryRegistration.parse(reg.to_json()) == reg
    lay = layout_of(reg, spec())
    assert (lay.aux_items, lay.aux_slots) == ((64, 32), 5)
    mem = EngineMemory.map(reg, lay, shm_dir=str(tmp_path), gpu=0)  # type: ignore[arg-type]
    owned = [p.handle for p in mem.aux]
    try:
        assert mem.aux_inline and [p.size for p in mem.aux] == [5 * 64, 5 * 32]
        assert all(Path(h).parent == tmp_path for h in owned) and mem.memory_map.aux == tuple(p.addr for p in mem.aux)
        mem.put_aux_row(3, (b"a" * 64, b"b" * 32))
        assert mem.aux_row(3) == (b"a" * 64, b"b" * 32) and mem.aux_row(2) == (bytes(64), bytes(32))
        with pytest.raises(ValueError):
            mem.put_aux_row(5, (b"a" * 64, b"b" * 32))  # past the registered rows
    finally:
        mem.close()
    assert not any(Path(h).exists() for h in owned)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"aux_slots": 4, "aux": "shares"}, "not both"),
        ({"aux_slots": 0, "aux_row_bytes": [64]}, "aux_slots"),
        ({"aux_row_bytes": [64, 32]}, "row bytes of every aux buffer"),
    ],
)
def test_a_registration_of_private_aux_rows_says_what_to_fix(
    tmp_path: Path, body: dict[str, object], says: str
) -> None:
    reg = registration(tmp_path / "f")
    doc = {**reg.to_json(), "aux": [], **body}
    if body.get("aux") == "shares":
        doc["aux"] = reg.to_json()["aux"]
    with pytest.raises(ApiError) as err:
        MemoryRegistration.parse(doc)
    assert err.value.status == 400 and says in err.value.message


def test_a_path_swapped_between_a_file_and_a_link_while_it_is_checked_is_refused_never_an_error(
    tmp_path: Path,
) -> None:
    """realpath reads the link the name was a moment ago: readlink then fails (EINVAL) on the file
    swapped in. That is the engine's bad file, a 4xx (issue 40: it was a 500)."""
    import os
    import threading

    from pdfabric_agent.ranks.engine_board import open_engine_file

    shm = tmp_path / "shm"
    shm.mkdir()
    good = shm / "good"
    good.write_bytes(b"x" * 4096)
    name = shm / "swapped"
    stop = threading.Event()

    def swap() -> None:
        i = 0
        while not stop.is_set():
            tmp = shm / f".tmp{i % 2}"
            tmp.unlink(missing_ok=True)
            if i % 2:
                os.symlink(good, tmp)
            else:
                os.link(good, tmp)
            os.replace(tmp, name)
            i += 1

    name.write_bytes(b"x")
    t = threading.Thread(target=swap, daemon=True)
    t.start()
    outcomes: dict[str, int] = {}
    try:
        for _ in range(20000):
            try:
                fd, _st = open_engine_file(str(name), str(shm))
                os.close(fd)
                outcomes["opened"] = outcomes.get("opened", 0) + 1
            except ApiError as exc:
                assert exc.status == 422, exc
                outcomes["refused"] = outcomes.get("refused", 0) + 1
    finally:
        stop.set()
        t.join(5)
    assert outcomes.get("opened"), outcomes
