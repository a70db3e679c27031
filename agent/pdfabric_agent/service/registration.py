"""An engine's own buffers becoming a rank's memory (``POST /v1/memory``, ``Agent.register_memory``):
checked against the model, mapped, registered with the rank's transfer engine, the previous
engine's (an engine restart) released. Refused while another live engine instance holds the rank
(``registrants``: 409 ``rank_taken``), while the rank has open rooms (their plans point into the
memory they were submitted with), and when the buffers overlap another rank's engine memory;
nothing stays mapped or registered after a refusal."""

from __future__ import annotations

from pdfabric_agent.protocol.errors import conflict, layout_mismatch
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import MemoryAnswer
from pdfabric_agent.ranks.engine_memory import EngineMemory, MemoryRules, engine_layout
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.runtime import metrics
from pdfabric_agent.service.registrants import check_registrant


def register_engine_memory(
    ctx: AgentContext, msg: MemoryRegistration, rules: MemoryRules, *, shm_dir: str, cluster: str
) -> MemoryAnswer:
    local = ctx.ranks.served(msg.rank)
    check_registrant(local, msg.instance, ctx.feed)
    busy = sum(1 for _, room in ctx.rooms.open_rooms() if room.rank == msg.rank)
    if busy:
        raise conflict(f"{msg.rank} has {busy} open rooms: register its memory before traffic or once they end")
    layout = engine_layout(msg, ctx.spec, local.rank, rules)
    engine = EngineMemory.map(msg, layout, shm_dir=shm_dir, gpu=local.rank.gpu, aux_device=rules.aux_device)
    for other in ctx.ranks.by_id.values():
        shared = other.engine.overlap(engine) if other is not local and other.engine is not None else None
        if shared is not None:
            engine.close()
            raise conflict(
                f"bytes {shared.start}..{shared.end} of {shared.path} are {other.rank.rank_id}'s engine memory: "
                f"each rank registers its own buffers"
            )
    try:
        for region in engine.regions():
            local.backend.register(region)
    except Exception as exc:
        engine.close()
        raise layout_mismatch(f"the transfer engine refused the buffers of {msg.rank}: {exc}") from None
    previous, local.engine, local.engine_instance = local.engine, engine, msg.instance
    if previous is not None:
        for region in previous.regions():
            local.backend.unregister(region)
        previous.close()
    for kind, regions in (("kv", engine.kv), ("state", engine.state), ("aux", engine.aux)):
        device = regions[0].device.value if regions else "cpu"
        metrics.pool_bytes.labels(cluster, msg.rank, kind, device).set(sum(r.size for r in regions))
    return engine.answer(msg.rank)
