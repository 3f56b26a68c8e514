"""An exported model, loaded as any Hugging Face user loads it, evaluated on its job's validation data:
`reload.py MODEL_DIR JOB.yaml [--cpu]` prints {"validation_loss": ...} (the mean over the validation batches, as the
engine's own evaluation takes it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from memstrata.api import load_job
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.runtime.train.data.pipeline import ByteTokenizer, build_data, load_tokenizer

    model_dir, job_path = Path(sys.argv[1]), Path(sys.argv[2])
    device = torch.device("cpu" if "--cpu" in sys.argv[3:] else "cuda")
    spec = with_model_shape(load_job(job_path).spec)
    arch = spec.model.shape()
    tokenizer = load_tokenizer(model_dir, arch.vocab) if (model_dir / "tokenizer.json").exists() else ByteTokenizer()
    batches = build_data(spec.dataset, spec.training, tokenizer).validation(spec.training.micro_batch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device).eval()
    with torch.no_grad():
        # As the run evaluated them: packed examples kept apart by their position ids.
        losses = [float(model(**b.model_inputs(device), use_cache=False).loss.float()) for b in batches]
    print(json.dumps({"validation_loss": sum(losses) / len(losses), "batches": len(losses)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
