#!/usr/bin/env bash
# The demo on the embedded default (see hack/demo.py): a fresh local cluster, the chart, the
# operator, examples/ applied, real agents moving real bytes, Prometheus reading them back.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/core:$root/operator:$root/agent:$root/integrations/sglang:$root/integrations/vllm:$root/hack:$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
"$PYTHON" -m pdfabric_devcluster down >/dev/null
"$PYTHON" -m pdfabric_devcluster up
exec "$PYTHON" hack/demo.py
