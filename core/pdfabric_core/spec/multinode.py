"""The rules for a replica over several nodes (``nodesPerReplica``), mirrored in the CRD's CEL: how
its ranks split into equal node blocks as SGLang's ``--nnodes`` splits them, which transports can
carry it, and what its engines must be told. Each refusal names the field and what to change."""

from __future__ import annotations

import re

from pdfabric_core.policy.transports import Locality, transport_traits
from pdfabric_core.spec.model import PDClusterSpec, SpecError

MAX_NODES_PER_REPLICA = 64  # the CRD's maximum
# What an engine of a replica over several nodes must pass on to its server (EngineEnv's names):
# SGLang's --nnodes, --node-rank and --dist-init-addr.
GROUP_VARIABLES = ("PDFABRIC_NNODES", "PDFABRIC_NODE_RANK", "PDFABRIC_DIST_INIT_ADDR")


def split_error(role: str, nodes: int, tp: int, pp: int) -> str:
    """Why `nodes` node ranks cannot split a replica of tp x pp ranks as SGLang does ('' if they can):
    a node holds whole PP stages (nodes divides pp) or a TP slice of one stage (pp divides nodes and
    nodes / pp divides tp)."""
    if pp % nodes == 0 or (nodes % pp == 0 and tp % (nodes // pp) == 0):
        return ""
    return (
        f"{role}.nodesPerReplica {nodes} cannot split a replica of tp {tp} x pp {pp} into equal node blocks: "
        f"it must divide {role}.pp, or be a multiple of it whose quotient divides {role}.tp (SGLang's --nnodes)"
    )


def validate_nodes_per_replica(spec: PDClusterSpec) -> None:
    _validate_group_topology_key(spec.placement.group_topology_key)
    for role in ("prefill", "decode"):
        par = spec.role(role)
        nodes = par.nodes_per_replica
        if not 1 <= nodes <= MAX_NODES_PER_REPLICA:
            raise SpecError(f"{role}.nodesPerReplica must be within 1..{MAX_NODES_PER_REPLICA}, got {nodes}")
        if nodes == 1:
            continue
        cp = spec.prefill.cp if role == "prefill" else 1
        if par.dp != 1 or cp != 1:
            raise SpecError(
                f"{role}.nodesPerReplica {nodes} needs {role}.dp 1 and cp 1: a replica over several nodes splits "
                f"its TP and PP ranks, as SGLang's --nnodes does; set nodesPerReplica to 1 or dp and cp to 1"
            )
        why = split_error(role, nodes, par.tp, par.pp)
        if why:
            raise SpecError(why)
        if transport_traits(spec.transfer.effective_transport).locality is Locality.NODE:
            raise SpecError(
                f"{role}.nodesPerReplica {nodes}: intra-node NVLink keeps every replica on one node; "
                f"use transport nvlink or rdma, or nodesPerReplica 1"
            )
        if spec.engine is not None:
            engine = spec.engine.role(role)
            argv = " ".join((*engine.command, *engine.args))
            missing = [v for v in GROUP_VARIABLES if f"$({v})" not in argv]
            if missing:
                raise SpecError(
                    f"engine.{role}.args must pass {', '.join(f'$({v})' for v in missing)} to the server when "
                    f"{role}.nodesPerReplica is {nodes}: each node's engine needs the group's size, its node rank "
                    f"and the leader's address (SGLang: --nnodes $(PDFABRIC_NNODES) --node-rank "
                    f"$(PDFABRIC_NODE_RANK) --dist-init-addr $(PDFABRIC_DIST_INIT_ADDR))"
                )


# A label key as the API server takes it: an optional DNS subdomain prefix and "/", then a name of
# at most 63 characters (the CRD's pattern for placement.groupTopologyKey).
_LABEL_KEY = re.compile(
    r"(([a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


def _validate_group_topology_key(key: str) -> None:
    if key and (len(key) > 317 or not _LABEL_KEY.fullmatch(key)):
        raise SpecError(
            f"placement.groupTopologyKey must be a node label key ([prefix/]name, e.g. topology.kubernetes.io/zone), "
            f"got {key!r}"
        )
