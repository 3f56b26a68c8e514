#!/usr/bin/env bash
# build.sh DIR — build Kueue's controller manager from its pinned module (e2e/kueue/build/kueue; version from
# mk/cluster.mk) into DIR/bin, and stage what the e2e tests install from the same release next to it: its CRDs
# and its webhook configurations (DIR/share/kueue). Idempotent: a finished build leaves DIR/bin/.built.
set -euo pipefail
: "${KUEUE_VERSION:?set by mk/cluster.mk}"
dir=${1:?usage: build.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
module=$here/kueue
mkdir -p "$dir/bin" "$dir/share/kueue"
dir=$(cd "$dir" && pwd)
export GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
have=$(cd "$module" && go list -m -f '{{.Version}}' sigs.k8s.io/kueue)
if [[ $have != "$KUEUE_VERSION" ]]; then
  echo "build.sh: $module/go.mod pins Kueue $have but mk/cluster.mk says $KUEUE_VERSION;" \
       "run: cd $module && go get sigs.k8s.io/kueue@$KUEUE_VERSION && go mod tidy" >&2
  exit 1
fi
rm -f "$dir/bin/.built"
echo "building kueue $KUEUE_VERSION"
(cd "$module" && go build -p "${BUILD_JOBS:-2}" -ldflags "-s -w" -o "$dir/bin/kueue" sigs.k8s.io/kueue/cmd/kueue)
src=$(cd "$module" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
[[ -d $src/config/components/crd/bases ]] || { echo "build.sh: Kueue $KUEUE_VERSION source not found" >&2; exit 1; }
cp "$src"/config/components/crd/bases/*.yaml "$src/config/components/webhook/manifests.yaml" "$dir/share/kueue/"
chmod -R u+w "$dir/share/kueue"
touch "$dir/bin/.built"
