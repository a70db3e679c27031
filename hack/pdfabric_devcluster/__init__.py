"""A real local Kubernetes control plane for development and tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kwok controller run as
local processes on free 127.0.0.1 ports, with TLS, RBAC and service-account token signing. Fake
GPU nodes are plain Node objects that kwok keeps Ready; pods scheduled on them reach Running.
`make cluster-up` and the pytest fixtures use the same code (LocalCluster).
"""

from pdfabric_devcluster.cluster import ClusterConfig, LocalCluster
from pdfabric_devcluster.nodes import GpuNodeShape, build_gpu_node, default_node_shapes

__all__ = ["ClusterConfig", "GpuNodeShape", "LocalCluster", "build_gpu_node", "default_node_shapes"]
