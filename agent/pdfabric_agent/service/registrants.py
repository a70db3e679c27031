"""Who may register a rank's memory (``Agent.register_memory``): one engine process per rank.

A registration names its engine instance (``MemoryRegistration.instance``: one id per engine
process). A registration from another instance than the rank's current registrant replaces it only
when that registrant is gone; it counts as live while it follows the rank's room feed (``GET
/v1/events/{rank}?instance=...``) on a connection still open. An engine process that exits closes
that connection (the kernel closes its sockets), so a restarted engine registers at once, while a
second engine that claims a live rank (two SGLang DP ranks computing one rank id, a copy of a
deployment started twice) is refused with ``rank_taken`` and the reason, instead of silently
taking the first one's rooms. Open rooms refuse any new registration as well (``conflict``): their
plans point into the memory they were submitted with. The hold lasts while a feed connection is open,
and for a while after the agent itself dropped a live engine's feed for falling behind (the engine
reconnects; ``feed.RECONNECT_HOLD_S``). After an agent restart nothing is held until the engine
registers again.

A registrant without an instance id (an engine that names none) is the instance ``""``: two such
engines are told apart by nothing but their open rooms, as before instance ids.
"""

from __future__ import annotations

from pdfabric_agent.protocol.errors import rank_taken
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.feed import RoomFeed


def check_registrant(local: LocalRank, instance: str, feed: RoomFeed) -> None:
    """Refuse (409 ``rank_taken``) a registration of ``local``'s memory by engine ``instance``
    while another instance, still live, holds the rank."""
    holder, rank_id = local.engine_instance, local.rank.rank_id
    if local.engine is None or instance == holder or not feed.held_by(rank_id, holder):
        return
    raise rank_taken(
        f"{rank_id} is registered by engine instance {holder or '(unnamed)'!r}, which still follows its room feed "
        f"(or reconnects to it); instance {instance or '(unnamed)'!r} may register it once that engine exits. "
        f"Two engines computing one rank id: check each engine's PDFABRIC_REPLICA and its SGLang DP group "
        f"(docs/sglang.md)"
    )
