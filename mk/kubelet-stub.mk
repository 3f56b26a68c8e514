# The kubelet's side of the device-plugin API, for tests/nodeagent: a small Go
# program over the upstream k8s.io/kubelet v1beta1 stubs (e2e/kubelet). Built
# once per kubelet version and source hash, cached like the other real peers.
KUBELET_API_VERSION := $(shell sed -n 's/^[[:space:]]*k8s.io\/kubelet \(v[^ ]*\).*/\1/p' e2e/kubelet/go.mod)
KUBELET_STUB_SRC_HASH := $(shell cat e2e/kubelet/go.mod e2e/kubelet/go.sum e2e/kubelet/*.go | sha256sum | cut -c1-8)
MEMSTRATA_KUBELET_STUB := $(CACHE)/kubelet-stub-$(KUBELET_API_VERSION)-$(KUBELET_STUB_SRC_HASH)/kubelet-stub
export MEMSTRATA_KUBELET_STUB

.PHONY: kubelet-stub
kubelet-stub: $(MEMSTRATA_KUBELET_STUB)

# Named by version and source hash, so a fresh checkout (new mtimes) does not rebuild.
$(MEMSTRATA_KUBELET_STUB):
	@mkdir -p $(dir $@)
	@$(TIMED) kubelet-stub bash -c 'cd e2e/kubelet && go build -trimpath -o $@.tmp . && mv $@.tmp $@'

TEST_PREREQS += kubelet-stub
