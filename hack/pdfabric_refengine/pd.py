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
    ap.add_argument("--agents", default="{}")  # rank id -> its agent's engine door (default: the environment's)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    from sglang.srt.disaggregation.utils import DisaggregationMode

    classes = load_backend()
    model = build_model(args.seed)
    shape = model_shape(model)
    with open(args.requests, encoding="utf-8") as fh:
        requests = json.load(fh)
    role = DisaggregationMode.PREFILL if args.role == "prefill" else DisaggregationMode.DECODE
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
                         kv_head_num=pools[c][r].local_heads, total_kv_head_num=shape.kv_heads)  # fmt: skip
            managers.append(((c, r), classes["MANAGER"](ka, role, None, False)))
    host, _, port = args.bootstrap.rpartition(":")
    server = classes["BOOTSTRAP_SERVER"](host, int(port)) if args.role == "prefill" else None
    results = []
    try:
        for req in requests:
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
