#!/usr/bin/env bash
# pin.sh — regenerate the wrapper modules' go.mod/go.sum from the versions in
# mk/cluster.mk (run through `make cluster-pin`). Needs the Go module proxy.
#
# Why wrapper modules: k8s.io/kubernetes and etcd's server module both carry
# replace directives in their own go.mod (staging modules, sibling modules),
# which Go ignores for dependencies, so `go install pkg@version` cannot build
# them. A wrapper module restates those replaces with published versions.
set -euo pipefail
: "${K8S_VERSION:?set by mk/cluster.mk}" "${ETCD_VERSION:?set by mk/cluster.mk}"
: "${KWOK_VERSION:?set by mk/cluster.mk}" "${HELM_VERSION:?set by mk/cluster.mk}"
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local GOFLAGS=-mod=mod

# Every k8s.io module Kubernetes keeps under staging/ is published as v0.X.Y
# alongside v1.X.Y; read the list from the release's own go.mod.
# kwok and helm are tools of the same module: they then link the very same
# k8s.io/api, client-go, ... packages, which are compiled once instead of three
# times (the bulk of a first build on 2 cores).
pin_kubernetes() {
  local dir=$here/kubernetes staging_version=v0.${K8S_VERSION#v1.}
  local staging
  staging=$(curl -fsSL "$(go env GOPROXY | cut -d, -f1)/k8s.io/kubernetes/@v/$K8S_VERSION.mod" |
    awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}')
  [[ -n $staging ]] || { echo "pin.sh: no staging modules found for k8s.io/kubernetes $K8S_VERSION" >&2; exit 1; }
  mkdir -p "$dir" && cd "$dir" && rm -f go.mod go.sum
  go mod init memstrata.dev/e2e/cluster/build/kubernetes >/dev/null 2>&1
  go mod edit -go=1.26.0
  go mod edit -require="k8s.io/kubernetes@$K8S_VERSION" \
    -require="sigs.k8s.io/kwok@$KWOK_VERSION" -require="helm.sh/helm/v3@$HELM_VERSION"
  for m in $staging; do go mod edit -replace="$m=$m@$staging_version"; done
  # kubelet and kube-proxy: the real node (mk/kubelet-node.mk) builds them from the same pins.
  for t in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
    go mod edit -tool="k8s.io/kubernetes/cmd/$t"
  done
  go mod edit -tool=sigs.k8s.io/kwok/cmd/kwok -tool=helm.sh/helm/v3/cmd/helm
  go mod tidy
}

# etcd's server/main.go is the etcd binary; its go.mod points the sibling
# modules (api, client/pkg, client/v3, pkg) at ../ paths.
pin_etcd() {
  local dir=$here/etcd
  mkdir -p "$dir" && cd "$dir" && rm -f go.mod go.sum
  go mod init memstrata.dev/e2e/cluster/build/etcd >/dev/null 2>&1
  go mod edit -go=1.26.0
  go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do
    go mod edit -replace="go.etcd.io/etcd/$m=go.etcd.io/etcd/$m@$ETCD_VERSION"
  done
  go mod edit -tool=go.etcd.io/etcd/server/v3
  go mod tidy
}

pin_kubernetes
pin_etcd
echo "pinned: kubernetes $K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION"
