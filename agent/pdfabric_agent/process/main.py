"""Agent process: config -> rank map -> hardware and transport -> pools and engines -> servers -> the
serving engines it supervises (spec.engine, supervisor.py), once Ready.

Exit codes: 0 on SIGTERM/SIGINT, 2 on a configuration error (bad env, unreadable rank map, a spec
the agent cannot honour). A transport this node cannot carry is not an exit: the agent stays up,
/readyz answers 503 with the reason (e.g. NoNvlinkPeerAccess) and the transfer API stays closed,
so the operator can surface the reason instead of watching a crash loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from aiohttp import web

from pdfabric_agent.engines import sandbox
from pdfabric_agent.engines.supervisor import EngineSupervisor
from pdfabric_agent.http.guard import Guard, GuardedTCPSite
from pdfabric_agent.http.server import Door, Readiness, build_api_app, build_metrics_app
from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools
from pdfabric_agent.node import probe
from pdfabric_agent.node.hardware import Hardware, detect_hardware
from pdfabric_agent.node.transport import TransportChoice, TransportError, choose_transport, mooncake_env
from pdfabric_agent.process.limits import raise_descriptor_limit, size_peer_door
from pdfabric_agent.process.link_check import link_check
from pdfabric_agent.process.rankmap_file import CHECK_EVERY_S, RankMapFile
from pdfabric_agent.protocol import tls
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.writer import TCP_SIDE_CHANNEL
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.config import AgentConfig, ConfigError, load_config, require_peer_tls
from pdfabric_agent.runtime.inputs import InputRefusals
from pdfabric_agent.service.agent import Agent
from pdfabric_agent.service.membership import MembershipRefused
from pdfabric_agent.transfer.registry import make_backend
from pdfabric_core.engines.launch import EngineLaunch
from pdfabric_core.policy.buffer_device import kv_buffer_device, metadata_buffer_device
from pdfabric_core.policy.transports import FALLBACK_TRANSPORT, tcp_fallback_allowed
from pdfabric_core.policy.types import MemPool, Transport
from pdfabric_core.rankmap import AgentEntry, RankMap
from pdfabric_core.spec import EngineSandbox, PDClusterSpec, SpecError, parse_spec

log = logging.getLogger("pdfabric.main")

TICK_S = 0.1  # deadline and probe resolution; cheap (a scan of the active rooms)
# The engine door listens on loopback only: engines in the agent pod's network namespace reach it,
# nothing on the network does (issue 12 runs the engines beside the agent in the same pod).
ENGINE_DOOR_HOST = "127.0.0.1"
# The closed transfer backends, kept alive until the process exits (exit_without_destructors).
_CLOSED_BACKENDS: list[object] = []


def remove_stale_pools(shm_dir: str, cluster_uid: str) -> None:
    """Unlink pool files of this cluster left by agent processes that died without cleanup
    (SIGKILL, OOM): each name carries its owner's pid."""
    prefix = f"pdfabric-{cluster_uid[:8]}-"
    for name in os.listdir(shm_dir):
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
        except PermissionError:  # alive, another user's
            continue


def build_ranks(
    cfg: AgentConfig, rankmap: RankMap, spec: PDClusterSpec, entry: AgentEntry, transport: Transport
) -> dict[str, LocalRank]:
    """Pools sized from the model geometry, on the devices the upstream policy names, registered
    with one engine per rank."""
    kv_device = kv_buffer_device(transport)
    aux_device = metadata_buffer_device(spec.transfer.mem_pool)
    ranks: dict[str, LocalRank] = {}
    remove_stale_pools(cfg.shm_dir, rankmap.cluster_uid)
    tag = f"pdfabric-{rankmap.cluster_uid[:8]}-{os.getpid()}"
    for rank in entry.ranks:
        tp = spec.prefill.tp if rank.role == "prefill" else spec.decode.tp
        pp = spec.prefill.pp if rank.role == "prefill" else spec.decode.pp
        layout = PoolLayout.from_geometry(
            spec.model,
            tp,
            kv_pages=cfg.kv_pages,
            state_slots=cfg.state_slots,
            aux_slots=cfg.aux_slots,
            pp=pp,
            pp_stage=rank.pp_rank,
        )
        pools = RankPools(
            layout,
            Pool.allocate(f"{tag}-{rank.rank_id}-kv", layout.kv_bytes, kv_device, shm_dir=cfg.shm_dir, gpu=rank.gpu),
            Pool.allocate(
                f"{tag}-{rank.rank_id}-state", layout.state_bytes, kv_device, shm_dir=cfg.shm_dir, gpu=rank.gpu
            ),
            Pool.allocate(f"{tag}-{rank.rank_id}-aux", layout.aux_bytes, aux_device, shm_dir=cfg.shm_dir, gpu=rank.gpu),
        )
        backend = make_backend(
            spec.backend,
            transport,
            host=cfg.engine_host,
            gpu=rank.gpu,
            max_batch_entries=spec.transfer.max_batch_entries,
            timeout_s=spec.transfer.timeout_seconds,
        )
        for pool in pools.all():
            backend.register(pool)
        for kind, pool in (("kv", pools.kv), ("state", pools.state), ("aux", pools.aux)):
            metrics.pool_bytes.labels(rankmap.cluster, rank.rank_id, kind, pool.device.value).set(pool.size)
        metrics.engine_up.labels(rankmap.cluster, rank.rank_id, spec.backend, transport.value).set(1)
        ranks[rank.rank_id] = LocalRank(rank, backend, pools)
        log.info(
            "rank %s: engine %s, kv %d bytes on %s", rank.rank_id, backend.endpoint(), pools.kv.size, kv_device.value
        )
    return ranks


INTRA_NODE_NVLINK_ONE_GPU = "IntraNodeNvlinkOneGpu"  # readiness reason


def check_mem_pool(
    spec: PDClusterSpec, hw: Hardware, choice: TransportChoice, env: dict[str, str], rank_gpus: Sequence[int] = ()
) -> TransportChoice:
    """INTRA_NODE_NVLINK maps the peer GPUs' memory, so a process that sees one GPU cannot work
    (upstream dropped the TCP fallback there): a start-up error with the fix in the message
    (``check_intra_node_nvlink_startup``), raised as a readiness reason, unless the spec declares
    placement.fallback TCP, which then moves this agent to tcp."""
    if spec.transfer.mem_pool != MemPool.INTRA_NODE_NVLINK or choice.transport is Transport.TCP:
        return choice
    from pdfabric_agent.transfer.fastpath.select import IntraNodeNvlinkError, check_intra_node_nvlink_startup

    try:
        check_intra_node_nvlink_startup(
            spec.transfer.mem_pool,
            hw.gpus,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            rank_gpus=rank_gpus or None,
        )
    except IntraNodeNvlinkError as exc:
        if tcp_fallback_allowed(spec.placement.fallback, choice.transport):
            note = f"{INTRA_NODE_NVLINK_ONE_GPU}: {exc}; fell back to {FALLBACK_TRANSPORT.value}"
            return TransportChoice(FALLBACK_TRANSPORT, fell_back_from=choice.transport, note=note)
        raise TransportError(INTRA_NODE_NVLINK_ONE_GPU, str(exc)) from None
    return choice


def engine_exit_handler(agent: Agent) -> Callable[[EngineLaunch, str], None]:
    """What the agent does when a serving engine's run ended (before its restart)."""

    def exited(launch: EngineLaunch, how: str) -> None:
        agent.engine_exited(launch.rank_ids, f"engine {launch.name} exited ({how})")

    return exited


def follow_rankmap(agent: Agent, source: RankMapFile, readiness: Readiness) -> None:
    """Adopt the mounted rank map when the operator changed it (service/membership.py)."""
    newer = source.newer()
    if newer is None:
        return
    try:
        adopted = agent.adopt(newer)
    except Exception as exc:
        if not isinstance(exc, MembershipRefused):
            log.exception("rank map %s: adopting it failed", newer.digest)
        readiness.rankmap_refused = f"rank map {newer.digest}: {exc}"
        metrics.rankmap_reloads.labels(agent.cluster, "refused").inc()
        log.warning("not adopting %s", readiness.rankmap_refused)
        return
    readiness.rankmap, readiness.rankmap_refused = adopted.digest, ""
    metrics.rankmap_reloads.labels(agent.cluster, "adopted").inc()
    log.info("adopted %s", adopted.summary())


class _Stopping(Exception):
    """SIGTERM arrived before the agent was ready."""


async def serve(cfg: AgentConfig) -> int:
    readiness = Readiness()
    try:
        rankmap_file = RankMapFile(cfg.rankmap_path)
        readiness.inputs.append(rankmap_file)
        rankmap = rankmap_file.rankmap
        spec = parse_spec(rankmap.spec)
        entry = rankmap.own_entry(cfg.pod_name, cfg.node_name)
    except (OSError, ValueError, LookupError, KeyError, SpecError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    cluster = rankmap.cluster
    metrics.agent_ready.labels(cluster).set(0)
    # The serving engines (spec.engine): listed as Waiting until the agent is Ready, then run.
    supervisor: EngineSupervisor | None = None
    if cfg.engines:
        supervisor = EngineSupervisor.from_config(
            cfg,
            cluster=cluster,
            api_port=cfg.api_port or spec.agent.api_port,
            sandbox_mode=spec.engine.sandbox if spec.engine else EngineSandbox.BEST_EFFORT,
        )
        readiness.engines = supervisor.states
    runners: list[web.AppRunner] = []
    mrunner = web.AppRunner(build_metrics_app(readiness), access_log=None)
    await mrunner.setup()
    # Guarded too: slow clients on the metrics port would take this process's descriptors as well.
    await GuardedTCPSite(
        mrunner, cfg.bind_address, cfg.metrics_port or spec.agent.metrics_port, cluster=cluster
    ).start()
    runners.append(mrunner)

    agent: Agent | None = None
    peer_tls: tls.PeerTls | None = None
    tls_refusals = InputRefusals(tls.INPUT_NAME, cluster)
    readiness.inputs.append(tls_refusals)
    probe_pools: dict[str, Pool] = {}
    peer_door: Guard | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        gpus = sorted({r.gpu for r in entry.ranks})
        hw = detect_hardware(gpus)
        choice = choose_transport(spec, rankmap.transport, hw, gpus)
        choice = check_mem_pool(spec, hw, choice, dict(os.environ), gpus)
        if choice.fell_back_from is not None:
            log.warning("transport: %s", choice.note)
        requested = choice.fell_back_from or choice.transport
        metrics.transport_info.labels(cluster, requested.value, choice.transport.value).set(1)
        os.environ.update(mooncake_env(choice.transport, spec.transfer.timeout_seconds, cfg.engine_host))
        ranks = build_ranks(cfg, rankmap, spec, entry, choice.transport)
        roles = sorted({lr.rank.role for lr in ranks.values()})
        paths = tuple(sorted({p for lr in ranks.values() for p in lr.backend.paths} | {TCP_SIDE_CHANNEL}))
        for role in roles:
            metrics.precreate(cluster, role, spec.backend, choice.transport.value, paths)
        agent = Agent(cfg, rankmap, spec, ranks, choice.transport, requested=requested)
        readiness.requested, readiness.transport = requested.value, choice.transport.value
        readiness.rankmap = rankmap.digest
        backends = {rid: lr.backend for rid, lr in ranks.items()}
        gpu_of = {rid: lr.rank.gpu for rid, lr in ranks.items()}
        probe_pools.update(probe.allocate(rankmap, backends, kv_buffer_device(choice.transport), cfg.shm_dir, gpu_of))
        agent.probe_regions = probe.describe(probe_pools, backends)
        prunner = web.AppRunner(build_api_app(agent, Door.PEER), access_log=None)
        await prunner.setup()
        runners.append(prunner)
        peer_port = cfg.peer_port or spec.agent.peer_port
        peer_tls = tls.PeerTls.of(cfg.peer_tls_dir)
        if agent.peers.peers_file is not None:
            readiness.inputs.append(agent.peers.peers_file)
        for reload_outcome in ("loaded", "refused"):  # at 0 from the start: the first refusal is an increase
            metrics.peer_certificate_reloads.labels(cluster, reload_outcome)
        for reload_outcome in ("adopted", "refused"):
            metrics.rankmap_reloads.labels(cluster, reload_outcome)
        peer_site = GuardedTCPSite(prunner, cfg.bind_address, peer_port, ssl_context=peer_tls.server)
        await peer_site.start()
        peer_door = peer_site.guard
        size_peer_door(peer_door, agent)
        await link_check(
            readiness,
            probe.LinkCheck(rankmap, spec, entry.name, backends, probe_pools, cfg.probe_peers_max),
            agent,
            stop,
        )
        if stop.is_set():
            raise _Stopping
        erunner = web.AppRunner(build_api_app(agent, Door.ENGINE), access_log=None)
        await erunner.setup()
        runners.append(erunner)
        await GuardedTCPSite(erunner, ENGINE_DOOR_HOST, cfg.api_port or spec.agent.api_port).start()
        readiness.ready, readiness.reason = True, "Ready"
        readiness.message = f"{len(ranks)} ranks on {choice.transport.value}" + (
            f" ({choice.note})" if choice.note else ""
        )
        metrics.agent_ready.labels(cluster).set(1)
        log.info("agent %s ready: %s", entry.name, readiness.message)
        if supervisor is not None:
            supervisor.start(engine_exit_handler(agent))
    except _Stopping:
        pass
    except TransportError as exc:
        readiness.reason, readiness.message = exc.reason, str(exc)
        log.error("cannot serve: %s (%s)", exc, exc.reason)
    except Exception as exc:  # engine init or pool allocation: stay up, not ready, say why
        readiness.reason, readiness.message = "EngineFailed", f"{type(exc).__name__}: {exc}"
        log.exception("agent start failed")

    try:
        tls_checked = rankmap_checked = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)
            if agent is not None:
                await agent.tick()
                if time.monotonic() - rankmap_checked >= CHECK_EVERY_S:
                    rankmap_checked = time.monotonic()
                    follow_rankmap(agent, rankmap_file, readiness)
                    size_peer_door(peer_door, agent)
            if peer_tls is not None and time.monotonic() - tls_checked >= tls.RELOAD_CHECK_S:
                tls_checked = time.monotonic()
                outcome = peer_tls.reload_if_changed()  # the operator renewed the certificate
                if outcome is not None:
                    metrics.peer_certificate_reloads.labels(cluster, outcome).inc()
                    tls_refusals.said(peer_tls.problem)
    finally:
        readiness.ready = False
        readiness.reason, readiness.message = "ShuttingDown", "the agent is stopping"
        metrics.agent_ready.labels(cluster).set(0)
        if supervisor is not None:  # engines first: they may still talk to the agent while stopping
            await supervisor.stop()
        if agent is not None:
            await agent.close()
            for rank_id, lr in agent.ranks.items():
                metrics.engine_up.labels(cluster, rank_id, spec.backend, agent.transport).set(0)
                lr.backend.close()
                lr.pools.close()
                _CLOSED_BACKENDS.append(lr.backend)
        for runner in runners:
            await runner.cleanup()
        for pool in probe_pools.values():
            pool.close()
    return 0


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("PDFABRIC_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before any secret is read: engines and other processes of this user cannot read this one's
    # memory, environment or descriptors (sandbox.py says what holds where).
    if not sandbox.keep_private():
        logging.getLogger("pdfabric.agent").warning(
            "could not make the agent non-dumpable: its /proc files stay readable"
        )
    before, after = raise_descriptor_limit()
    if after != before:
        logging.getLogger("pdfabric.agent").info("descriptor limit raised from %d to %d", before, after)
    try:
        cfg = load_config()
        require_peer_tls(cfg)
    except ConfigError as exc:
        print(f"pdfabric-agent: {exc}", file=sys.stderr)
        sys.exit(2)
    exit_without_destructors(asyncio.run(serve(cfg)))


def exit_without_destructors(code: int) -> None:
    """Exit once serve() has shut down in order (engines stopped, memory unregistered, pool files
    unlinked, listeners closed), skipping what is left: the transfer engines' destructors. Mooncake's
    takes about a second per engine, one engine per rank, one after another (measured here: 3 s for
    a 4-rank agent, 7 s for 8), and frees nothing the kernel does not free at exit; a pod's stop
    should not wait for them."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
