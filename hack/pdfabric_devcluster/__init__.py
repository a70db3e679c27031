"""A real local Kubernetes control plane for development and tests, and real agent processes.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kwok controller run as
local processes on free 127.0.0.1 ports, with TLS, RBAC and service-account token signing. Fake
GPU nodes are plain Node objects that kwok keeps Ready; pods scheduled on them reach Running.
`make cluster-up` and the pytest fixtures use the same code (LocalCluster).

Real agent processes on this machine: fabric.LocalFabric (see its module), rooms driven through
them by transfer.transfer_room, bytes written and verified by synthetic.

The names below load on first use, so importing the agent harness needs none of the control
plane's dependencies (GPU machines run it with the agent's alone).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ClusterConfig": "cluster",
    "LocalCluster": "cluster",
    "GpuNodeShape": "nodes",
    "build_gpu_node": "nodes",
    "default_node_shapes": "nodes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
