# QEMU guest with a real Linux kernel, CXL memory and NVMe namespaces, for the
# kernel-level e2e tests (e2e/node/). QEMU 10 and Linux 6.12 come from
# bookworm-backports (bookworm's QEMU 7.2 has no volatile CXL expander); the
# root is a debootstrapped bookworm. Built once, cached by version; the build
# script's and initramfs init's hash is part of the key so a change rebuilds.
GUEST_QEMU_SERIES   := 10
GUEST_KERNEL_SERIES := 6.12
GUEST_BUILD := e2e/node/build
GUEST_BUILD_HASH := $(shell cat $(GUEST_BUILD)/build-guest.sh $(GUEST_BUILD)/initramfs-init | sha256sum | cut -c1-8)
MEMSTRATA_GUEST_DIR ?= $(CACHE)/guest-qemu$(GUEST_QEMU_SERIES)-linux$(GUEST_KERNEL_SERIES)-bookworm-$(GUEST_BUILD_HASH)
export MEMSTRATA_GUEST_DIR

.PHONY: guest test-guest
# Always runs the script: it returns at once when the cache is complete, but
# also makes sure QEMU 10 is installed on this host (the cache may be shared).
guest:
	@$(TIMED) guest $(GUEST_BUILD)/build-guest.sh $(MEMSTRATA_GUEST_DIR)

test-guest: install guest
	@$(PY) -m pytest e2e/node -m guest $(PYTEST_ARGS)

TEST_PREREQS += guest
