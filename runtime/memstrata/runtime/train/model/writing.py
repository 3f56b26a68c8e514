"""Writing a trained model out, whatever trained: the whole model (export.save_model) or LoRA's adapter in PEFT
format (lora.save_adapter). Every rank calls it, because the writes gather the ZeRO-3 partitions; rank 0 alone
writes, and the others return None."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.jobstatus import OutputStatus
from memstrata.api.lora import Lora

if TYPE_CHECKING:
    import torch

__all__ = ["write_model"]


def write_model(module: Any, path: Path, *, adapter: Lora | None, leader: bool, tokenizer: Any | None,
                shard_size: int, step: int, dtype: "torch.dtype", validation_loss: float | None, job: str,
                job_uid: str, arch: ModelArchitecture, card: str = "") -> OutputStatus | None:
    """Write `module` (a ZeRO-3 engine's, of `arch`'s shape) to `path`, atomically; None on every rank but the
    leader."""
    from memstrata.runtime.train.model import lora
    from memstrata.runtime.train.model.export import join_save, save_model

    if adapter is not None:
        if not leader:
            lora.join_save(module, adapter, arch)
            return None
        return lora.save_adapter(module, path, lora=adapter, arch=arch, tokenizer=tokenizer, shard_size=shard_size,
                                 step=step, dtype=dtype, validation_loss=validation_loss, job=job, job_uid=job_uid,
                                 card=card)
    if not leader:
        join_save(module)
        return None
    return save_model(module, path, tokenizer=tokenizer, shard_size=shard_size, step=step, dtype=dtype,
                      validation_loss=validation_loss, job=job, job_uid=job_uid, card=card)
