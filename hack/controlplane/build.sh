#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, helm) from Go modules into a cache outside the repository, keyed by the pins.
# Prints the bin directory on its last line. Rebuilds only when a pin or a go.mod/go.sum changes.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache_root="${PDFABRIC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfabric}"
key="$(cat "$here/versions.env" "$here/build.sh" "$here"/kube/go.{mod,sum} "$here"/etcd/go.{mod,sum} "$here"/etcd/main.go \
  | sha256sum | cut -c1-16)"
bin="$cache_root/controlplane-$key/bin"
tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

have_all() { for t in "${tools[@]}"; do [[ -x "$bin/$t" ]] || return 1; done; }
if have_all; then
  echo "control plane binaries up to date in $bin" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--buildvcs=false}"
step() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
start=$SECONDS

build_kube() {
  local name=$1
  [[ -x "$bin/$name" ]] && { step "$name: cached"; return; }
  step "$name: building k8s.io/kubernetes $KUBERNETES_VERSION"
  local minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
  (cd "$here/kube" && go build -trimpath -o "$bin/$name.tmp" \
    -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION \
      -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
      -X k8s.io/component-base/version.gitTreeState=clean" \
    "k8s.io/kubernetes/cmd/$name")
  mv "$bin/$name.tmp" "$bin/$name"
  step "$name: done ($((SECONDS - start)) s elapsed)"
}

if [[ ! -x "$bin/etcd" ]]; then
  step "etcd: building go.etcd.io/etcd/server/v3 $ETCD_VERSION"
  (cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" .)
  mv "$bin/etcd.tmp" "$bin/etcd"
  step "etcd: done ($((SECONDS - start)) s elapsed)"
fi
for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do build_kube "$name"; done

go_install() {
  local name=$1 pkg=$2
  [[ -x "$bin/$name" ]] && { step "$name: cached"; return; }
  step "$name: building $pkg"
  GOBIN="$bin" go install -trimpath -ldflags "-s -w" "$pkg"
  step "$name: done ($((SECONDS - start)) s elapsed)"
}
go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"

have_all || { echo "build finished but binaries are missing in $bin" >&2; exit 1; }
step "all control plane binaries built in $((SECONDS - start)) s"
echo "$bin"
