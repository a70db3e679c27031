"""What a request carries through vLLM's P/D proxy or router in its ``kv_transfer_params``.

vLLM's protocol (its NixlConnector's, which vllm-router and vLLM's own proxy speak): the proxy
sends the prompt to prefill with ``{"do_remote_decode": true}`` and ``max_tokens: 1``; prefill
answers ``kv_transfer_params`` that go with the prompt to decode. With pdfabric they name the room
the prefill rank holds the prompt's KV in and where it is (``RemotePrefill``); the decode ranks
announce their pages for that room to their agents, and the prefill ranks' agents write them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
KEY = "pdfabric"  # our fields, in one object beside vLLM's own
MAX_ROOM = (1 << 63) - 1


class ParamsError(ValueError):
    """kv_transfer_params that do not name a pdfabric room (a proxy that dropped or changed them)."""


def _int(doc: Mapping[str, Any], name: str, upper: int) -> int:
    value = doc.get(name)
    if type(value) is not int or not 0 <= value <= upper:
        raise ParamsError(f"kv_transfer_params.{KEY}.{name} must be an integer within 0..{upper}, not {value!r}")
    return value


@dataclass(frozen=True)
class RemotePrefill:
    """Prefill -> decode, through the proxy: the prompt's KV waits in ``room`` on the ranks of
    prefill replica ``prefill_replica`` (DP group ``prefill_dp``), ``num_tokens`` tokens of it."""

    room: int
    prefill_replica: int
    prefill_dp: int
    num_tokens: int

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        doc = params.get(KEY)
        if not isinstance(doc, Mapping):
            raise ParamsError(
                f"kv_transfer_params has do_remote_prefill but no '{KEY}' object: the prefill that answered them "
                "did not run pdfabric's connector, or the proxy did not pass its kv_transfer_params on whole"
            )
        return cls(
            room=_int(doc, "room", MAX_ROOM),
            prefill_replica=_int(doc, "prefill_replica", 1 << 20),
            prefill_dp=_int(doc, "prefill_dp", 1 << 20),
            num_tokens=_int(doc, "num_tokens", 1 << 40),
        )

    def to_params(self) -> dict[str, Any]:
        """The prefill's answer: vLLM's flags (its proxies read them) and the room."""
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            "remote_num_tokens": self.num_tokens,
            KEY: {
                "room": self.room,
                "prefill_replica": self.prefill_replica,
                "prefill_dp": self.prefill_dp,
                "num_tokens": self.num_tokens,
            },
        }


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and bool(params.get(DO_REMOTE_DECODE))  # type: ignore[union-attr]


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and bool(params.get(DO_REMOTE_PREFILL))  # type: ignore[union-attr]
