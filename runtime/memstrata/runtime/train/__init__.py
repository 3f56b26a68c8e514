"""memstrata.runtime.train: the training entrypoints — recipe, data, model, ds_config, the
local run, the pod entrypoint and progress reporting."""
