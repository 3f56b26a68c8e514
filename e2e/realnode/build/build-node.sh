#!/usr/bin/env bash
# build-node.sh BIN_DIR — build the real node's kubelet and kube-proxy from the same pinned upstream
# module as the control plane (e2e/cluster/build/kubernetes; versions from mk/cluster.mk) into BIN_DIR.
# Called by `make node-bins`; the Go build cache makes it take seconds after the control plane's build.
set -euo pipefail
: "${K8S_VERSION:?}"
bin=${1:?usage: build-node.sh BIN_DIR}
here=$(cd "$(dirname "$0")" && pwd)
module=$here/../../cluster/build/kubernetes
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)
export GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
have=$(cd "$module" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
if [[ $have != "$K8S_VERSION" ]]; then
  echo "build-node.sh: $module/go.mod pins k8s.io/kubernetes $have but mk/cluster.mk says $K8S_VERSION; run 'make cluster-pin'" >&2
  exit 1
fi
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
pkg=k8s.io/component-base/version
# The kubelet reports this version in the Node's status; it must be the real release string.
ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
rm -f "$bin/.built"
for t in kubelet kube-proxy; do
  echo "building $t $K8S_VERSION"
  (cd "$module" && go build -p "${BUILD_JOBS:-2}" -ldflags "$ldflags" -o "$bin/$t" "k8s.io/kubernetes/cmd/$t")
done
"$bin/kubelet" --version
touch "$bin/.built"
