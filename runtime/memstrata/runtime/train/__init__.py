"""memstrata.runtime.train: the training entrypoints (the local run, the pod), the recipe and what it checks and
builds, over its rooms: checkpoints, model, data and observe (pyproject.toml's layers contract).

Importing it sets TORCHDYNAMO_DISABLE=1 unless the environment already says otherwise: a process this package runs
compiles nothing (attention is sdpa; the update is DeepSpeed's CPU Adam or memstrata's own loop), yet DeepSpeed's
ZeRO sanity check imports its Muon module, whose kernel is `@torch.compile`d at import, and that loads torch's
inductor: 0.8 s of CPU at every rank's start. Only this package's own processes (`memstrata run`, the pod's
runtime): `memstrata.runtime.initialize`, the drop-in for `deepspeed.initialize`, leaves a user's torch.compile on.
torch.compile reads the variable at each call (a compiled function is then returned as it is)."""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
