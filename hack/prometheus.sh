#!/usr/bin/env bash
# Fetches Debian's prometheus package and unpacks it into a cache outside the repository (no
# service is installed or started). Prints the directory holding `prometheus` and `promtool`.
set -euo pipefail
cache_root="${PDFABRIC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric}"
dir="$cache_root/prometheus"
# One fetch at a time (parallel test workers): the others wait for it, then find it unpacked.
mkdir -p "$cache_root"
exec 9>"$cache_root/.prometheus.lock"
flock 9
if [[ -x "$dir/usr/bin/prometheus" ]]; then echo "$dir/usr/bin"; exit 0; fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download -q prometheus >/dev/null 2>&1; then
  apt-get update -qq >/dev/null 2>&1 || true
  apt-get download -q prometheus >/dev/null
fi
mkdir -p "$dir"
dpkg -x prometheus_*.deb "$dir"
"$dir/usr/bin/prometheus" --version >&2
echo "$dir/usr/bin"
