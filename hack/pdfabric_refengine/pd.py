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
import time
import types
from typing import Any

from pdfabric_refengine.engine import decode, pages_for, prefill_cp
from pdfabric_refengine.kvpool import KVPool, kv_args
from pdfabric_refengine.model import build_model, model_shape

POLL_S = 0.005
FINAL = {0, 4}  # KVPoll Failed, Success


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


def wait(obj: Any, until: set[int], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        state = int(obj.poll())
        if state in until or state == 0:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {state} after {timeout_s} s")
        time.sleep(POLL_S)


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
    ap.add_argument("--agents", default="{}")
    # sglang: SGLang's classes after its plugin loading; direct: the agent's engine API itself
    # (an engine without SGLang, as on a GPU machine that lacks SGLang's GPU kernels).
    ap.add_argument(
        "--backend", choices=["sglang", "direct"], default="sglang"
    )  # rank id -> its agent's engine door (default: the environment's)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    if args.backend == "direct":
        classes: dict[str, Any] = {}
        role: Any = args.role
    else:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        classes = load_backend()
        role = DisaggregationMode.PREFILL if args.role == "prefill" else DisaggregationMode.DECODE
    model = build_model(args.seed)
    shape = model_shape(model)
    with open(args.requests, encoding="utf-8") as fh:
        requests = json.load(fh)
    cps = args.cp if args.role == "prefill" else 1
    pools = [
        [
            KVPool(
                layers=shape.layers, local_heads=max(1, shape.kv_heads // args.tp), head_dim=shape.head_dim,
                num_pages=args.pages, page_size=shape.page_size, shm_dir=args.shm_dir, device=args.device,
            )
            for _ in range(args.tp)
        ]
        for _ in range(cps)
    ]  # fmt: skip
    from pdfabric_core.rankmap import Rank

    agents = json.loads(args.agents)
    managers = []
    for c in range(cps):
        for r in range(args.tp):
            # What a launcher sets in each rank's own process.
            os.environ["PDFABRIC_CP_RANK"] = str(c)
            rank_id = Rank(args.role, 0, r, c).rank_id
            if rank_id in agents:
                os.environ["PDFABRIC_AGENT_ADDRESS"] = agents[rank_id]
            gpu = int(args.device.split(":")[1]) if args.device.startswith("cuda:") else 0
            ka = kv_args(pools[c][r], engine_rank=r, page_size=shape.page_size, gpu_id=gpu,
                         kv_head_num=pools[c][r].local_heads, total_kv_head_num=shape.kv_heads,
                         cls=types.SimpleNamespace if args.backend == "direct" else None)  # fmt: skip
            mgr = (
                DirectRank(args.role, ka, gpu)
                if args.backend == "direct"
                else classes["MANAGER"](ka, role, None, False)
            )
            managers.append(((c, r), mgr))
    host, _, port = args.bootstrap.rpartition(":")
    server = classes["BOOTSTRAP_SERVER"](host, int(port)) if args.role == "prefill" and classes else None
    results = []
    try:
        for req in requests:
            if args.backend == "direct":
                classes = {"SENDER": DirectSender, "RECEIVER": DirectReceiver}
            run = run_prefill if args.role == "prefill" else run_decode
            results.append(run(classes, model, pools, managers, req, args))
    finally:
        if server is not None:
            server.close()
        for row in pools:
            for pool in row:
                pool.close()
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(
            {
                "role": args.role,
                "classes": {k: v.__module__ + "." + v.__name__ for k, v in classes.items() if k != "_get"},
                "results": results,
            },
            fh,
        )


class DirectRank:
    """One rank's buffers registered with its agent through the engine API (no SGLang)."""

    def __init__(self, role: str, ka: Any, gpu: int | None) -> None:
        from pdfabric_sglang.kvargs import FabricConfig, rank_id_for, registration

        from pdfabric_agent.client import AgentClient
        from pdfabric_core.policy.types import Role

        cfg = FabricConfig()
        probe = AgentClient(cfg.address, cfg.token, "")
        uid = probe.info()["cluster"]["uid"]
        probe.close()
        self.client = AgentClient(cfg.address, cfg.token, uid)
        self.rank_id = rank_id_for(Role(role), cfg, ka)
        self.client.register_memory(registration(self.rank_id, ka, is_mla=False, gpu=gpu))


class _DirectRoom:
    """What SGLang's sender and receiver calls do, on the agent's engine API (the room's state
    codes are KVPoll's)."""

    def __init__(self, mgr: DirectRank, bootstrap_addr: str, room: int) -> None:
        self.mgr, self.room, self.reason = mgr, room, ""
        self.submitted_at = self.finished_at = 0.0
        self.code: int | None = None
        self.bytes = 0
        self.view: dict[str, Any] = {}

    def _room_code(self) -> int:
        from pdfabric_agent.client import AgentRefused

        try:
            self.view = self.mgr.client.poll(self.mgr.rank_id, self.room)
        except AgentRefused as exc:
            if exc.status == 404:
                return 1  # Bootstrapping: the other side has not announced the room yet
            self.code, self.reason = 0, str(exc)
            return 0
        code = int(self.view["code"])
        if code in FINAL and self.submitted_at:
            self.code, self.finished_at, self.reason = code, time.monotonic(), self.view.get("reason", "")
            self.bytes = sum(int(n) for n in self.view.get("bytes", {}).values())
        return code

    def get_transfer_metric(self) -> Any:
        ok = self.code == 4
        return types.SimpleNamespace(
            transfer_latency_s=self.finished_at - self.submitted_at if ok else None,
            transfer_total_bytes=self.bytes if ok else None,
        )

    def failure_exception(self) -> None:
        raise RuntimeError(f"room {self.room} on {self.mgr.rank_id} failed: {self.reason}")

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk


class DirectSender(_DirectRoom):
    def __init__(self, mgr: DirectRank, bootstrap_addr: str, room: int) -> None:
        super().__init__(mgr, bootstrap_addr, room)
        self.pages: list[int] = []
        self.decode_replica = 0
        self.num_pages = 0
        self.aux_index: int | None = None

    def poll(self) -> int:
        if self.code is not None:
            return self.code
        code = self._room_code()
        if not self.submitted_at and self.view.get("decode_ranks_ready"):
            self.decode_replica = int(self.view["decode_ranks_ready"][0].split("-")[1])
        return code

    def init(self, num_pages: int, aux_index: int | None) -> None:
        self.num_pages, self.aux_index = num_pages, aux_index

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        if not self.submitted_at:
            self.submitted_at = time.monotonic()
        self.pages.extend(int(p) for p in kv_indices)
        if len(self.pages) == self.num_pages:
            self.mgr.client.send(
                self.mgr.rank_id, self.room, self.pages, decode_replica=self.decode_replica, aux_index=self.aux_index
            )


class DirectReceiver(_DirectRoom):
    def init(self, prefill_dp_rank: int) -> None:
        pass

    def poll(self) -> int:
        if self.code is not None:
            return self.code
        return self._room_code() if self.submitted_at else 2  # WaitingForInput until the metadata

    def send_metadata(self, kv_indices: Any, aux_index: int | None, state_indices: Any = None) -> None:
        self.submitted_at = time.monotonic()
        self.mgr.client.receive(self.mgr.rank_id, self.room, [int(p) for p in kv_indices], aux_index=aux_index)


def _metric(obj: Any) -> dict[str, Any]:
    m = obj.get_transfer_metric()
    return {"latency_s": m.transfer_latency_s, "bytes": m.transfer_total_bytes}


def _failure(obj: Any) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def run_prefill(
    classes: dict[str, Any], model: Any, pools: list[list[KVPool]], managers: list[Any], req: dict[str, Any], args: Any
) -> dict[str, Any]:
    from pdfabric_core.policy.rank_mapping import cp_page_shard

    prompt = req["prompt"]
    n = pages_for(len(prompt), pools[0][0].page_size)
    cp = len(pools)
    shards = [cp_page_shard(n, cp, c, all_ranks_send=True) for c in range(cp)]
    local = [pools[c][0].allocate_pages(len(shards[c])) for c in range(cp)]
    for c in range(cp):
        for pool in pools[c][1:]:
            pool.allocate_pages(len(shards[c]))  # the same local pages on every TP rank
    aux = [[p.allocate_aux_slot() for p in row] for row in pools]
    senders = {key: classes["SENDER"](mgr, args.bootstrap, req["room"]) for key, mgr in managers}
    states = {key: wait(s, {2}, args.timeout_s) for key, s in senders.items()}  # WaitingForInput
    if any(v == 0 for v in states.values()):
        return {"room": req["room"], "state": "Failed", "errors": {str(k): _failure(s) for k, s in senders.items()}}
    for (c, r), s in senders.items():
        s.init(len(shards[c]), aux[c][r])
    first = prefill_cp(model, prompt, pools, local, aux[0][0], room=req["room"])
    import numpy as np

    for (c, _), s in senders.items():
        pages = np.asarray(local[c], dtype=np.int32)
        half = len(pages) // 2
        if half and s.should_send_kv_chunk(half, False):
            s.send(pages[:half])  # a chunked prefill's first chunk
        if s.should_send_kv_chunk(len(pages) - half, True):
            s.send(pages[half:], None)  # the last chunk
    final = {key: wait(s, FINAL, args.timeout_s) for key, s in senders.items()}
    for c in range(cp):
        for pool in pools[c]:
            pool.free_pages(local[c])
    return {
        "room": req["room"],
        "first_token": first,
        "state": "Success" if set(final.values()) == {4} else "Failed",
        "errors": {str(k): _failure(s) for k, s in senders.items() if final[k] != 4},
        "metrics": {str(k): _metric(s) for k, s in senders.items()},
    }


def run_decode(
    classes: dict[str, Any], model: Any, pools: list[list[KVPool]], managers: list[Any], req: dict[str, Any], args: Any
) -> dict[str, Any]:
    import numpy as np

    prompt = req["prompt"]
    row = pools[0]
    n = pages_for(len(prompt), row[0].page_size)
    pages = row[0].allocate_pages(n)
    for pool in row[1:]:
        pool.allocate_pages(n)
    aux = row[0].allocate_aux_slot()
    for pool in row[1:]:
        pool.allocate_aux_slot()
    receivers = {key: classes["RECEIVER"](mgr, args.bootstrap, req["room"]) for key, mgr in managers}
    for r in receivers.values():
        r.init(0)
    ready = {key: wait(r, {2}, args.timeout_s) for key, r in receivers.items()}
    if any(v == 0 for v in ready.values()):
        return {"room": req["room"], "state": "Failed", "errors": {str(k): _failure(r) for k, r in receivers.items()}}
    for r in receivers.values():
        r.send_metadata(np.asarray(pages, dtype=np.int32), aux, None)
    final = {key: wait(r, FINAL, args.timeout_s) for key, r in receivers.items()}
    out: dict[str, Any] = {"room": req["room"], "state": "Success" if set(final.values()) == {4} else "Failed"}
    out["errors"] = {str(k): _failure(r) for k, r in receivers.items() if final[k] != 4}
    out["metrics"] = {str(k): _metric(r) for k, r in receivers.items()}
    if out["state"] == "Success":
        out["tokens"] = decode(model, len(prompt), row, pages, aux, req["max_new_tokens"])
    for pool in row:
        pool.free_pages(pages)
        pool.free_aux_slot(aux)
    return out


if __name__ == "__main__":
    main()
