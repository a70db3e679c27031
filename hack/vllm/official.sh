#!/usr/bin/env bash
# The official vLLM release (a CUDA build) as an overlay on the vLLM environment (hack/vllm/venv.sh):
# its wheel installed --no-deps into a directory of its own. With that directory first on the vLLM
# venv's PYTHONPATH, `import vllm` is this release while its dependencies stay the CPU venv's; its
# compiled kernels do not load on CPU, its pure-Python classes (scheduler, connector API) do, which
# is what tests/e2e/vllm_official_classes.py drives pdfabric's connector through.
# Installed once (about 340 MB); prints the overlay's directory on its last line.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="${PDFABRIC_VLLM_OFFICIAL:-0.33.0}"
overlay="${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric/vllm-$version"
python="$(bash "$here/venv.sh" | tail -n1)"
stamp="vllm==$version"
if [[ -d "$overlay/vllm" && "$(cat "$overlay/.pdfabric-deps" 2>/dev/null)" == "$stamp" ]]; then
  echo "official vLLM $version up to date: $overlay" >&2
else
  echo "installing the official vLLM $version wheel into $overlay (first time only)" >&2
  rm -rf "$overlay"
  "$python" -m pip install --progress-bar off --no-deps --no-compile --target "$overlay" "$stamp" >&2
  echo "$stamp" > "$overlay/.pdfabric-deps"
fi
echo "$overlay"
