"""Faults a test injects into every stoker process it starts: this directory first on the
processes' PYTHONPATH (:func:`fault_env`) and ``STOKER_TEST_FAULT`` naming the fault.

``swap-mels``: producers collate each batch with the mels of its first two clips swapped (each
mel with its length), so rows carry another clip's data under their own tokens and ids; every
exactly-once check that reads what the model trained must then fail.
"""

import os

if os.environ.get("STOKER_TEST_FAULT") == "swap-mels":
    from stoker.shared import batch as _batch

    _collate = _batch.collate

    def _swapping_collate(examples, dims, pads, schema=_batch.SCHEMA):
        examples = [dict(e) for e in examples]
        if len(examples) >= 2:
            examples[0]["mel"], examples[1]["mel"] = examples[1]["mel"], examples[0]["mel"]
        return _collate(examples, dims, pads, schema)

    _batch.collate = _swapping_collate
