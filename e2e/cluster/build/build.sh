#!/usr/bin/env bash
# build.sh BIN_DIR — build the real control plane's binaries from upstream Go
# modules into BIN_DIR (called by `make cluster-bins`; versions come from
# mk/cluster.mk). Idempotent: a finished build leaves BIN_DIR/.built.
#
# Everything is built through the wrapper modules next to this script (see
# pin.sh for why): etcd/ for etcd, kubernetes/ for kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok and helm.
set -euo pipefail
: "${K8S_VERSION:?}" "${ETCD_VERSION:?}" "${KWOK_VERSION:?}" "${HELM_VERSION:?}"
bin=${1:?usage: build.sh BIN_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)

# The Go toolchain installed on the machine builds everything; -p 2 keeps a
# 2-core machine responsive; -trimpath keeps the build cache path-independent.
export GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
jobs=${BUILD_JOBS:-2}

# The wrapper go.mod must agree with mk/cluster.mk, or the cache directory's
# name would lie about what is inside it.
require_pinned() {
  local dir=$1 module=$2 want=$3 have
  have=$(cd "$here/$dir" && go list -m -f '{{.Version}}' "$module")
  if [[ $have != "$want" ]]; then
    echo "build.sh: $here/$dir/go.mod pins $module $have but mk/cluster.mk says $want;" \
         "run 'make cluster-pin' after changing a version" >&2
    exit 1
  fi
}

build_kubernetes() {
  require_pinned kubernetes k8s.io/kubernetes "$K8S_VERSION"
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  # The servers report this version (kubectl version, /version, helm's
  # capability checks), so it must be the real release string.
  local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  local t
  for t in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    echo "building $t $K8S_VERSION"
    (cd "$here/kubernetes" && go build -p "$jobs" -ldflags "$ldflags" -o "$bin/$t" "k8s.io/kubernetes/cmd/$t")
  done
}

build_etcd() {
  require_pinned etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
  echo "building etcd $ETCD_VERSION"
  (cd "$here/etcd" && go build -p "$jobs" -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3)
}

build_kwok_helm() {
  require_pinned kubernetes sigs.k8s.io/kwok "$KWOK_VERSION"
  require_pinned kubernetes helm.sh/helm/v3 "$HELM_VERSION"
  echo "building kwok $KWOK_VERSION"
  (cd "$here/kubernetes" && go build -p "$jobs" -ldflags "-s -w" -o "$bin/kwok" sigs.k8s.io/kwok/cmd/kwok)
  echo "building helm $HELM_VERSION"
  # Without this helm reports only its minor ("v3.21").
  (cd "$here/kubernetes" && go build -p "$jobs" -o "$bin/helm" \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" helm.sh/helm/v3/cmd/helm)
}

# kwok reads its stages from Stage objects (--enable-crds=Stage) so tests can
# add their own at run time; the CRD and the default "fast" node/pod stages
# ship in kwok's module, next to the source that was just built.
stage_kwok_manifests() {
  local src share=$bin/../share/kwok
  src=$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $src/kustomize ]] || { echo "build.sh: kwok $KWOK_VERSION source not found" >&2; exit 1; }
  mkdir -p "$share"
  cp "$src/kustomize/crd/bases/kwok.x-k8s.io_stages.yaml" "$share/crd-stages.yaml"
  cp "$src/kustomize/stage/node/fast/node-initialize.yaml" \
     "$src/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
     "$src"/kustomize/stage/pod/fast/pod-{ready,complete,delete}.yaml "$share/"
  chmod -R u+w "$share"
}

rm -f "$bin/.built"
build_etcd
build_kubernetes
build_kwok_helm
stage_kwok_manifests
"$bin/kubectl" version --client
"$bin/etcd" --version | sed -n 1p  # not head: SIGPIPE under pipefail
"$bin/kwok" --version
"$bin/helm" version --short
touch "$bin/.built"
