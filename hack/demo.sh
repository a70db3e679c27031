#!/usr/bin/env bash
# The demo on the embedded default: bring the local control plane up with its fake GPU fleet and
# show it. Leaves the cluster running; `make cluster-down` stops it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/hack"
"$PYTHON" -m pdfabric_devcluster up
state="$root/.artifacts/cluster/state.json"
kubeconfig="$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['kubeconfig'])" "$state")"
bin="$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['bin_dir'])" "$state")"
kubectl() { "$bin/kubectl" --kubeconfig="$kubeconfig" "$@"; }
echo; echo "== GPU nodes (fake, kwok-managed)"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count,nvidia.com/gpu.clique \
  -o custom-columns='NAME:.metadata.name,READY:.status.conditions[?(@.type=="Ready")].status,GPUS:.status.allocatable.nvidia\.com/gpu,RDMA:.status.allocatable.rdma/hca,PRODUCT:.metadata.labels.nvidia\.com/gpu\.product,CLIQUE:.metadata.labels.nvidia\.com/gpu\.clique'
echo; echo "== control plane"
kubectl get --raw='/readyz?verbose' | tail -n 3
kubectl version 2>/dev/null | grep -v Kustomize
echo; echo "Cluster left running. Use it with:"
echo "  export KUBECONFIG=$kubeconfig PATH=$bin:\$PATH"
echo "Stop it with: make cluster-down"
