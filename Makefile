# memstrata — the two commands are `make demo` and `make test`; both install
# what they need first (apt packages, a cached virtualenv with torch and a
# DeepSpeed whose ops are pre-built) and are safe to run again.
SHELL := /bin/bash
.DEFAULT_GOAL := help

CACHE ?= $(HOME)/.cache/memstrata
TORCH_VERSION := 2.13.0
DS_VERSION := 0.19.8
PYTHON_VERSION := $(shell python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Keyed by version: a new torch or DeepSpeed gets a new venv and new op builds.
VENV ?= $(CACHE)/venv-py$(PYTHON_VERSION)-torch$(TORCH_VERSION)-ds$(DS_VERSION)
PY := $(VENV)/bin/python
MEMSTRATA := $(VENV)/bin/memstrata
TIMED := scripts/timed
export CACHE VENV TORCH_VERSION DS_VERSION

# Debian packages: build deps of the native engine and DeepSpeed's async_io,
# fio as the storage ceiling, and the tools the loop-device tests use.
APT_PACKAGES := build-essential libaio-dev liburing-dev libnuma-dev fio numactl util-linux e2fsprogs gdisk xfsprogs btrfs-progs fdisk bc
APT_STAMP := $(CACHE)/stamps/apt-$(shell echo $(APT_PACKAGES) | sha256sum | cut -c1-12)
# Issue-owned fragments (real control plane, QEMU guest, ...) add their own
# targets and append prerequisites to TEST_PREREQS.
TEST_PREREQS :=
include $(sort $(wildcard mk/*.mk))

.PHONY: help demo demo-tiny test test-fast install deps crd lint clean-venv
help:
	@echo "make demo      — install, then fine-tune a real pretrained chat model (SmolLM2-135M-Instruct) on"
	@echo "                 examples/chat-skill.jsonl locally, with NVMe offload, and save it"
	@echo "make demo-tiny — the same path on a tiny random GPT and synthetic data (about a minute)"
	@echo "make test      — install, then run every test (unit, loop-device, real control plane, QEMU guest)"

$(APT_STAMP):
	@$(TIMED) apt scripts/apt-install $(APT_PACKAGES)
	@mkdir -p $(dir $@) && touch $@

deps: $(APT_STAMP)
	@$(TIMED) venv scripts/bootstrap-venv

# Always run: each script returns at once when its work is already done.
install: $(APT_STAMP)
	@$(TIMED) venv scripts/bootstrap-venv
	@$(TIMED) install scripts/install-editable

# Each demo run writes a new output directory (memstrata never overwrites a model).
DEMO_OUTPUT = $(CACHE)/demo-output/chat-skill-$(shell date +%Y%m%d-%H%M%S)
demo: install model
	@mkdir -p $(CACHE)/demo-output
	@$(TIMED) demo $(MEMSTRATA) run examples/finetune-chat.yaml --model $(MEMSTRATA_SMOLLM2_DIR) \
		--output $(DEMO_OUTPUT) --sample "What is the capital of Vosessa?"

demo-tiny: install
	@$(TIMED) demo-tiny $(MEMSTRATA) run examples/finetune-tiny.yaml

# Side by side (conftest.py says what shares a worker): most tests wait on a peer, so 4 workers on 2 cores (3 measured
# 1180 s, 4 1107 s, at a peak of 12.5 GiB of the 24 in use).
TEST_WORKERS ?= 4
test: install $(TEST_PREREQS)
	@$(TIMED) tests $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: install
	@$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

crd: install
	$(MEMSTRATA) crd > charts/memstrata/crds/finetunejob.yaml  # crds/finetunejob.yaml links to it

clean-venv:
	rm -rf $(VENV)
