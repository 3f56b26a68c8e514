"""memstrata.runtime.swap: the DeepSpeed ZeRO-3 integration — the parameter and optimizer
swappers, sub-group order, DRAM gradients and I/O tokens, installed by `integration.initialize`."""
