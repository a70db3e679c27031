#!/bin/sh
# apt-get install inside an image build, with the host's apt configuration when the build was
# handed it (the secrets mounted under /run/pdfabric/apt by images/Containerfile), else the base
# image's own. Leaves no package lists, caches or documentation in the layer.
set -eu
conf=/run/pdfabric/apt
set --  --no-install-recommends "$@"
opts=""
parts=""
for f in "$conf/sources.list.d/host.sources" "$conf/sources.list.d/host.list"; do
  if [ -s "$f" ]; then parts=1; fi
done
if [ -n "$parts" ]; then
  # Only the handed-in sources: the base image's may point where this machine cannot reach.
  opts="$opts -o Dir::Etc::SourceParts=$conf/sources.list.d -o Dir::Etc::SourceList=/dev/null"
fi
if [ -s "$conf/apt.conf" ]; then export APT_CONFIG="$conf/apt.conf"; fi
if [ -s "$conf/auth.conf" ]; then opts="$opts -o Dir::Etc::netrc=$conf/auth.conf"; fi
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
apt-get $opts -qq update
# shellcheck disable=SC2086
apt-get $opts -qq -y \
  -o DPkg::Options::=--path-exclude=/usr/share/doc/* \
  -o DPkg::Options::=--path-exclude=/usr/share/man/* \
  -o DPkg::Options::=--path-exclude=/usr/share/info/* \
  -o DPkg::Options::=--path-exclude=/usr/share/locale/* \
  install "$@" >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
