"""A producer's models on the GPU it was pinned to, for tests/producer/test_models_gpu.py:
``python -m tests.producer.models_gpu_child FRAMEWORK MEMORY_MB`` runs one batch through a
ModelRunner, as a producer would, and prints one JSON line of what it used."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from stoker.producer.models import ModelRunner
from stoker.shared.batch import batch_dims, parse_model_fields

ROWS, FRAMES, N_MELS = 3, 64, 80
MODELS = {"torch": ("tests.producer.user_models_torch:speaker", "speaker_embedding:float32:64:0"),
          "jax": ("tests.producer.user_models_torch:jax_level", "score:float32:-:0")}


def main(framework: str, memory_mb: int) -> dict[str, object]:
    spec, fields = MODELS[framework]
    runner = ModelRunner(spec, parse_model_fields(fields, []), None, memory_mb)
    (model,) = runner.models
    rng = np.random.default_rng(0)
    mel = rng.standard_normal((ROWS, FRAMES, N_MELS)).astype(np.float32)
    lengths = np.array([FRAMES, 50, 33], np.int32)
    arrays = {"mel": mel, "mel_lengths": lengths, "ref_mel": mel, "ref_mel_lengths": lengths}
    out = runner.run(model, arrays, batch_dims(ROWS, (8, FRAMES), N_MELS), ROWS)
    report: dict[str, object] = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "framework": model.framework}
    if framework == "torch":
        import torch

        with torch.inference_mode():  # the same module, on the same device, called here
            direct = model.fn(ref_mel=torch.from_numpy(mel).cuda(), ref_mel_lengths=torch.from_numpy(lengths).cuda())
        report.update(device=str(next(model.fn.parameters()).device),
                      fraction=torch.cuda.get_per_process_memory_fraction(0),
                      total_mb=torch.cuda.get_device_properties(0).total_memory / 2 ** 20,
                      error=float(np.linalg.norm(out["speaker_embedding"] - direct["speaker_embedding"].cpu().numpy())
                                  / np.linalg.norm(out["speaker_embedding"])))
    else:
        import jax

        report.update(device=jax.devices()[0].platform, fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                      score=out["score"].tolist())
    return report


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1], int(sys.argv[2]))) + "\n")
