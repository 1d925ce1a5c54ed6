"""``python run.py export RUN_DIR OUT``: the trained model, out of stoker, in standard formats.

OUT is a new directory, written beside it and renamed into place, so it is whole or absent
(the user's guide: docs/MODELS.md):

- ``saved_model/``: a TensorFlow SavedModel that plain TensorFlow loads without stoker
  (``tf.saved_model.load(OUT + "/saved_model")``); its ``serve`` endpoint (also
  ``serving_default``) is below;
- ``model.keras``: the Keras model (architecture and weights); loading it needs the model's code
  importable (the user's module, or stoker for a preset);
- ``vocab.json``: the run's vocabulary: token ids of the text front-end's symbols, and the
  language and speaker tables (docs/design/text.md);
- ``stoker.json``: what using the model needs besides: the model name, the checkpoint step, the
  log-mel settings (``features``, producer/features.py), the text settings, the batch fields and
  their padding, the endpoint's inputs.

``serve(tokens, token_lengths, frames[, speaker_id][, language_id][, ref_mel, ref_mel_lengths])``
runs the model once as ``synth`` does, without a generation loop::

    tokens          int32 [B, L]   token ids (vocab.json; EOS = 1 ends each row, PAD = 0 after)
    token_lengths   int32 [B]      valid tokens per row
    frames          int32 []       T, the frames to make (a model with a length head tells it:
                                   its log_frames output, exp and round)
    speaker_id ...  int32 [B]      present when the run switched those batch fields on

It returns ``mel`` float32 [B, T, F] (log-mel, producer/features.py) and, when the model has
one, ``log_frames`` float32 [B]. Batch fields the endpoint does not take (the targets: mel,
stop, audio, ...) are filled with their padding, as synth fills them. A model's own generation
loop (``generate``, docs/MODELS.md) is Python code around the model: it is not part of the
SavedModel; with the .keras file and the model's code it runs as in synth.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .synth import SynthError, one_batch, restore_model, run_config, run_vocabulary
from ...shared.config import batch_schema
from ...shared.errors import UserError
from ...shared.runfiles import MEL_STATS, VOCAB, write_json
from ...shared.text import EOS_ID, FIRST_SYMBOL_ID
from ...shared.tfsetup import configure_tensorflow
from ...shared.mel import pad_values

log = logging.getLogger(__name__)

SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
ABOUT_FILE = "stoker.json"
# The conditioning fields the endpoint takes as inputs when the run has them (others are padding).
INPUT_FIELDS = ("speaker_id", "language_id", "ref_mel", "ref_mel_lengths")


class ExportError(UserError):
    """The run cannot be exported as asked; one line for the user."""


@dataclass(frozen=True)
class ExportResult:
    out: Path
    step: int
    inputs: list[str]
    keras: bool


def export(run_dir: Path, out: Path) -> ExportResult:
    """Write the run's trained model to the new directory ``out`` (the module's docstring)."""
    out = out.expanduser()
    if out.exists():
        raise ExportError(f"{out} exists; export writes a new directory")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent} is not a directory")
    try:
        cfg = run_config(run_dir, "export")
        vocab = run_vocabulary(run_dir)
    except SynthError as exc:
        raise ExportError(str(exc)) from None
    schema = batch_schema(cfg)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the export's graphs are device-neutral

    tf, device = configure_tensorflow(None)
    pads = {**pad_values(schema, cfg.features, cfg.transforms.mel_norm), "tokens": vocab.padding_id}
    probe = one_batch(np.array([FIRST_SYMBOL_ID, EOS_ID], np.int32), cfg.batching.frames_multiple,
                      cfg.features.n_mels, pads, schema, hop_length=cfg.features.hop_length,
                      ref_frames=cfg.batching.ref_frames)
    try:
        model, found = restore_model(tf, device, run_dir, cfg, vocab.size, probe)
    except SynthError as exc:
        raise ExportError(str(exc)) from None
    step = int(found.name.split("-")[-1])
    inputs = ["tokens", "token_lengths", "frames", *(n for n in INPUT_FIELDS if n in schema.names)]
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_saved_model(tf, model, schema, cfg, pads, inputs, staging / SAVED_MODEL_DIR)
        keras_ok = _write_keras(model, staging / KERAS_FILE)
        write_json(staging / VOCAB, vocab.state_dict(), indent=1)
        write_json(staging / ABOUT_FILE, {
            "model": cfg.trainer.model, "step": step, "checkpoint": str(found), "run_dir": str(run_dir),
            "features": dataclasses.asdict(cfg.features), "text": dataclasses.asdict(cfg.text),
            "batch_fields": list(schema.names), "padding": pads, "endpoint": {"name": "serve", "inputs": inputs},
            "transforms": dataclasses.asdict(cfg.transforms), "mel_stats": _mel_stats(run_dir, cfg),
            "keras_file": KERAS_FILE if keras_ok else None})
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s (step %d) to %s", cfg.trainer.model, step, out)
    return ExportResult(out, step, inputs, keras_ok)


def _write_saved_model(tf: Any, model: Any, schema: Any, cfg: Any, pads: dict[str, float], inputs: list[str],
                       path: Path) -> None:
    """The SavedModel with the ``serve`` endpoint (the module's docstring), through Keras' ExportArchive,
    which tracks every variable of the model (also those a checkpoint misses)."""
    import keras

    n_mels, hop = cfg.features.n_mels, cfg.features.hop_length
    specs = {"tokens": tf.TensorSpec([None, None], tf.int32, name="tokens"),
             "token_lengths": tf.TensorSpec([None], tf.int32, name="token_lengths"),
             "frames": tf.TensorSpec([], tf.int32, name="frames"),
             "speaker_id": tf.TensorSpec([None], tf.int32, name="speaker_id"),
             "language_id": tf.TensorSpec([None], tf.int32, name="language_id"),
             "ref_mel": tf.TensorSpec([None, None, n_mels], tf.float32, name="ref_mel"),
             "ref_mel_lengths": tf.TensorSpec([None], tf.int32, name="ref_mel_lengths")}

    def serve(**given: Any) -> dict[str, Any]:
        tokens, frames = given["tokens"], given["frames"]
        rows, length = tf.shape(tokens)[0], tf.shape(tokens)[1]
        dims = {"B": rows, "L": length, "T": frames, "F": n_mels, "S": frames * hop,
                "R": tf.shape(given["ref_mel"])[1] if "ref_mel" in given else 1}
        batch = {}
        for field in schema.fields:
            if field.name in given:
                batch[field.name] = given[field.name]
            elif field.name == "mel_lengths":
                batch[field.name] = tf.fill([rows], frames)  # every row as long as asked
            elif field.name == "row_mask":
                batch[field.name] = tf.ones([rows], tf.float32)  # every row asked for is real
            else:
                shape = tf.stack([dims[d] for d in field.dims])
                batch[field.name] = tf.cast(tf.fill(shape, pads[field.name]), field.dtype)
        result = model(batch, training=False)
        out = result if isinstance(result, dict) else {"mel": result}
        exported = {"mel": tf.cast(out["mel"], tf.float32)}
        if "log_frames" in out:
            exported["log_frames"] = tf.cast(out["log_frames"], tf.float32)
        return exported

    signature = [specs[name] for name in inputs]

    def endpoint(*args: Any) -> dict[str, Any]:
        return serve(**dict(zip(inputs, args)))

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", tf.function(endpoint, input_signature=signature, autograph=False))
    archive.write_out(str(path), verbose=False)


def _mel_stats(run_dir: Path, cfg: Any) -> dict[str, Any] | None:
    """The mean and std the model's mels are normalised with (transforms.mel_norm), else None:
    ``mel * std + mean`` gives the log-mel of producer/features.py."""
    if cfg.transforms.mel_norm != "dataset":
        return None
    try:
        return json.loads((run_dir / MEL_STATS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"run {run_dir} trained on normalised mels but its {MEL_STATS} cannot be read: "
                          f"{exc}") from None


def _write_keras(model: Any, path: Path) -> bool:
    """The .keras file; False (logged) when the model cannot be saved in that format."""
    try:
        model.save(str(path))
    except Exception as exc:  # the user's model: its get_config may be missing or raise
        log.warning("model.keras not written: %s: %s (the SavedModel holds the model)", type(exc).__name__, exc)
        return False
    return True


def describe(result: ExportResult) -> str:
    """What the command line prints."""
    keras_note = f", {KERAS_FILE}" if result.keras else ""
    return (f"{result.out}: {SAVED_MODEL_DIR}/ (serve: {', '.join(result.inputs)} -> mel){keras_note}, {VOCAB}, "
            f"{ABOUT_FILE}; step {result.step}\n"
            f"load without stoker: tf.saved_model.load({json.dumps(str(result.out / SAVED_MODEL_DIR))}).serve(...)")
