#!/usr/bin/env bash
# build-containerd.sh BIN_DIR — build containerd, its runc shim and ctr from the pinned module
# (e2e/realnode/build/containerd; version from mk/realnode.mk) into BIN_DIR. Debian's containerd 1.6 has no
# CDI, which DRA needs to hand a container its devices; >= 2.0 has it on by default.
set -euo pipefail
: "${CONTAINERD_VERSION:?}"
bin=${1:?usage: build-containerd.sh BIN_DIR}
here=$(cd "$(dirname "$0")" && pwd)
module=$here/containerd
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)
export GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
have=$(cd "$module" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)
if [[ $have != "$CONTAINERD_VERSION" ]]; then
  echo "build-containerd.sh: $module/go.mod pins containerd $have but mk/realnode.mk says $CONTAINERD_VERSION;" \
       "run: cd $module && go get github.com/containerd/containerd/v2@$CONTAINERD_VERSION && go mod tidy" >&2
  exit 1
fi
# No btrfs/devmapper/zfs snapshotters (the node uses overlayfs; btrfs would need its headers).
tags="no_btrfs no_devmapper no_zfs"
ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
for c in containerd containerd-shim-runc-v2 ctr; do
  echo "building $c $CONTAINERD_VERSION"
  (cd "$module" && go build -p "${BUILD_JOBS:-2}" -tags "$tags" -ldflags "$ldflags" -o "$bin/$c" \
     "github.com/containerd/containerd/v2/cmd/$c")
done
"$bin/containerd" --version
