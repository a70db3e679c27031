"""An engine's PD router in front of a PDCluster's engines: its worker arguments, from the
PDCluster's ``status.endpoints``. SGLang's and vLLM's routers take the same flags for their workers
but pair a request differently, so what each needs of an endpoint differs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdfabric_core.spec.serving import RouterKind

Endpoints = Mapping[str, Sequence[Mapping[str, Any]]]


def _both_roles(endpoints: Endpoints) -> tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]:
    prefill, decode = endpoints.get("prefill") or [], endpoints.get("decode") or []
    if not prefill or not decode:
        raise ValueError("the router needs at least one prefill and one decode endpoint (status.endpoints)")
    return prefill, decode


def sglang_router_args(endpoints: Endpoints) -> list[str]:
    """SGLang's PD router's worker arguments from a PDCluster's ``status.endpoints``: each prefill
    engine by its own URL with its bootstrap port (decode asks *that* prefill which request it
    sent, so no load-balanced address will do), each decode engine by its URL. What docs/engines.md's
    shell recipe builds with kubectl; a role without endpoints is an error, since the router cannot
    pair a request without both."""
    prefill, decode = _both_roles(endpoints)
    args = ["--pd-disaggregation"]
    for e in prefill:
        boot = e.get("bootstrapPort")
        args += ["--prefill", str(e["url"]), "none" if boot is None else str(int(boot))]
    for e in decode:
        args += ["--decode", str(e["url"])]
    return args


def vllm_router_args(endpoints: Endpoints) -> list[str]:
    """vLLM's router (vllm-router) in P/D mode: each engine by its URL (vLLM's prefill has no
    bootstrap server: its answer's kv_transfer_params tell decode where the KV is). The router
    sends prefill the request with ``do_remote_decode`` and one token, then decode the request with
    prefill's kv_transfer_params: the protocol of ``--kv-connector nixl``, which pdfabric's vLLM
    connector speaks with its own params (docs/vllm.md)."""
    prefill, decode = _both_roles(endpoints)
    args = ["--vllm-pd-disaggregation"]
    for e in prefill:
        args += ["--prefill", str(e["url"])]
    for e in decode:
        args += ["--decode", str(e["url"])]
    return [*args, "--kv-connector", "nixl"]


def router_worker_args(kind: RouterKind, endpoints: Endpoints) -> list[str]:
    """The worker arguments of ``kind``'s router."""
    return sglang_router_args(endpoints) if kind == RouterKind.SGLANG else vllm_router_args(endpoints)
