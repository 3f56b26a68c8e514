# A real node for the e2e tests in e2e/realnode: Debian's runc, CNI plugins and iptables; containerd
# (CDI, for DRA: Debian's 1.6 has none) built from its pinned module, and the kubelet and kube-proxy
# from the same pinned module as the control plane (mk/cluster.mk sets K8S_VERSION; this file is
# included after it; CONTAINERD_VERSION too). Cached by version.
NODE_APT_PACKAGES := runc containernetworking-plugins iptables conntrack
NODE_APT_STAMP := $(CACHE)/stamps/apt-node-$(shell echo $(NODE_APT_PACKAGES) | sha256sum | cut -c1-12)
MEMSTRATA_NODE_BIN := $(CACHE)/node-$(K8S_VERSION)-containerd$(CONTAINERD_VERSION)/bin
export MEMSTRATA_NODE_BIN

# memstrata's images, built from a debootstrapped base, the CI venv and the sources (no Docker, no
# registry; e2e/realnode/images.py); the e2e fixture imports them into the node's containerd.
IMAGE_APT_PACKAGES := debootstrap gcc libc6-dev
IMAGE_APT_STAMP := $(CACHE)/stamps/apt-images-$(shell echo $(IMAGE_APT_PACKAGES) | sha256sum | cut -c1-12)

.PHONY: node-bins node-images test-realnode
node-bins: $(NODE_APT_STAMP) $(MEMSTRATA_NODE_BIN)/.built

$(NODE_APT_STAMP):
	@$(TIMED) node-apt scripts/apt-install $(NODE_APT_PACKAGES)
	@mkdir -p $(dir $@) && touch $@

# Named by version, so a fresh checkout (new mtimes) does not rebuild.
$(MEMSTRATA_NODE_BIN)/.built:
	@$(TIMED) containerd-bins e2e/realnode/build/build-containerd.sh $(MEMSTRATA_NODE_BIN)
	@$(TIMED) node-bins e2e/realnode/build/build-node.sh $(MEMSTRATA_NODE_BIN)

$(IMAGE_APT_STAMP):
	@$(TIMED) images-apt scripts/apt-install $(IMAGE_APT_PACKAGES)
	@mkdir -p $(dir $@) && touch $@

# Always runs: seconds when every layer is cached (a source change rebuilds only memstrata's layers).
node-images: install $(IMAGE_APT_STAMP)
	@$(TIMED) node-images $(PY) -m e2e.realnode.images build --cache $(CACHE) --venv $(VENV) > /dev/null

test-realnode: install cluster-bins node-bins node-images
	@$(PY) -m pytest e2e/realnode -m realnode $(PYTEST_ARGS)

TEST_PREREQS += node-bins node-images
