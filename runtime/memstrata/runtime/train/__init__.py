"""memstrata.runtime.train: the training entrypoints (the local run, the pod), the recipe and what it checks and
builds, over its rooms: checkpoints, model, data and observe (pyproject.toml's layers contract)."""
