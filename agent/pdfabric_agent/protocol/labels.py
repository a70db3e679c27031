"""The closed label sets of the agent's metrics, apart from the metrics themselves so that the wire
format and the engine-side client use them without importing prometheus_client. A metric label
takes its values from one of these, never from a string a request carried."""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    KV = "kv"
    STATE = "state"
    AUX = "aux"


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    FAILED = "failed"  # the engine or the peer reported an error, or the peer is blacklisted
    TIMEOUT = "timeout"  # a deadline (bootstrap, transfer, waiting) passed first


class Completion(enum.StrEnum):
    """How a decode agent learned that one source's data had landed."""

    COMPLETION_BOARD = "completion-board"  # read the sender kernel's completion word itself
    DONE_REPORT = "done-report"  # the sender's report after its batches were confirmed


class Refusal(enum.StrEnum):
    UNAUTHORIZED = "unauthorized"  # engine door: missing or wrong engine token; peer door: not an agent
    WRONG_CLUSTER = "wrong_cluster"
    MALFORMED = "malformed"
    OUT_OF_RANGE = "out_of_range"
    UNKNOWN_RANK = "unknown_rank"
    UNKNOWN_ROOM = "unknown_room"
    CONFLICT = "conflict"  # the room is already active on that rank
    # A memory registration for a rank another engine process, still live, registered (409)
    RANK_TAKEN = "rank_taken"
    LAYOUT_MISMATCH = "layout_mismatch"  # an engine's buffers do not fit the PDCluster's model (422)
    # A room for the engine's own memory on a rank with none registered (the agent restarted): 409
    MEMORY_NOT_REGISTERED = "memory_not_registered"
    # GPU memory handed over for the NIC that this node cannot register (no RDMA device, no dma-buf
    # support in libibverbs, the kernel or the NIC's driver): 422
    NIC_REFUSED = "nic_refused"
    WRONG_PEER = "wrong_peer"  # an authenticated peer speaking for a rank the rank map does not give it
    TOO_LARGE = "too_large"  # body, head or a list longer than the largest legal request (413, 431)
    TIMEOUT = "timeout"  # head or body not read within its deadline (408)
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the listener's connection bound (429)
    TLS_HANDSHAKE = "tls_handshake"  # the peer door: a TLS handshake that failed or took too long (reset)
    INTERNAL = "internal"  # an unexpected error, logged (500): never bad input


class Integrity(enum.StrEnum):
    """The result of an end-to-end checksum comparison (spec.transfer.verify)."""

    MATCH = "match"
    MISMATCH = "mismatch"
