"""Refusals of the agent's APIs: an HTTP status, a closed-set reason (a metric label) and a message
that says what to fix. Every check that refuses input raises ``ApiError``; the server turns it into
``{"error", "reason"}`` with that status."""

from __future__ import annotations

from pdfabric_agent.protocol.labels import Refusal


class ApiError(Exception):
    def __init__(self, status: int, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def body(self) -> dict[str, str]:
        """The refusal as every answer carries it (a POST's body, a stream frame's)."""
        return {"error": self.message, "reason": self.reason.value}


def internal_error(exc: Exception) -> ApiError:
    """An error no check anticipated, as the caller is told (the agent logs it; bad input is always
    a 4xx)."""
    return ApiError(500, Refusal.INTERNAL, f"internal error ({type(exc).__name__}), logged by the agent")


def malformed(message: str) -> ApiError:
    return ApiError(400, Refusal.MALFORMED, message)


def out_of_range(message: str) -> ApiError:
    return ApiError(400, Refusal.OUT_OF_RANGE, message)


def unknown_rank(message: str) -> ApiError:
    return ApiError(404, Refusal.UNKNOWN_RANK, message)


def unknown_room(room: int, rank_id: str) -> ApiError:
    return ApiError(404, Refusal.UNKNOWN_ROOM, f"room {room} is unknown on {rank_id}")


def memory_not_registered(rank_id: str) -> ApiError:
    return ApiError(
        409,
        Refusal.MEMORY_NOT_REGISTERED,
        f"{rank_id} has no engine memory registered here (the agent restarted since the engine registered): "
        "register it again (POST /v1/memory), then resubmit",
    )


def conflict(message: str) -> ApiError:
    return ApiError(409, Refusal.CONFLICT, message)


def rank_taken(message: str) -> ApiError:
    return ApiError(409, Refusal.RANK_TAKEN, message)


def wrong_peer(message: str) -> ApiError:
    return ApiError(403, Refusal.WRONG_PEER, message)


def layout_mismatch(message: str) -> ApiError:
    return ApiError(422, Refusal.LAYOUT_MISMATCH, message)


def nic_refused(message: str) -> ApiError:
    return ApiError(422, Refusal.NIC_REFUSED, message)
