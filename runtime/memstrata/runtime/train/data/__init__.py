"""Training data: records, tokenizers, chat templates, packing and the order records are trained in."""
