"""What the worker side tells vLLM's connector stats (``KVConnectorStats.data``, serialised from each
worker to vLLM's logger and aggregated there): per interval the rooms that ended, those that failed,
the KV bytes the agents moved for them and how long each took from its order to its end. Plain
dicts, so vLLM can ship them between processes; ``connector.PdfabricStats`` is vLLM's class over
them."""

from __future__ import annotations

import math
from typing import Any

Stats = dict[str, Any]


def empty() -> Stats:
    return {"rooms": 0, "failed_rooms": 0, "kv_bytes": 0, "room_seconds": []}


def is_empty(data: Stats) -> bool:
    return not data["rooms"] and not data["failed_rooms"]


def merge(into: Stats, other: Stats) -> Stats:
    """``other``'s counts added to ``into`` (another worker's, or a later interval's)."""
    for key in ("rooms", "failed_rooms", "kv_bytes"):
        into[key] += int(other.get(key, 0))
    into["room_seconds"].extend(float(s) for s in other.get("room_seconds", ()))
    return into


def record(data: Stats, *, failed: bool, kv_bytes: int, seconds: float) -> None:
    data["rooms"] += 1
    data["failed_rooms"] += int(failed)
    data["kv_bytes"] += kv_bytes
    data["room_seconds"].append(seconds)


def reduce(data: Stats) -> dict[str, int | float]:
    """The interval in a few numbers, as vLLM's logger prints them."""
    seconds = sorted(data["room_seconds"])
    return {
        "Rooms": data["rooms"],
        "Failed rooms": data["failed_rooms"],
        "KV MB moved": round(data["kv_bytes"] / 1e6, 3),
        "Avg room ms": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        "P90 room ms": round(1000 * seconds[math.ceil(0.9 * len(seconds)) - 1], 3) if seconds else 0.0,  # nearest rank
    }
