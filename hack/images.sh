#!/usr/bin/env bash
# Builds the container images from images/Containerfile with podman or docker (whichever is
# present; podman from Debian's packages when neither is) and prints their references, one a line.
#
#   hack/images.sh [deps|build|refs] [TARGET...]     TARGETs: operator agent agent-cuda13
#                                                    (default: operator agent)
#
# deps   installs the container engine (and mmdebstrap/runc for podman) when missing
# build  (default) deps, then builds each target unless an image with the same inputs exists
# refs   prints the references `build` produces, builds nothing
#
# Environment:
#   PDFABRIC_CONTAINER_ENGINE  podman or docker (default: podman if present, else docker)
#   PDFABRIC_IMAGE_BASE        base image (e.g. debian:bookworm-slim); default: a bookworm
#                              root filesystem made with mmdebstrap and imported (nothing to pull),
#                              or the Containerfile's public default where mmdebstrap is not
#                              available (a host without apt)
#   PDFABRIC_IMAGE_PREFIX      name prefix of the images (default: pdfabric)
#   PDFABRIC_IMAGE_TAG         tag (default: the project version, the chart's appVersion)
#
# Caches live outside the repository under ${XDG_CACHE_HOME:-~/.cache}/pdfabric/images: the host's
# apt/pip configuration handed to the build as secrets, the build context. Built images carry a
# label with the hash of their inputs (the files copied into the context, the base image, the build
# arguments); an image whose label matches is not rebuilt. Podman's layer cache and the pip cache
# mount make a rebuild after a source change take seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${PDFABRIC_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric/images}"
cmd="${1:-build}"
case "$cmd" in deps | build | refs) shift || true ;; *) cmd=build ;; esac
targets=("$@")
((${#targets[@]})) || targets=(operator agent)

version="$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$root/pyproject.toml")"
prefix="${PDFABRIC_IMAGE_PREFIX:-pdfabric}"
tag="${PDFABRIC_IMAGE_TAG:-$version}"

ref_of() {
  case "$1" in
    operator) echo "$prefix/operator:$tag" ;;
    agent) echo "$prefix/agent:$tag" ;;
    agent-cuda13) echo "$prefix/agent:$tag-cuda13" ;;
    *) echo "unknown image target $1 (operator, agent, agent-cuda13)" >&2; return 2 ;;
  esac
}

if [[ $cmd == refs ]]; then
  for t in "${targets[@]}"; do ref_of "$t"; done
  exit 0
fi

log() { echo "images: $*" >&2; }
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO=sudo
apt_updated=""
apt_install() {
  local need=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
  done
  ((${#need[@]})) || return 0
  command -v apt-get >/dev/null || { log "need ${need[*]}: no apt-get here, install them yourself"; return 1; }
  log "installing Debian packages: ${need[*]}"
  [[ -n $apt_updated ]] || { $SUDO apt-get update -qq >&2; apt_updated=1; }
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
}

engine="${PDFABRIC_CONTAINER_ENGINE:-}"
if [[ -z $engine ]]; then
  if command -v podman >/dev/null; then engine=podman
  elif command -v docker >/dev/null; then engine=docker
  else engine=podman
  fi
fi
if [[ $engine == podman ]]; then
  # Debian's podman 4.3 runs containers here with runc and cgroupfs (images/containers.conf).
  apt_install podman runc uidmap >/dev/null || command -v podman >/dev/null
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$root/images/containers.conf}"
fi
command -v "$engine" >/dev/null || { log "no $engine"; exit 1; }
base="${PDFABRIC_IMAGE_BASE:-}"
if [[ -z $base ]] && command -v apt-get >/dev/null; then
  apt_install mmdebstrap >/dev/null
fi
[[ $cmd == deps ]] && exit 0

mkdir -p "$cache"
# --- the host's apt and pip configuration, handed to the build as secrets ----------------------
conf="$cache/hostconf"
rm -rf "$conf"
mkdir -m 700 -p "$conf"
: >"$conf/apt-sources"; : >"$conf/apt-list"; : >"$conf/apt-conf"; : >"$conf/apt-auth"
: >"$conf/pip-conf"; : >"$conf/pip-cert"
if [[ -d /etc/apt ]]; then
  for f in /etc/apt/sources.list.d/*.sources; do [[ -f $f ]] && { cat "$f"; echo; } >>"$conf/apt-sources"; done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do [[ -f $f ]] && cat "$f" >>"$conf/apt-list"; done
  # Acquire::* only (proxies, validity of a snapshot's Release files), not the host's hooks.
  command -v apt-config >/dev/null && apt-config dump Acquire >"$conf/apt-conf" 2>/dev/null || true
  for f in /etc/apt/auth.conf /etc/apt/auth.conf.d/*; do [[ -f $f ]] && cat "$f" >>"$conf/apt-auth"; done
fi
python3 - "$conf" <<'PY'
"""pip's configuration as this host's pip sees it (its config files, then PIP_* variables), as one
file for the build: a CA bundle it names goes along as the pip-cert secret, local paths are dropped."""
import configparser, os, shutil, sys
from pathlib import Path

conf = Path(sys.argv[1])
files = ["/etc/xdg/pip/pip.conf", "/etc/pip.conf", "~/.pip/pip.conf", "~/.config/pip/pip.conf"]
if os.environ.get("PIP_CONFIG_FILE"):
    files.append(os.environ["PIP_CONFIG_FILE"])
merged = configparser.ConfigParser(interpolation=None)
merged.read([os.path.expanduser(f) for f in files])
out = configparser.ConfigParser(interpolation=None)
for section in merged.sections():
    out[section] = dict(merged[section])
if not out.has_section("global"):
    out["global"] = {}
for name, value in os.environ.items():
    if name.startswith("PIP_") and name != "PIP_CONFIG_FILE":
        out["global"][name[4:].lower().replace("_", "-")] = value
for section in out.sections():
    for key in list(out[section]):
        value = out[section][key]
        if key == "cert":
            if os.path.isfile(value):
                shutil.copyfile(value, conf / "pip-cert")
                out[section][key] = "/run/secrets/pip-cert"
            else:
                del out[section][key]
        elif key in ("find-links", "client-cert", "log", "cache-dir", "src", "target", "prefix", "root"):
            kept = [v for v in value.split() if "://" in v]  # a host path does not exist in the build
            if kept and key == "find-links":
                out[section][key] = " ".join(kept)
            else:
                del out[section][key]
with open(conf / "pip-conf", "w") as fh:
    out.write(fh)
PY
chmod 600 "$conf"/*
secrets=()
for id in apt-sources apt-list apt-conf apt-auth pip-conf pip-cert; do
  secrets+=(--secret "id=$id,src=$conf/$id")
done

# --- the base image -----------------------------------------------------------------------------
if [[ -z $base ]] && command -v mmdebstrap >/dev/null; then
  # A minimal bookworm root filesystem from Debian's packages, from this host's apt sources; the
  # sources are not left in it (the image builds get them as secrets).
  # merged-usr by mmdebstrap's hook, not the usrmerge package (which would bring perl along).
  base_opts=(--variant=minbase --format=tar --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*'
    --customize-hook='rm -f "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/*'
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*')
  base_hash="$({ printf '%s\n' "${base_opts[@]}"; cat "$conf/apt-sources" "$conf/apt-list"; } | sha256sum | cut -c1-12)"
  base="$prefix/base:bookworm-$base_hash"
  if ! "$engine" image inspect "$base" >/dev/null 2>&1; then
    log "making the base image $base from Debian's packages (mmdebstrap)"
    started=$SECONDS
    src=()
    [[ -s $conf/apt-sources ]] && { cp "$conf/apt-sources" "$cache/base.sources"; src+=("$cache/base.sources"); }
    [[ -s $conf/apt-list ]] && { cp "$conf/apt-list" "$cache/base.list"; src+=("$cache/base.list"); }
    # No sources on this host: mmdebstrap's default Debian mirror.
    ((${#src[@]})) || src=(-)
    mmdebstrap -q "${base_opts[@]}" bookworm "$cache/base.tar" "${src[@]}" </dev/null >&2
    "$engine" import --change 'CMD ["/bin/bash"]' "$cache/base.tar" "$base" >/dev/null
    rm -f "$cache/base.tar" "$cache/base.sources" "$cache/base.list"
    log "base image made in $((SECONDS - started)) s"
  fi
fi
build_args=(--build-arg "VERSION=$version")
[[ -n $base ]] && build_args+=(--build-arg "BASE=$base")
revision="$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"

# --- the build context: the files the images are built from -----------------------------------
ctx="$cache/context"
rm -rf "$ctx"
mkdir -p "$ctx"
(
  cd "$root"
  paths=(pyproject.toml images core operator agent)
  [[ -d integrations ]] && paths+=(integrations)
  if git rev-parse --git-dir >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard -- "${paths[@]}"
  else
    find "${paths[@]}" -type f -not -path '*/__pycache__/*' -print0
  fi | while IFS= read -r -d '' f; do [[ -f $f ]] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -C "$ctx" -xf -
)
base_id="$("$engine" image inspect --format '{{.Id}}' "${base:-debian:bookworm-slim}" 2>/dev/null || echo "${base:-default}")"
inputs="$({
  cd "$ctx" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  echo "$base_id ${build_args[*]}"
} | sha256sum | cut -c1-16)"

build=()
if [[ $engine == docker ]]; then
  export DOCKER_BUILDKIT=1
  build=(docker build)
else
  build=(podman build --layers)
fi
for t in "${targets[@]}"; do
  ref="$(ref_of "$t")"
  have="$("$engine" image inspect --format '{{index .Config.Labels "dev.pdfabric.inputs"}}' "$ref" 2>/dev/null || true)"
  if [[ $have == "$inputs" ]]; then
    log "$ref is up to date (inputs $inputs)"
  else
    log "building $ref (target $t, inputs $inputs)"
    started=$SECONDS
    "${build[@]}" --network host -f "$ctx/images/Containerfile" --target "$t" -t "$ref" \
      "${build_args[@]}" --build-arg "REVISION=$revision" --label "dev.pdfabric.inputs=$inputs" \
      "${secrets[@]}" "$ctx" >&2
    log "built $ref in $((SECONDS - started)) s"
  fi
  echo "$ref"
done
