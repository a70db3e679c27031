#!/usr/bin/env bash
# Makes the project's Python environment outside the repository (torch is a large download:
# once per machine) and reinstalls only when pyproject.toml's dependency lists change.
# Also installs the Debian libraries the Mooncake engine loads even without RDMA hardware.
# Prints the venv's python on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PDFABRIC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric/venv}"
py=python3.11
command -v "$py" >/dev/null || py=python3

need_debs=()
for pkg in libibverbs1 librdmacm1 libnuma1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need_debs+=("$pkg")
done
if ((${#need_debs[@]})); then
  echo "installing Debian packages: ${need_debs[*]}" >&2
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq >&2 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}" >&2
fi

reqs="$("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
# The sglang extra names SGLang with its GPU dependency set; the tests take it from the CPU lists below.
# agent-cuda13 is the GPU agent image's (Mooncake's cuda13 engine needs libcuda to import).
extras = {k: v for k, v in p.get("optional-dependencies", {}).items() if k not in ("sglang", "agent-cuda13")}
print("\n".join(p["dependencies"] + [d for ds in extras.values() for d in ds]))
PY
)"
sglang_reqs="$root/hack/sglang-cpu.txt"
sglang_nodeps="$root/hack/sglang-cpu-nodeps.txt"
nixl_nodeps="$root/images/nixl-nodeps.txt"
stamp="$({ printf '%s' "$reqs"; cat "$sglang_reqs" "$sglang_nodeps" "$nixl_nodeps"; } | sha256sum | cut -c1-16)"
if [[ -x "$venv/bin/python" && "$(cat "$venv/.pdfabric-deps" 2>/dev/null)" == "$stamp" ]]; then
  echo "python environment up to date: $venv" >&2
else
  echo "installing Python dependencies into $venv (torch is large: first time only)" >&2
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  printf '%s\n' "$reqs" > "$venv/.requirements.txt"
  "$venv/bin/python" -m pip install --progress-bar off -r "$venv/.requirements.txt" >&2
  "$venv/bin/python" -m pip install --progress-bar off -r "$sglang_reqs" >&2
  "$venv/bin/python" -m pip install --progress-bar off --no-deps -r "$sglang_nodeps" >&2
  "$venv/bin/python" -m pip install --progress-bar off --no-deps -r "$nixl_nodeps" >&2
  echo "$stamp" > "$venv/.pdfabric-deps"
fi
echo "$venv/bin/python"
