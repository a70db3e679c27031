"""A prefill or decode engine process of the MLA reference model (``mla.py``) that moves its latent
and indexer state through pdfabric the way SGLang does (``pd.py`` drives the Llama the same way).

    python -m pdfabric_refengine.mla_pd --role prefill|decode --requests R.json --out O.json ...

SGLang's own ``load_plugins()`` and ``get_kv_class`` give the classes; every rank's manager is
built with ``is_mla_backend`` from SGLang-shaped KVArgs of an MLA pool with page-indexed indexer
state registered as SGLang's DSA state type (``mla_engine.py``), and driven as SGLang's schedulers drive them:

- prefill: a sender per rank, polled until decode announced the room, ``init``, the forward pass
  into the pools, ``send`` in two chunks, the last with the state indices (the request's pages,
  as SGLang's ``_dsa_pages_payload``, on every CP rank: its whole indexer state), polled until Success.
- decode: a receiver per rank, ``init``, polled to WaitingForInput, ``send_metadata`` with the
  pages, the aux row and the state slots (the pages' own numbers), polled until Success, then
  greedy generation from the pools alone (latent and indexer keys; no prompt is recomputed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from pdfabric_agent.protocol.views import RoomState
from pdfabric_core.engines.launch import EngineEnv
from pdfabric_core.policy.rank_mapping import cp_page_shard
from pdfabric_core.rankmap import Rank
from pdfabric_refengine.engine import pages_for
from pdfabric_refengine.kvpool import KVPool, kv_args
from pdfabric_refengine.mla import MLAModel
from pdfabric_refengine.mla_draft import DraftSide, MTPDraft, decode_speculative, draft_pool, prefill_draft, with_draft
from pdfabric_refengine.mla_engine import MLA_CONFIG, decode_mla, mla_pool, prefill_mla
from pdfabric_refengine.pd import Engine, load_backend
from pdfabric_refengine.rooms import GaveUp, hold_row, outcome, release_row, send_in_two_chunks, wait_all


def open_mla_engine(
    role: str,
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    pages: int = 64,
    seed: int = 0,
    shm_dir: str = "/dev/shm",
    agents: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    draft: DraftSide | None = None,
) -> Engine:
    """The model, an MLA pool per rank and a registered manager each: ``pools[c][tp]`` per prefill
    CP rank, ``pools[d][tp]`` per decode DP group (attention DP: each group's managers built under
    SGLang's parallel state for that group, as its scheduler publishes it). The rank's place as
    ``pd.open_engine`` sets it (PDFABRIC_CP_RANK per CP rank, ``agents``). With ``draft`` each
    rank's KVArgs carry its draft pool's buffers after the target's (SGLang's num_draft_entries)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    classes = load_backend()
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    model = MLAModel(MLA_CONFIG, seed)
    if role == "prefill" and dp != 1:
        raise ValueError("the MLA driver runs prefill DP groups as one (dp 1)")
    groups = cp if role == "prefill" else dp
    pools: list[list[KVPool]] = []
    managers = []
    try:
        for _ in range(groups):
            pools.append([mla_pool(MLA_CONFIG, num_pages=pages, shm_dir=shm_dir) for _ in range(tp)])
        for g in range(groups):
            for r in range(tp):
                c, d = (g, 0) if role == "prefill" else (0, g)
                os.environ[EngineEnv.CP_RANK] = str(c)
                rank_id = Rank(role, 0, r, c, dp_rank=d).rank_id
                if agents and rank_id in agents:
                    os.environ[EngineEnv.AGENT_ADDRESS] = agents[rank_id]
                pool = pools[g][r]
                ka = kv_args(pool, engine_rank=r, page_size=pool.page_size, kv_head_num=1, total_kv_head_num=1,
                             state_type="dsa")  # fmt: skip
                if draft is not None:
                    ka = with_draft(ka, draft.pools[g][r])
                with _attention_dp(d, dp, r):
                    mgr = classes["MANAGER"](ka, mode, None, True)
                if mgr.rank_id != rank_id:
                    raise RuntimeError(f"SGLang's parallel state made rank {mgr.rank_id}, not {rank_id}")
                managers.append(((g, r), mgr))
    except BaseException:
        for row in pools:
            for pool in row:
                pool.close()
        raise
    return Engine(role, "sglang", model, pools, managers, classes, timeout_s)


@contextlib.contextmanager
def _attention_dp(group: int, groups: int, tp_rank: int) -> Iterator[None]:
    """SGLang's parallel state of attention TP rank ``tp_rank`` of DP group ``group`` (of
    ``groups``; nothing to publish for one group)."""
    if groups == 1:
        yield
        return
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        attn_tp_rank=tp_rank, attn_cp_rank=0, attn_cp_size=1, attn_dp_rank=group, dp_size=1, dp_rank=None,
        num_dp_ranks=groups, load_balance_method="round_robin",
    ):  # fmt: skip
        yield


def run_prefill(
    engine: Engine, req: dict[str, Any], bootstrap: str, *, layer_split: bool, draft: DraftSide | None = None
) -> dict[str, Any]:
    classes, pools, lock = engine.classes, engine.pools, engine.lock
    prompt = req["prompt"]
    n = pages_for(len(prompt), engine.page_size)
    cp = len(pools)
    shards = [cp_page_shard(n, cp, c, all_ranks_send=True) for c in range(cp)]
    held: list[list[int]] = []  # per CP rank: the request's n pages (its indexer slots), latent on its shard
    senders: dict[Any, Any] = {}
    aux_held: list[KVPool] = []  # the pools whose aux slot `aux` this request holds
    aux = 0
    try:
        with lock:
            for c in range(cp):
                held.append(pools[c][0].allocate_pages(n))
                for pool in pools[c][1:]:
                    pool.allocate_pages(n)  # the same local pages on every TP rank
            aux = pools[0][0].allocate_aux_slot()
            aux_held.append(pools[0][0])
            for pool in (p for row in pools for p in row if p is not pools[0][0]):
                aux_held.append(pool)
                if pool.allocate_aux_slot() != aux:  # every rank's row at the same slot, as SGLang's
                    raise RuntimeError("the ranks' aux slots diverged")
            senders = {key: classes["SENDER"](mgr, bootstrap, req["room"]) for key, mgr in engine.managers}
        what = "decode did not announce the room"
        wait_all(engine, senders, {RoomState.WAITING_FOR_INPUT}, req["room"], what, failed_ends=True)
        kv_pages = [held[c][shards[c].start : shards[c].stop] for c in range(cp)]
        with lock:
            for (c, _), s in senders.items():
                s.init(len(shards[c]), aux)
            first = prefill_mla(engine.model, prompt, pools, kv_pages, held, aux, layer_split=layer_split,
                                room=req["room"])  # fmt: skip
            if draft is not None:  # the draft's rows on the target's pages
                prefill_draft(draft.draft, prompt, draft.pools, kv_pages)
            for (c, _), s in senders.items():  # the state (every page's indexer slot) with the last chunk
                send_in_two_chunks(s, np.asarray(kv_pages[c], dtype=np.int32), [np.asarray(held[c], dtype=np.int32)])
        final = wait_all(engine, senders, {RoomState.SUCCESS}, req["room"], "the transfer did not finish")
        with lock:
            return outcome(req["room"], senders, final) | {"first_token": first}
    except GaveUp as gave_up:
        return gave_up.result
    finally:
        with lock:
            for c, pages_c in enumerate(held):
                for pool in pools[c]:
                    pool.free_pages(pages_c)
            for pool in aux_held:
                pool.free_aux_slot(aux)


def run_decode(
    engine: Engine, req: dict[str, Any], bootstrap: str, draft: DraftSide | None = None, corrupt_draft: bool = False
) -> dict[str, Any]:
    """The request on decode DP group ``room % dp`` (SGLang's round-robin controller's choice
    for consecutive rooms), whose managers' receivers and pools alone take it. With ``draft``:
    speculative decoding, the draft's proposals and accepted lengths in the result;
    ``corrupt_draft`` (a negative control) gives the request's second draft page its first's
    bytes after the transfer, as a misrouted draft page would."""
    classes, lock = engine.classes, engine.lock
    prompt = req["prompt"]
    group = req["room"] % len(engine.pools)
    row = engine.pools[group]
    n = pages_for(len(prompt), engine.page_size)
    pages: list[int] = []
    aux: int | None = None
    receivers: dict[Any, Any] = {}
    try:
        with lock:
            pages, aux = hold_row(row, n)
            receivers = {
                key: classes["RECEIVER"](mgr, bootstrap, req["room"]) for key, mgr in engine.managers if key[0] == group
            }
            for r in receivers.values():
                r.init(0)  # the prefill's DP group: it has one
        what = f"prefill's bootstrap {bootstrap} did not answer"
        wait_all(engine, receivers, {RoomState.WAITING_FOR_INPUT}, req["room"], what, failed_ends=True)
        with lock:
            idx = np.asarray(pages, dtype=np.int32)
            for r in receivers.values():
                r.send_metadata(idx, aux, [idx])  # page-indexed state: the pages' own slots
        final = wait_all(engine, receivers, {RoomState.SUCCESS}, req["room"], "the transfer did not finish")
        with lock:
            out = outcome(req["room"], receivers, final) | {"dp_group": group}
            if out["state"] == "Success" and draft is not None:
                dpools = draft.pools[group]
                if corrupt_draft and len(pages) > 1:
                    _copy_page(dpools, pages[0], pages[1])
                out["tokens"], trace = decode_speculative(
                    engine.model, draft.draft, len(prompt), row, dpools, pages, aux, req["max_new_tokens"]
                )
                out |= {"proposals": trace.proposals, "accepted": trace.accepted}
            elif out["state"] == "Success":
                out["tokens"] = decode_mla(engine.model, len(prompt), row, pages, aux, req["max_new_tokens"])
            return out
    except GaveUp as gave_up:
        return gave_up.result
    finally:
        with lock:
            release_row(row, pages, aux)


def _copy_page(pools: list[KVPool], src: int, dst: int) -> None:
    for pool in pools:
        for buf in pool.k_buffers:
            n = pool.page_size
            buf[dst * n : (dst + 1) * n] = buf[src * n : (src + 1) * n].clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)  # decode: attention DP groups
    ap.add_argument("--layer-split", type=int, default=0)  # prefill: the DSA cache layer split over CP
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", required=True)  # [{"room": int, "prompt": [int], "max_new_tokens": int}]
    ap.add_argument("--out", required=True)
    ap.add_argument("--bootstrap", required=True)  # prefill: listen here; decode: the prefill's
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--agents", default="{}")  # rank id -> its agent's engine door
    ap.add_argument("--device", choices=["cpu"], default="cpu")
    ap.add_argument("--backend", choices=["sglang"], default="sglang")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--draft", type=int, default=0)  # 1: the MTP draft head, its KV moved, speculative decode
    ap.add_argument("--corrupt-draft", type=int, default=0)  # decode: a negative control (run_decode)
    args = ap.parse_args()

    with open(args.requests, encoding="utf-8") as fh:
        requests = json.load(fh)
    draft = None
    if args.draft:
        groups = args.cp if args.role == "prefill" else args.dp
        draft = DraftSide(
            MTPDraft(MLAModel(MLA_CONFIG, args.seed), args.seed),
            [[draft_pool(MLA_CONFIG, num_pages=args.pages, shm_dir=args.shm_dir) for _ in range(args.tp)]
             for _ in range(groups)],
        )  # fmt: skip
    engine = open_mla_engine(
        args.role, tp=args.tp, cp=args.cp, dp=args.dp, pages=args.pages, seed=args.seed, shm_dir=args.shm_dir,
        agents=json.loads(args.agents), timeout_s=args.timeout_s, draft=draft,
    )  # fmt: skip
    host, _, port = args.bootstrap.rpartition(":")
    server = engine.bootstrap_server(host, int(port))
    results = []
    try:
        for req in requests:
            if args.role == "prefill":
                results.append(
                    run_prefill(engine, req, args.bootstrap, layer_split=bool(args.layer_split), draft=draft)
                )
            else:
                results.append(run_decode(engine, req, args.bootstrap, draft, bool(args.corrupt_draft)))
    finally:
        if server is not None:
            server.close()
        for _, mgr in engine.managers:
            close = getattr(mgr, "close", None)
            if close is not None:
                close()
        engine.close()
        if draft is not None:
            draft.close()
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


if __name__ == "__main__":
    main()
