"""The delete handler's work: a deleted PDCluster's agent pods and children removed now (the
garbage collector would too, later; ours only, never a namesake), its PDRoles, its ledger entry
and its memory."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import kopf

from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.children import delete_owned_children
from pdfabric_operator.ledger import LEDGER
from pdfabric_operator.operator_state import STATE
from pdfabric_operator.roles import delete_owned_roles
from pdfabric_operator.snapshot import OwnPod


async def clean_up(ref: ClusterRef, pods: Sequence[OwnPod], logger: kopf.Logger) -> None:
    """Delete the children now (the garbage collector would too, later) and free the ledger."""
    uid = ref.uid
    kube = STATE.get_kube()

    def _delete() -> None:
        for p in pods:
            kube.delete("Pod", p.namespace, p.name, uid=p.uid)
        # Ours only: a user's object that happens to carry a child's name stays.
        delete_owned_children(kube, ref, [p.name for p in pods])
        delete_owned_roles(kube, ref)

    await asyncio.to_thread(_delete)
    with LEDGER.lock:  # reconciles of other clusters may be planning in worker threads
        LEDGER.forget(uid)
    STATE.memory.pop(uid, None)
    STATE.generations.pop(uid, None)
    logger.info(f"deleted {len(pods)} agent pods and the shared children")
