"""A prefill or decode engine process that moves its KV through pdfabric the way SGLang does.

    python -m pdfabric_refengine.pd --role prefill|decode --requests R.json --out O.json ...

SGLang's plugins are loaded with SGLang's own ``load_plugins()`` (the ``sglang.srt.plugins`` entry
point of the installed pdfabric distribution), and the backend classes come from SGLang's
``get_kv_class``, then are driven as SGLang's schedulers drive them:

- prefill (``disaggregation/prefill.py``): a sender per rank and request, polled until decode is
  ready (WaitingForInput), ``init(num_pages, aux_index)``, the prompt's forward pass into the pool
  pages, ``send`` in two chunks (the last with the state indices), polled until Success.
- decode (``disaggregation/decode.py``): a receiver per rank and request, ``init``, polled to
  WaitingForInput, pages and an aux row allocated, ``send_metadata``, polled until Success, then
  greedy generation from the pages alone.

One process hosts every rank of its replica (SGLang runs one per rank): each rank's manager reads
the rank's place from the environment, set here before it is built as a launcher would set it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.protocol.views import RoomState
from pdfabric_core.engines.launch import EngineEnv
from pdfabric_core.rankmap import Rank
from pdfabric_refengine.direct import DirectRank, DirectReceiver, DirectSender
from pdfabric_refengine.engine import decode, pages_for, prefill_cp
from pdfabric_refengine.kvpool import KVPool, kv_args
from pdfabric_refengine.model import build_model, model_shape
from pdfabric_refengine.rooms import (
    GaveUp,
    hold_row,
    outcome,
    release_row,
    send_in_two_chunks,
    wait_all,
)


def load_backend() -> dict[str, Any]:
    """SGLang's classes for ``--disaggregation-transfer-backend pdfabric``, after its plugin loading."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation import utils

    backend = utils.TransferBackend("pdfabric")  # the enum the plugin extended (re-read after load)
    assert TransferBackend is not utils.TransferBackend
    return {
        kind: utils.get_kv_class(backend, getattr(KVClassType, kind))
        for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
    } | {"_get": get_kv_class}


@dataclass
class Engine:
    """One engine process's ranks: the model, a pool per rank (``pools[cp][tp]``), the rank
    managers of the backend's classes (registered with their agents) and how requests run on them.

    ``lock`` is the scheduler's single thread: every call on the classes, pools and model is made
    under it, so several requests (a serving front's threads) interleave as SGLang's scheduler
    loop interleaves them, polling between steps without holding it."""

    role: str
    backend: str
    model: Any
    pools: list[list[KVPool]]
    managers: list[tuple[tuple[int, int], Any]]
    classes: dict[str, Any]
    timeout_s: float = 60.0
    lock: Any = field(default_factory=threading.RLock)

    @property
    def page_size(self) -> int:
        return self.pools[0][0].page_size

    def room_classes(self) -> dict[str, Any]:
        if self.backend == "direct":
            return {"SENDER": DirectSender, "RECEIVER": DirectReceiver}
        return self.classes

    def bootstrap_server(self, host: str, port: int) -> Any:
        """Prefill's bootstrap server (SGLang's class; the direct backend needs none)."""
        if self.role != "prefill" or "BOOTSTRAP_SERVER" not in self.classes:
            return None
        return self.classes["BOOTSTRAP_SERVER"](host, port)

    def run(self, req: dict[str, Any], bootstrap: str) -> dict[str, Any]:
        """One request ({"room", "prompt", "max_new_tokens"}); ``bootstrap`` is prefill's bootstrap
        address (prefill: its own, decode: the one the router gave)."""
        run = run_prefill if self.role == "prefill" else run_decode
        return run(self, req, bootstrap)

    def close(self) -> None:
        for row in self.pools:
            for pool in row:
                pool.close()


def open_engine(
    role: str,
    *,
    backend: str = "sglang",
    tp: int = 1,
    cp: int = 1,
    pages: int = 64,
    seed: int = 0,
    shm_dir: str = "/dev/shm",
    device: str = "cpu",
    aux_device: str | None = None,
    agents: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Engine:
    """The model, a pool per rank in ``shm_dir`` and a registered rank manager each. The rank's
    place comes from the environment (PDFABRIC_REPLICA, PDFABRIC_RANK, PDFABRIC_AGENT_ADDRESS, as
    a PDCluster's engine gets it); PDFABRIC_CP_RANK is set per CP rank here, and
    ``agents`` (rank id -> engine door) overrides the agent address per rank."""
    if backend == "direct":
        classes: dict[str, Any] = {}
        mode: Any = role
    else:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        classes = load_backend()
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    model = build_model(seed)
    shape = model_shape(model)
    cps = cp if role == "prefill" else 1
    pools = [
        [
            KVPool(
                layers=shape.layers, local_heads=max(1, shape.kv_heads // tp), head_dim=shape.head_dim,
                num_pages=pages, page_size=shape.page_size, shm_dir=shm_dir, device=device, aux_device=aux_device,
            )
            for _ in range(tp)
        ]
        for _ in range(cps)
    ]  # fmt: skip
    agents = agents or {}
    managers = []
    try:
        for c in range(cps):
            for r in range(tp):
                # What a launcher sets in each rank's own process.
                os.environ[EngineEnv.CP_RANK] = str(c)
                rank_id = Rank(role, 0, r, c).rank_id
                if rank_id in agents:
                    os.environ[EngineEnv.AGENT_ADDRESS] = agents[rank_id]
                gpu = int(device.split(":")[1]) if device.startswith("cuda:") else 0
                ka = kv_args(pools[c][r], engine_rank=r, page_size=shape.page_size, gpu_id=gpu,
                             kv_head_num=pools[c][r].local_heads, total_kv_head_num=shape.kv_heads,
                             cls=types.SimpleNamespace if backend == "direct" else None)  # fmt: skip
                mgr = DirectRank(role, ka, gpu) if backend == "direct" else classes["MANAGER"](ka, mode, None, False)
                managers.append(((c, r), mgr))
    except BaseException:
        for row in pools:
            for pool in row:
                pool.close()
        raise
    return Engine(role, backend, model, pools, managers, classes, timeout_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", required=True)  # [{"room": int, "prompt": [int], "max_new_tokens": int}]
    ap.add_argument("--out", required=True)
    ap.add_argument("--bootstrap", required=True)  # prefill: listen here; decode: the prefill's
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument(
        "--device", default="cpu"
    )  # where the pools live (cuda:N: shared by CUDA IPC); compute stays on CPU
    # Where the aux (metadata) rows live, default with the pools. SGLang keeps its MetadataBuffers
    # on the CPU unless its custom pool is INTRA_NODE_NVLINK: "cpu" (shared memory) as SGLang on tcp.
    ap.add_argument("--aux-device", default=None)
    ap.add_argument("--agents", default="{}")  # rank id -> its agent's engine door (default: the environment's)
    # sglang: SGLang's classes after its plugin loading; direct: the agent's engine API itself
    # (an engine without SGLang, as on a GPU machine that lacks SGLang's GPU kernels).
    ap.add_argument("--backend", choices=["sglang", "direct"], default="sglang")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    with open(args.requests, encoding="utf-8") as fh:
        requests = json.load(fh)
    engine = open_engine(
        args.role, backend=args.backend, tp=args.tp, cp=args.cp, pages=args.pages, seed=args.seed,
        shm_dir=args.shm_dir, device=args.device, aux_device=args.aux_device, agents=json.loads(args.agents),
        timeout_s=args.timeout_s,
    )  # fmt: skip
    host, _, port = args.bootstrap.rpartition(":")
    server = engine.bootstrap_server(host, int(port))
    results = []
    try:
        for req in requests:
            results.append(engine.run(req, args.bootstrap))
    finally:
        if server is not None:
            server.close()
        engine.close()
    classes = engine.room_classes()
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(
            {
                "role": args.role,
                "classes": {k: v.__module__ + "." + v.__name__ for k, v in classes.items() if k != "_get"},
                "results": results,
            },
            fh,
        )


def run_prefill(engine: Engine, req: dict[str, Any], bootstrap: str) -> dict[str, Any]:
    import numpy as np

    from pdfabric_core.policy.rank_mapping import cp_page_shard

    classes, pools, lock = engine.room_classes(), engine.pools, engine.lock
    prompt = req["prompt"]
    n = pages_for(len(prompt), engine.page_size)
    cp = len(pools)
    shards = [cp_page_shard(n, cp, c, all_ranks_send=True) for c in range(cp)]
    local: list[list[int]] = []
    aux: list[list[int]] = []
    senders: dict[Any, Any] = {}
    try:
        with lock:
            for c in range(cp):
                local.append(pools[c][0].allocate_pages(len(shards[c])))
                for pool in pools[c][1:]:
                    pool.allocate_pages(len(shards[c]))  # the same local pages on every TP rank
            aux = [[p.allocate_aux_slot() for p in row] for row in pools]
            senders = {key: classes["SENDER"](mgr, bootstrap, req["room"]) for key, mgr in engine.managers}
        # WaitingForInput: decode announced the room.
        wait_all(
            engine,
            senders,
            {RoomState.WAITING_FOR_INPUT},
            req["room"],
            "decode did not announce the room",
            failed_ends=True,
        )
        with lock:
            for (c, r), s in senders.items():
                s.init(len(shards[c]), aux[c][r])
            first = prefill_cp(engine.model, prompt, pools, local, aux[0][0], room=req["room"])
            for (c, _), s in senders.items():
                send_in_two_chunks(s, np.asarray(local[c], dtype=np.int32), None)
        final = wait_all(engine, senders, {RoomState.SUCCESS}, req["room"], "the transfer did not finish")
        with lock:
            return outcome(req["room"], senders, final) | {"first_token": first}
    except GaveUp as gave_up:
        return gave_up.result
    finally:
        with lock:
            for c, pages_c in enumerate(local):
                for pool in pools[c]:
                    pool.free_pages(pages_c)
            for c, row in enumerate(aux):
                for pool, slot in zip(pools[c], row, strict=True):
                    pool.free_aux_slot(slot)


def run_decode(engine: Engine, req: dict[str, Any], bootstrap: str) -> dict[str, Any]:
    import numpy as np

    classes, lock = engine.room_classes(), engine.lock
    prompt = req["prompt"]
    row = engine.pools[0]
    n = pages_for(len(prompt), engine.page_size)
    pages: list[int] = []
    aux: int | None = None
    receivers: dict[Any, Any] = {}
    try:
        with lock:
            pages, aux = hold_row(row, n)
            receivers = {key: classes["RECEIVER"](mgr, bootstrap, req["room"]) for key, mgr in engine.managers}
            for r in receivers.values():
                r.init(0)
        what = f"prefill's bootstrap {bootstrap} did not answer"
        wait_all(engine, receivers, {RoomState.WAITING_FOR_INPUT}, req["room"], what, failed_ends=True)
        with lock:
            for r in receivers.values():
                r.send_metadata(np.asarray(pages, dtype=np.int32), aux, None)
        final = wait_all(engine, receivers, {RoomState.SUCCESS}, req["room"], "the transfer did not finish")
        with lock:
            out = outcome(req["room"], receivers, final)
            if out["state"] == "Success":
                out["tokens"] = decode(engine.model, len(prompt), row, pages, aux, req["max_new_tokens"])
            return out
    except GaveUp as gave_up:
        return gave_up.result
    finally:
        with lock:
            release_row(row, pages, aux)


if __name__ == "__main__":
    main()
