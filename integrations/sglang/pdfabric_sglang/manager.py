"""``PdfabricKVManager``: one per engine rank. It registers the rank's ``KVArgs`` buffers with the
agent (``/v1/memory``), hands rooms to it, opens SGLang's bootstrap rooms as single-use agent rooms
(``open_room``, the same on both sides after a rebootstrap), resolves prefill bootstrap addresses
(``peers.PrefillPeers``) and answers SGLang's deferred decode KV release from the agent's view. The
bounds on agent calls from the scheduler thread are here, with the clients that make them."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from pdfabric_agent.client.api import AgentClient, AgentRefused
from pdfabric_agent.client.calls import SUBMIT_TIMEOUT_S, AgentCalls
from pdfabric_agent.client.engine_env import ENV_CP_RANK, ENV_RANK, ENV_REPLICA, FabricConfig, engine_instance
from pdfabric_agent.client.feed import RoomEvents
from pdfabric_agent.client.shares import UnshareableBuffer
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.views import MemoryAnswer, RoomView
from pdfabric_agent.protocol.wire import FEED_HEARTBEAT_S, ReceiveRequest, SendRequest
from pdfabric_core.policy.kv_shard import kv_shard_size
from pdfabric_core.policy.types import Role
from pdfabric_sglang.board import EngineBoard
from pdfabric_sglang.kvargs import (
    AttentionRanks,
    attention_of,
    gpu_of,
    metadata_on_gpu,
    rank_id_for,
    registration,
)
from pdfabric_sglang.peers import PrefillPeer, PrefillPeers, post_generate

log = logging.getLogger("pdfabric.sglang")

FEED_WAIT_S = 2.0  # at start, how long the manager waits for its room feed's first snapshot
# How long a rank another engine holds is waited for: a previous engine that exited is gone from
# the agent's view within a heartbeat of its feed (its connection closed).
TAKEN_WAIT_S = 3 * FEED_HEARTBEAT_S
RANK_TAKEN = Refusal.RANK_TAKEN.value
MEMORY_NOT_REGISTERED = Refusal.MEMORY_NOT_REGISTERED.value
# A poll, submit or abort on the scheduler thread waits at most this long for the agent (it answers
# in milliseconds; a hung agent must not stall the server's loop for the client's default 10 s).
AGENT_CALL_TIMEOUT_S = 2.0
AGENT_ERRORS = (AgentRefused, OSError, ValueError)  # refused; down, restarting or timed out; garbled
REMEMBERED_ROOMS = 1 << 16  # bootstrap rooms whose openings a manager counts (rebootstrap comes soon after)
_ROOM_STRIDE = 0x9E3779B97F4A7C15  # odd: successive openings of one room land far apart


def reopened_room(bootstrap_room: int, opened: int) -> int:
    """The agent room of the ``opened``-th reopening of a bootstrap room (0: the room itself)."""
    return bootstrap_room if opened == 0 else (bootstrap_room + opened * _ROOM_STRIDE) % (1 << 63)


def attention_ranks() -> AttentionRanks | None:
    """This scheduler rank's DP group, attention TP and CP ranks from SGLang's parallel state; None
    where SGLang has published none (an engine that is not SGLang's scheduler)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return attention_of(get_parallel())
    except (ImportError, ValueError, RuntimeError, AttributeError, TypeError):
        return None


def _parallel_flag(name: str) -> bool:
    """A flag of SGLang's published parallel state; False where none is published."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return bool(getattr(get_parallel(), name))
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return False


def kv_sharding_refusal(is_mla: bool) -> str | None:
    """Why pdfabric cannot move this rank's KV under SGLang's ``--enable-kv-cache-sharding``, or
    None when it can: nothing sharded (the option off, or a shard group of one rank: GQA without CP,
    MLA at attention TP 1), or MLA striped over attention TP (the registration says so,
    ``kv_shard_size``, and the agent holds it to ``spec.prefill.kvCacheSharding``). Read from
    SGLang's parallel state; None where SGLang published none."""
    if not _parallel_flag("enable_kv_cache_sharding"):
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        tp, cp = int(parallel.attn_tp_size), int(parallel.attn_cp_size)
    except (ValueError, RuntimeError, AttributeError):
        # The option is on but its group cannot be read: whether pages are striped is unknown.
        return "KV cache sharding (--enable-kv-cache-sharding) with SGLang's attention TP/CP sizes unpublished"
    size = kv_shard_size(enabled=True, mla=is_mla, attn_tp=tp, attn_cp=cp)
    if size == 1 or cp == 1:
        return None  # MLA over attention TP: moved by page owner (spec.prefill.kvCacheSharding)
    return (
        f"KV cache sharding over attention CP (--enable-kv-cache-sharding) stripes whole pages over attention "
        f"CP ({cp} ranks): logical page l is on rank l % {size} as its local page l // {size}, and pdfabric "
        "routes pages by owner over attention TP only (MLA, prefill CP 1, spec.prefill.kvCacheSharding); start "
        "the prefill without --enable-kv-cache-sharding or without attention CP"
    )


def dsa_layer_split_pool(args: KVArgs) -> bool:
    """Whether this is SGLang's ``LayerSplitDSATokenToKVPool`` (``--enable-dsa-cache-layer-split`` on a
    DSA pool under prefill CP): it registers only this CP rank's latent and indexer layers."""
    dsa = "dsa" in [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
    cp = 0
    if dsa and _parallel_flag("enable_dsa_cache_layer_split"):
        from sglang.srt.runtime_context import get_parallel

        cp = int(get_parallel().attn_cp_size)
    return cp > 1


class RecomputedRoom(Protocol):
    """What a rebootstrap uses of SGLang's decode receiver (``receiver.PdfabricKVReceiver``): stated
    here because receivers are made over their manager, so this module must not import them."""

    @property
    def bootstrap_addr(self) -> str: ...

    def fail(self, reason: str) -> None: ...


class PdfabricKVManager(BaseKVManager):
    # Failed decode rooms keep their pages until the agent says every source's writes are over.
    enable_deferred_decode_kv_release = True
    supports_host_destination = False
    board: EngineBoard | None = None  # the room board the agent writes room ends into (board.py)

    def __init__(
        self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False
    ) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.role = Role(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.config = FabricConfig()
        info_client = AgentClient(self.config.address, self.config.token, "")
        info = info_client.info()
        info_client.close()
        self.cluster_uid = info.cluster_uid
        self.client = AgentClient(self.config.address, self.config.token, self.cluster_uid, AGENT_CALL_TIMEOUT_S)
        # The submits and aborts of the calls' channel (pdfabric_agent.client.calls): one connection, in order.
        self.calls_client = AgentClient(
            self.config.address, self.config.token, self.cluster_uid, SUBMIT_TIMEOUT_S, shared=True
        )
        published = attention_ranks()
        self.rank_id = rank_id_for(self.role, self.config, args, published)
        # This rank's DP group and its server's (one group where SGLang published none): how a
        # request's prefill DP group is found (sender.py, receiver.py, bootstrap.py).
        self.parallel = published or AttentionRanks(0, 0, 1)
        info.rank(self.rank_id, f"check {ENV_REPLICA}/{ENV_CP_RANK} or set {ENV_RANK}")
        self.bootstrap_timeout_s = self.config.bootstrap_timeout_s
        sharded = kv_sharding_refusal(bool(is_mla_backend))
        if sharded is not None:
            raise RuntimeError(f"pdfabric: {sharded}")
        if is_mla_backend and dsa_layer_split_pool(args):
            raise RuntimeError(
                "pdfabric: SGLang's DSA cache layer split (--enable-dsa-cache-layer-split) registers only this CP "
                "rank's latent and indexer layers; pdfabric moves every latent layer page-sharded over CP with the "
                "indexer layers split (spec.prefill.dsaCacheLayerSplit), not a layer-split latent yet: run prefill CP "
                "without --enable-dsa-cache-layer-split (allCpRanksTransfer moves the indexer state once)"
            )
        self.instance = engine_instance()
        # The room feed first: while it is open, the agent keeps the rank for this instance
        # (registrants.py), from the moment its registration is taken.
        self.events: RoomEvents | None = RoomEvents(self.config.address, self.config.token, self.rank_id, self.instance)
        self.events.start(wait_s=FEED_WAIT_S)
        offered: EngineBoard | None = None
        try:
            # SGLang's CPU MetadataBuffers are private: their rows travel with each room (aux_inline).
            reg = registration(
                self.rank_id, args, is_mla=bool(is_mla_backend), gpu=gpu_of(args), aux_inline=not metadata_on_gpu()
            )
            offered = EngineBoard.create(reg.board_row_bytes)
            share = offered.share if offered is not None else None
            self.registration = dataclasses.replace(reg, instance=self.instance, board=share)
            answer = self.register()
        except (UnshareableBuffer, AgentRefused) as exc:
            self.events.close()
            if offered is not None:
                offered.close()  # its file goes now, not at exit
            raise RuntimeError(f"pdfabric: the buffers of {self.rank_id} cannot be registered: {exc}") from None
        # Room ends are read from the board only when the agent mapped it (it proves the memory shared).
        self.board = offered if answer.board else None
        if offered is not None and not answer.board:
            log.info("pdfabric: %s reads room ends from the feed: the agent declined its room board: %s",
                     self.rank_id, answer.board_refused)  # fmt: skip
            offered.close()
        self.layout = answer.layout
        # Decode: prefill bootstrap address -> which prefill replica serves there (SGLang's decode
        # queue reads dp_size and follow_bootstrap_room from it for every request).
        self.peers = PrefillPeers(self.cluster_uid)
        self.prefill_info_table: dict[str, PrefillPeer] = self.peers.table
        self._room_openings: OrderedDict[int, int] = OrderedDict()  # bootstrap room -> openings - 1
        self._recompute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdfabric-recompute")
        log.info("pdfabric: %s registered %d buffers with agent %s", self.rank_id, answer.buffers, info.agent)
        # The scheduler thread never waits on the agent: submits and aborts go on a worker, and
        # polls read the table the agent's room feed keeps (asking the agent only while it is down).
        self.calls = AgentCalls(f"pdfabric-calls-{self.rank_id}")

    def register(self) -> MemoryAnswer:
        """Register this rank's buffers with the agent. A restarted engine finds the rank still
        busy with its previous process's rooms (409) until they end (at most the PDCluster's
        transfer timeout): it waits for them, up to the bootstrap timeout. A rank another live
        engine holds (409 ``rank_taken``) is waited for only until that engine's room feed would
        have gone stale (``TAKEN_WAIT_S``): a second engine for one rank fails its start."""
        started = time.monotonic()
        while True:
            try:
                return self.client.register_memory(self.registration)
            except AgentRefused as exc:
                waited = time.monotonic() - started
                limit = TAKEN_WAIT_S if exc.reason == RANK_TAKEN else self.bootstrap_timeout_s
                if exc.status != 409 or waited > limit:
                    raise
                log.info("pdfabric: %s waits for its previous engine to go: %s", self.rank_id, exc)
                time.sleep(1.0)

    def submit(self, msg: SendRequest | ReceiveRequest) -> RoomView:
        """Hand a room to the agent (on the calls' worker thread); an agent that restarted since
        this engine registered (it lost the registration and says so) gets the buffers again, then
        the room."""
        try:
            return self.calls_client.submit(msg)
        except AgentRefused as exc:
            return self._after_restart(msg, exc)

    def begin_submit(self, msg: SendRequest | ReceiveRequest) -> Callable[[], RoomView]:
        """``submit`` in two halves (``AgentCalls.call_now``): the request is written now, on the
        caller's thread; the returned call reads the answer on the worker. Never raises: a request
        that could not be written fails when its answer is read."""
        try:
            answer = self.calls_client.begin_submit(msg)
        except AGENT_ERRORS as exc:
            failure = exc

            def failed() -> RoomView:
                raise failure

            return failed

        def finish() -> RoomView:
            try:
                return answer()
            except AgentRefused as exc:
                return self._after_restart(msg, exc)

        return finish

    def _after_restart(self, msg: SendRequest | ReceiveRequest, exc: AgentRefused) -> RoomView:
        if exc.reason != MEMORY_NOT_REGISTERED:
            raise exc
        log.warning(
            "pdfabric: agent %s lost %s's memory (restarted); registering again", self.config.address, self.rank_id
        )
        self.calls_client.register_memory(self.registration)
        return self.calls_client.submit(msg)

    def close(self) -> None:
        """Stop following the room feed and the calls' worker (SGLang never closes a manager; an
        engine that hosts several, like the tests, does)."""
        if self.events is not None:
            self.events.close()
        self.calls.close()
        if self.board is not None:
            self.board.close()

    def register_to_bootstrap(self) -> None:
        """Nothing to register: the PDCluster's rank map tells every agent where each rank is."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill behind ``bootstrap_addr`` is known; starts the lookup (off the
        scheduler thread) when it is not. SGLang's decode queue calls it until True."""
        return self.peers.ensure(bootstrap_addr)

    def open_room(self, bootstrap_room: int) -> int:
        """The agent's room id for a sender or receiver of SGLang's ``bootstrap_room``. The agent's
        rooms are single-use; SGLang opens a room again when decode re-receives a retracted request
        (rebootstrap: the same bootstrap room, its prefill recomputed). Each side counts the times
        it opened the room, so the n-th opening is the same fresh agent room on both sides."""
        opened = self._room_openings.pop(bootstrap_room, -1) + 1
        self._room_openings[bootstrap_room] = opened
        while len(self._room_openings) > REMEMBERED_ROOMS:
            self._room_openings.popitem(last=False)
        return reopened_room(bootstrap_room, opened)

    def current_room(self, bootstrap_room: int) -> int:
        """The agent room of the latest opening of ``bootstrap_room``."""
        return reopened_room(bootstrap_room, self._room_openings.get(bootstrap_room, 0))

    def submit_prefill_recompute(self, receiver: RecomputedRoom, payload: dict[str, Any]) -> None:
        """Rebootstrap: decode re-receives a retracted request, so its prefill must compute the
        prefix again and send it to the receiver's fresh room (``open_room``). SGLang's decode ranks
        all call this; one of them (attention TP 0, CP 0, PP stage 0) posts the request to the
        prefill server's ``/generate`` (its port from the bootstrap server), off the scheduler's
        thread. A post that fails fails the receiver with the reason."""
        attention = attention_ranks()
        if (attention is not None and (attention.tp_rank, attention.cp_rank) != (0, 0)) or int(
            getattr(self.kv_args, "pp_rank", 0) or 0
        ):
            return
        peer = self.peers.table.get(receiver.bootstrap_addr)
        if peer is None or peer.http_port is None:
            receiver.fail(f"rebootstrap: the prefill behind {receiver.bootstrap_addr} named no HTTP port")
            return
        host = receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{peer.http_port}/generate"

        def post() -> None:
            status, answer = post_generate(url, payload, self.bootstrap_timeout_s)
            if status != 200:
                receiver.fail(f"rebootstrap: {url} answered {status or 'nothing'}: {answer[:200]}")

        self._recompute.submit(post)

    # Deferred decode KV release: the agent knows when a failed room's sources are quiet.
    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        room = self.current_room(int(bootstrap_room))
        view = self.events.view(room) if self.events is not None and self.events.synced.is_set() else None
        if view is None:
            try:
                view = self.client.poll(self.rank_id, room)
            except AgentRefused as exc:
                return exc.status == 404  # the agent never took the room: nothing can write into it
            except (OSError, ValueError):
                return False  # unknown: SGLang releases at its deadline
        return view.succeeded if view.sources_quiet is None else view.sources_quiet

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing kept per room here: the agent's room holds the state."""
