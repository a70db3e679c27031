"""SGLang's transfer-backend contract on the node agent: the whole surface SGLang 0.5.23's scheduler
uses (``prefill.py``, ``decode.py``, ``utils.py``), not just what ``base/conn.py`` declares. SGLang
loads the four classes from this module; each lives in its own (``manager``, ``sender``,
``receiver``, ``bootstrap``; what a sender and a receiver share is ``room_client``).

- ``PdfabricKVManager``: one per engine rank. Registers the rank's ``KVArgs`` buffers with the
  agent (``/v1/memory``), which checks them against the PDCluster's model and moves that rank's
  rooms in them from then on. The rendezvous is the PDCluster's rank map, not a bootstrap table;
  decode's ``prefill_info_table`` holds, per prefill bootstrap address, which prefill replica it is
  (``peers.PrefillPeers``, looked up off the scheduler thread).
- ``PdfabricKVSender`` (prefill): SGLang's bootstrap room is the agent's room id (a room SGLang
  opens again, rebootstrap, is a fresh agent room the same on both sides: ``open_room``). ``poll`` reports
  Bootstrapping until the decode side announced the room to the agent, WaitingForInput once every
  decode rank did (the agent names them, so the sender learns the decode replica the router chose),
  then the agent's state of the room. ``send`` takes chunks; the room is submitted with the last
  one (the agent moves a room's pages in one plan).
- ``PdfabricKVReceiver`` (decode): ``init`` takes the prefill replica from the manager's table,
  ``send_metadata`` submits the room's destination pages, aux row and state slots.
- ``PdfabricKVBootstrapServer`` (prefill): tells decode which replica this is; ``/health`` for
  decode's heartbeat.

Every agent call is guarded: an agent that refuses, is down or restarting fails the request with
the reason (``KVTransferError``), never the server. A failure SGLang learns from another rank
through its all-reduce is raised with ``is_from_another_rank``, and this rank's room is aborted at
the agent. Deferred decode KV release (on by default in SGLang) is answered from the agent's own
knowledge of the room: its pages are released once every source's writes are over.

Both sides fill SGLang's ``KVTransferMetric``: latency from the first chunk handed to the backend
(sender) or the metadata submit (receiver) to the agent's confirmed completion, and the bytes the
agent counted for the room, once each (skipped CP state is not counted).
"""

from __future__ import annotations

from pdfabric_sglang.bootstrap import PdfabricKVBootstrapServer
from pdfabric_sglang.manager import PdfabricKVManager
from pdfabric_sglang.receiver import PdfabricKVReceiver
from pdfabric_sglang.sender import PdfabricKVSender

# SGLang loads a transfer backend's classes from one module: this one.
__all__ = ["PdfabricKVBootstrapServer", "PdfabricKVManager", "PdfabricKVReceiver", "PdfabricKVSender"]
