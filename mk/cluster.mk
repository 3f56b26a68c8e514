# Real Kubernetes control plane for the e2e tests (no Docker here): the
# binaries are built from upstream Go modules once and cached by version.
# These variables are the ONE place the versions live; e2e/cluster/build/pin.sh
# regenerates the wrapper modules' go.mod/go.sum from them after a bump.
K8S_VERSION  := v1.36.4
# etcd 3.6 is the line Kubernetes 1.36 is tested against (>= 3.5.13 is required
# for the watch-progress requests that consistent reads use).
ETCD_VERSION := v3.6.16
# kwok v0.8.0 is built against client-go v0.36, hence Kubernetes 1.36.
KWOK_VERSION := v0.8.0
HELM_VERSION := v3.21.4
# The real node's containerd (mk/realnode.mk): 2.x, for CDI (DRA hands devices to containers through it).
CONTAINERD_VERSION := v2.2.9
# Kueue's controller (e2e/kueue): the release whose k8s.io modules are nearest the control plane's (v0.35).
KUEUE_VERSION := v0.17.0

CLUSTER_BUILD := e2e/cluster/build
MEMSTRATA_K8S_BIN := $(CACHE)/k8s-$(K8S_VERSION)-etcd$(ETCD_VERSION)-kwok$(KWOK_VERSION)-helm$(HELM_VERSION)/bin
CLUSTER_STAMP := $(MEMSTRATA_K8S_BIN)/.built
MEMSTRATA_KUEUE_DIR := $(CACHE)/kueue-$(KUEUE_VERSION)
export K8S_VERSION ETCD_VERSION KWOK_VERSION HELM_VERSION CONTAINERD_VERSION KUEUE_VERSION MEMSTRATA_K8S_BIN \
	MEMSTRATA_KUEUE_DIR

.PHONY: cluster-bins cluster-pin test-cluster kueue-bins
cluster-bins: $(CLUSTER_STAMP)
kueue-bins: $(MEMSTRATA_KUEUE_DIR)/bin/.built

# The directory name carries every version, so the stamp needs no file
# prerequisites: a fresh checkout (new mtimes) must not trigger a rebuild.
$(CLUSTER_STAMP):
	@$(TIMED) cluster-bins $(CLUSTER_BUILD)/build.sh $(MEMSTRATA_K8S_BIN)

$(MEMSTRATA_KUEUE_DIR)/bin/.built:
	@$(TIMED) kueue-bins e2e/kueue/build/build.sh $(MEMSTRATA_KUEUE_DIR)

# Regenerate e2e/cluster/build/*/go.mod and go.sum after changing a version above.
cluster-pin:
	$(CLUSTER_BUILD)/pin.sh

test-cluster: install cluster-bins kueue-bins
	@$(PY) -m pytest e2e -m cluster $(PYTEST_ARGS)

TEST_PREREQS += cluster-bins kueue-bins
