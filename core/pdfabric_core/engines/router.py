"""SGLang's PD router in front of a PDCluster's engines: its worker arguments, from the
PDCluster's ``status.endpoints``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def sglang_router_args(endpoints: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """SGLang's PD router's worker arguments from a PDCluster's ``status.endpoints``: each prefill
    engine by its own URL with its bootstrap port (decode asks *that* prefill which request it
    sent, so no load-balanced address will do), each decode engine by its URL. What docs/engines.md's
    shell recipe builds with kubectl; a role without endpoints is an error, since the router cannot
    pair a request without both."""
    prefill, decode = endpoints.get("prefill") or [], endpoints.get("decode") or []
    if not prefill or not decode:
        raise ValueError("the router needs at least one prefill and one decode endpoint (status.endpoints)")
    args = ["--pd-disaggregation"]
    for e in prefill:
        boot = e.get("bootstrapPort")
        args += ["--prefill", str(e["url"]), "none" if boot is None else str(int(boot))]
    for e in decode:
        args += ["--decode", str(e["url"])]
    return args
