"""An engine's own memory through a real agent's engine door (issue 27, item 3): whatever a
registration says, the answer is 200 or a 4xx with a reason, and so is every receive after any
registration that was accepted. Fuzzed with real files in the agent's shared-memory directory:
sparse files of 200 TiB, files outside it, symlinks (also swapped while the agent registers),
directories, FIFOs, offsets and sizes up to 2^64-1, registrations that grow the pool after rooms
ran, and two ranks naming one file range."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdfabric_agent.client.api import AgentClient, AgentRefused
from pdfabric_devcluster.fabric import LocalFabric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC = {
    "prefill": {"tp": 1},
    "decode": {"tp": 2},
    "transfer": {"transport": "tcp", "timeoutSeconds": 3},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "auxRowBytes": [16, 8]},
}
D0, D1 = "decode-0-tp0", "decode-0-tp1"
PAGE = 4 * 1 * 16 * 2  # tokens x KV heads on one of two ranks x head dim x bf16
AUX = (16, 8)
HUGE = 200 << 40  # a sparse 200 TiB file (tmpfs takes it; nothing is allocated)
ROOMS = itertools.count(1000)


@pytest.fixture(scope="module")
def lc() -> Iterator[LocalFabric]:
    with LocalFabric(SPEC, env={"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "3"}) as fabric:
        yield fabric


@pytest.fixture(scope="module")
def files(lc: LocalFabric, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Paths an engine might name, by what they are."""
    shm = Path(lc.shm_dir)
    outside = tmp_path_factory.mktemp("outside") / "secret"
    outside.write_bytes(b"s" * (1 << 20))
    made = {
        kind: shm / f"fuzz-{lc.uid[:8]}-{kind}"
        for kind in ("good", "sparse", "empty", "link-in", "link-out", "dir", "fifo")
    }
    with open(made["good"], "wb") as fh:
        fh.truncate(16 << 20)
    with open(made["sparse"], "wb") as fh:
        fh.truncate(HUGE)
    made["empty"].touch()
    made["link-in"].symlink_to(made["good"])
    made["link-out"].symlink_to(outside)
    made["dir"].mkdir()
    os.mkfifo(made["fifo"])
    paths = {k: str(v) for k, v in made.items()}
    paths["outside"] = str(outside)
    paths["missing"] = str(shm / f"fuzz-{lc.uid[:8]}-missing")
    yield paths
    for p in made.values():
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)


def share(path: str, offset: int, nbytes: int) -> dict[str, Any]:
    return {"kind": "shm", "path": path, "offset": offset, "nbytes": nbytes}


def registration(rank: str, path: str, *, pages: int, base: int = 0, aux_rows: int = 8) -> dict[str, Any]:
    """One rank's buffers laid out one after another in `path` from `base`."""
    off, k, v, aux = base, [], [], []
    for _ in range(2):
        for side in (k, v):
            side.append(share(path, off, pages * PAGE))
            off += pages * PAGE
    for row in AUX:
        aux.append(share(path, off, aux_rows * row))
        off += aux_rows * row
    return {"rank": rank, "page_order": "token-major", "page_tokens": 4, "kv_page_bytes": PAGE, "k": k, "v": v,
            "state_slot_bytes": 0, "state": [], "aux_row_bytes": list(AUX), "aux": aux}  # fmt: skip


def call(client: AgentClient, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    try:
        return 200, client._call(method, path, body)
    except AgentRefused as exc:
        return exc.status, exc


def register(lc: LocalFabric, body: dict[str, Any]) -> tuple[int, Any]:
    return call(lc.client(body["rank"]), "POST", "/v1/memory", body)


def receive_and_abort(lc: LocalFabric, rank: str, pages: list[int], aux: int | None) -> int:
    """A receive into the engine's memory (then given up, so the next registration is not refused
    for an open room); its status."""
    client, room = lc.client(rank), next(ROOMS)
    body: dict[str, Any] = {"rank": rank, "room": room, "kv_pages": pages, "prefill_replica": 0, "engine_memory": True}
    if aux is not None:
        body["aux_index"] = aux
    status, _ = call(client, "POST", "/v1/receive", body)
    if status == 200:
        call(client, "POST", "/v1/abort", {"rank": rank, "room": room, "reason": "fuzz"})
    return status


def rss_kib(lc: LocalFabric, rank: str) -> int:
    agent = lc.agents[lc.agent_of(rank)]
    assert agent.proc is not None
    for line in Path(f"/proc/{agent.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_larger_pool_after_rooms_ran_takes_receives_beyond_the_old_size(
    lc: LocalFabric, files: dict[str, str]
) -> None:
    assert register(lc, registration(D0, files["good"], pages=8))[0] == 200
    assert receive_and_abort(lc, D0, [0, 7], 1) == 200
    assert register(lc, registration(D0, files["good"], pages=64))[0] == 200
    assert receive_and_abort(lc, D0, [8, 63], 1) == 200
    assert receive_and_abort(lc, D0, [64], 1) == 400  # past the new size: refused, not 500


def test_a_registration_at_the_end_of_a_200_tib_file_is_mapped_and_64_gib_costs_no_claims(
    lc: LocalFabric, files: dict[str, str]
) -> None:
    end = HUGE - 4 * 8 * PAGE - sum(8 * r for r in AUX)
    status, answer = register(lc, registration(D0, files["sparse"], pages=8, base=end))
    assert status == 200, answer  # only the buffers' range is mapped, not the whole file
    assert receive_and_abort(lc, D0, [0, 7], 0) == 200
    before = rss_kib(lc, D0)
    pages = (16 << 30) // PAGE  # 16 GiB per buffer, 64 GiB of KV: mapped sparse
    assert register(lc, registration(D0, files["sparse"], pages=pages))[0] == 200
    assert receive_and_abort(lc, D0, [0, pages - 1], 0) == 200
    grew = rss_kib(lc, D0) - before
    assert grew < 16 * 1024, f"the agent grew {grew} KiB for a sparse 64 GiB registration"


def test_two_ranks_may_not_register_one_file_range(lc: LocalFabric, files: dict[str, str]) -> None:
    assert register(lc, registration(D0, files["good"], pages=8))[0] == 200
    status, err = register(lc, registration(D1, files["good"], pages=8, base=4096))
    assert status == 409 and "decode-0-tp0" in err.message, err
    status, err = register(lc, registration(D1, files["link-in"], pages=8, base=4096))  # the same file by a link
    assert status == 409, err
    assert register(lc, registration(D1, files["good"], pages=8, base=8 << 20))[0] == 200  # its own range


def test_swapping_a_symlink_during_registration_gets_4xx_and_never_maps_outside(
    lc: LocalFabric, files: dict[str, str]
) -> None:
    link = files["link-in"] + "-swap"
    stop = threading.Event()

    def swap() -> None:
        """The name is a link out, a link in, or the good file itself (a hard link), in turn: a
        resolve that reads a link the name no longer is fails (EINVAL), which was a 500."""
        for i in itertools.count():
            if stop.is_set():
                return
            tmp = f"{link}.{i % 2}"
            try:
                if i % 3 == 2:
                    os.link(files["good"], tmp)
                else:
                    os.symlink(files["outside"] if i % 3 else files["good"], tmp)
                os.replace(tmp, link)
            except OSError:
                pass

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    statuses = []
    try:
        for _ in range(300):
            statuses.append(register(lc, registration(D0, link, pages=8))[0])
    finally:
        stop.set()
        t.join(5)
        for p in (link, f"{link}.0", f"{link}.1"):
            Path(p).unlink(missing_ok=True)
    agent = lc.agents[lc.agent_of(D0)]
    assert agent.proc is not None
    assert files["outside"] not in Path(f"/proc/{agent.proc.pid}/maps").read_text()
    assert set(statuses) <= {200, 422}, sorted(set(statuses))
    assert 422 in statuses  # the race was run: some tries saw the outside file


OFFSETS = st.one_of(
    st.sampled_from([0, 1, 4096, HUGE - 4096, HUGE, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 1 << 24)
)
SIZES = st.one_of(st.sampled_from([1, PAGE, 8 * PAGE, 2**40, 2**63, 2**64 - 1]), st.integers(1, 1 << 22))
KINDS = st.sampled_from(["good", "sparse", "empty", "link-in", "link-out", "dir", "fifo", "outside", "missing"])
PAGES = st.one_of(
    st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), st.lists(st.integers(0, 80), max_size=6)
)


@st.composite
def registrations(draw: st.DrawFn) -> dict[str, Any]:
    """A registration that fits (half the time on a file the agent may map), with some of its
    buffers changed: their file, offset or size."""
    rank = draw(st.sampled_from([D0, D1]))
    base = {D0: 0, D1: 8 << 20}[rank]  # each rank its own range of the shared files
    body = registration(rank, "", pages=draw(st.sampled_from([1, 8, 64])), base=base)
    kind = draw(st.one_of(st.sampled_from(["good", "sparse", "link-in"]), KINDS))
    for side in ("k", "v", "aux"):
        for s in body[side]:
            s["path"] = kind
            if draw(st.integers(0, 9)) == 0:
                s["offset"] = draw(OFFSETS)
            if draw(st.integers(0, 9)) == 0:
                s["nbytes"] = draw(SIZES)
            if draw(st.integers(0, 19)) == 0:
                s["path"] = draw(KINDS)
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=registrations(), receives=st.lists(st.tuples(PAGES, st.integers(-1, 20)), max_size=3))
def test_no_registration_and_no_receive_after_it_answers_5xx(
    lc: LocalFabric, files: dict[str, str], body: dict[str, Any], receives: list[tuple[list[int], int]]
) -> None:
    for side in ("k", "v", "aux"):
        for s in body[side]:
            s["path"] = files[s["path"]]
    status, answer = register(lc, body)
    event(f"registration {status}")
    assert status < 500, answer
    if status != 200:
        return
    for pages, aux in receives:
        got = receive_and_abort(lc, body["rank"], pages, aux if aux >= 0 else None)
        event(f"receive {got}")
        assert got < 500
