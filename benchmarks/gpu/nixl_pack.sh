#!/usr/bin/env bash
# NIXL and the Mooncake CUDA engine for a GPU machine without network, small enough to carry in one
# device call (64 MiB at most, with the working tree): the nixl step of run.sh needs both, and their
# wheels alone are over 110 MB.
#   bash benchmarks/gpu/nixl_pack.sh build DIR   where the package registries answer: downloads the
#       cp312 wheels (nixl and nixl-cu13 1.5.1, mooncake-transfer-engine-cuda13 0.3.14, and the
#       certificates' cryptography, cffi, pycparser) and Debian's RDMA/NUMA libraries, unpacks the
#       two native wheels and keeps what a CUDA IPC / tcp run loads (NIXL: its UCX plugin and
#       UCX's tcp, shared-memory and CUDA modules, no other plugins, no InfiniBand, no nixl_ep;
#       Mooncake: engine.so and the libraries it needs, no store, master or collective libraries),
#       each as DIR/*.tar.xz with its dist-info (about 25 MB in all)
#   eval "$(bash benchmarks/gpu/nixl_pack.sh load DIR)"   on the GPU machine: unpacks into
#       /tmp/gpu-nixl, installs the wheels there, and prints PYTHONPATH and LD_LIBRARY_PATH exports
set -euo pipefail
cmd=${1:-}; dir=${2:-.gpu-nixl}
keep_closure() {  # delete every shared library under $1 that no root ($2: a regex of paths) needs
  python3 - "$1" "$2" <<'EOF'
import os, re, subprocess, sys
root, roots = sys.argv[1], re.compile(sys.argv[2])
files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if re.search(r"\.so(\.|$)", f)]
by_name = {}
for f in files:
    by_name.setdefault(os.path.basename(f), []).append(f)
keep, stack = set(), [f for f in files if roots.search(f)]
while stack:
    f = stack.pop()
    if f not in keep:
        keep.add(f)
        out = subprocess.run(["readelf", "-d", f], capture_output=True, text=True).stdout
        stack += [g for n in re.findall(r"NEEDED.*\[(.*)\]", out) for g in by_name.get(n, [])]
for f in files:
    if f not in keep:
        os.remove(f)
EOF
}
case "$cmd" in
build)
  mkdir -p "$dir/wheels"
  work=$(mktemp -d)
  pipdl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"; }
  pipdl -d "$work" nixl==1.5.1 nixl-cu13==1.5.1 mooncake-transfer-engine-cuda13==0.3.14
  pipdl -d "$dir/wheels" cryptography cffi pycparser
  (cd "$dir" && apt-get download -q libibverbs1 librdmacm1 libnuma1 ibverbs-providers libnl-3-200 libnl-route-3-200 >/dev/null)
  # NIXL: the meta package's nixl/ beside the CUDA 13 build
  mkdir -p "$work/nixl/site" && (cd "$work/nixl/site" && for w in "$work"/nixl-*.whl "$work"/nixl_cu13-*.whl; do unzip -qo "$w"; done)
  n="$work/nixl/site"
  rm -rf "$n"/nixl_ep "$n"/nixl_ep_cu13 "$n"/nixl_cu13.scripts "$n"/nixl_cu13-*.data
  find "$n/.nixl_cu13.mesonpy.libs/plugins" "$n/nixl_cu13.libs/nixl" -type f ! -name libplugin_UCX.so -delete
  rm -f "$n"/nixl_cu13.libs/ucx/libucx_perftest* "$n"/nixl_cu13.libs/ucx/libuct_ib* "$n"/nixl_cu13.libs/ucx/*.la
  keep_closure "$n" '_bindings|_utils\.cpython|libplugin_UCX|/ucx/|lib(ucp|uct|ucs|ucm)-'
  tar -C "$n" -cJf "$dir/nixl-cu13-1.5.1.tar.xz" .
  # Mooncake: engine.so and what it loads
  mkdir -p "$work/mc/site" && (cd "$work/mc/site" && unzip -qo "$work"/mooncake_transfer_engine_cuda13-*.whl)
  m="$work/mc/site"
  rm -f "$m"/mooncake/mooncake_master "$m"/mooncake/mooncake_client "$m"/mooncake/transfer_engine_bench
  keep_closure "$m" 'mooncake/engine\.so|_fast_copy'
  tar -C "$m" -cJf "$dir/mooncake-cuda13-0.3.14.tar.xz" .
  rm -rf "$work"
  du -sh "$dir"/* >&2
  ;;
load)
  root=/tmp/gpu-nixl
  mkdir -p $root/site $root/libs
  for f in "$dir"/*.tar.xz; do tar -C $root/site -xJf "$f"; done
  for f in "$dir"/*.deb; do dpkg -x "$f" $root/libs; done
  if compgen -G "$dir/wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $root/site "$dir"/wheels/*.whl >&2
  fi
  cudart=$(python3 -c "import glob,os,site; print(':'.join(sorted({os.path.dirname(p) for sp in site.getsitepackages() for p in glob.glob(os.path.join(sp,'nvidia','**','libcudart.so.13*'),recursive=True)})))")
  echo "export PYTHONPATH=$root/site\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export LD_LIBRARY_PATH=$root/libs/usr/lib/x86_64-linux-gnu:$root/libs/lib/x86_64-linux-gnu:$cudart:/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  ;;
*)
  sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
