"""Checkpoints: the store on the volume, the ranks deciding together, and resuming from them."""
