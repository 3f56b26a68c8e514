"""The model: a Hugging Face causal LM in ZeRO-3 partitions, its LoRA adapters, its loss, and the export out."""
