"""``python run.py synth RUN_DIR --text "..." --out mel.npy``: what the trained model produces.

Loads the run's resolved config and its latest checkpoint (model weights only), turns
the text into tokens with the run's own vocabulary and text front-end (the vocabulary
saved in the checkpoint, else ``RUN_DIR/vocab.json``; shared/text.py), chooses the number of frames T
from the model's length head (``log_frames``) unless ``--frames`` is given, and runs the
model once. A model with its own generation loop (a ``generate(inputs, max_frames)``
method, docs/MODELS.md) is run by that instead: it gets the text and conditioning fields
without a mel, at most ``--frames`` frames (default: a bound from the token count), and
its mel is trimmed to the length it returns. Writes the mel as float32 ``[T, F]`` (.npy) and an image of it (.png, low
frequencies at the bottom) beside it.

Runs in the calling process, on the CPU unless a GPU index is given (it is pinned with
``CUDA_VISIBLE_DEVICES`` before TensorFlow is imported).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import melimage, tts
from ..feed.checkpoint import CKPT_DIR, STATE_PREFIX, CheckpointError, Checkpointer
from ...producer.audio import AudioError, load_audio
from ...producer.features import MelComputer
from ...producer.transforms import Chain, TransformError
from ...shared import config as config_mod
from ...shared.batch import batch_dims, collate, example
from ...shared.errors import UserError
from ...shared.melstats import load, minmax
from ...shared.runfiles import CONFIG, MEL_STATS, VOCAB
from ...shared.text import TextError, make_frontend
from ...shared.tfsetup import configure_tensorflow
from ...shared.vocab import Vocabulary, load_vocabulary
from ...shared.mel import pad_values

log = logging.getLogger(__name__)

# A synthesized clip longer than this many frames is refused (a runaway length prediction):
# about 60 s at 22.05 kHz and a 256-sample hop.
MAX_FRAMES = 5000
# A model's own generation loop (a ``generate`` method) stops by itself; without --frames it
# may make at most this many frames per token plus this many (English speech runs at about
# 6 frames per character), capped at MAX_FRAMES.
GENERATE_FRAMES_PER_TOKEN = 10
GENERATE_EXTRA_FRAMES = 50
# The batch fields that hold the target, which a generation loop does not get.
TARGET_FIELDS = ("mel", "mel_lengths", "stop")


class SynthError(UserError):
    """Synthesis cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class SynthResult:
    mel_path: Path
    png_path: Path
    frames: int
    seconds: float
    checkpoint: str
    tokens: int


def run_config(run_dir: Path, what: str = "synthesize with") -> Any:
    """The resolved config of a run that trained a model; SynthError (one line) otherwise.
    A user's model module is found as in training (shared/userfn.py): on PYTHONPATH, then here."""
    cfg_path = run_dir / CONFIG
    if not cfg_path.is_file():
        raise SynthError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        cfg = config_mod.load(cfg_path)
    except config_mod.ConfigError as exc:
        raise SynthError(f"{cfg_path}: {exc}") from None
    spec = cfg.trainer.model
    kind = tts.check_spec(spec)
    if kind == "synthetic":
        raise SynthError(f"run {run_dir} trained the stand-in trainer {spec}, which has no model to {what}")
    return cfg


def restore_model(tf: Any, device: str, run_dir: Path, cfg: Any, vocab_size: int,
                  probe: dict[str, np.ndarray]) -> tuple[Any, Path]:
    """The run's model built and called once on ``probe`` (which creates its weights), then
    every weight restored from the latest checkpoint; and that checkpoint's directory."""
    spec = cfg.trainer.model
    ckpt_dir = run_dir / CKPT_DIR
    found = Checkpointer(ckpt_dir, keep=1).latest()
    if found is None:
        raise SynthError(f"no checkpoint in {ckpt_dir} (did the run stop before its first save?)")
    try:
        position = Checkpointer.verify(found)
    except CheckpointError as exc:
        raise SynthError(str(exc)) from None
    if "model" not in position.get("state", []):
        raise SynthError(f"checkpoint {found} holds no model weights")
    if "weights" not in position.get("state", []):
        raise SynthError(f"checkpoint {found} was written by an older stoker and misses some model weights; "
                         f"train on with --resume {run_dir} --steps N for a complete one")
    latest = str(found / STATE_PREFIX)
    with tf.device(device):
        model = tts.build(spec, vocab_size, cfg.features.n_mels)
        model(probe, training=False)  # creates the weights the checkpoint restores
        try:
            tf.train.Checkpoint(**tts.restorable(model)).read(latest).expect_partial() \
                .assert_existing_objects_matched()
        except (tf.errors.OpError, AssertionError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SynthError(f"checkpoint {latest} cannot be read for model {spec}: {first}") from None
    return model, found


def synthesize(run_dir: Path, text: str, out: Path, frames: int | None = None, gpu: int | None = None,
               language: str | None = None, speaker: str | None = None,
               reference: Path | None = None) -> SynthResult:
    """``reference``: a recording of the voice, for a run with the ref_mel field (without it the
    model gets no reference: ref_mel all padding, its length 0)."""
    cfg = run_config(run_dir)
    spec = cfg.trainer.model
    code = language or cfg.text.language
    tokens, vocab = encode_for_run(run_dir, cfg, text, code)
    schema = config_mod.batch_schema(cfg)
    ids = {"speaker_id": 0, "language_id": 0}
    if "speaker_id" in schema.names:
        if speaker is not None and speaker not in vocab.speakers:
            raise SynthError(f"--speaker {speaker!r} is not one of the run's speakers ({', '.join(vocab.speakers)})")
        ids["speaker_id"] = vocab.speaker_id(speaker) if speaker is not None else 0
    if "language_id" in schema.names:
        if code not in vocab.languages:
            raise SynthError(f"--language {code} is not one of the run's languages ({', '.join(vocab.languages)})")
        ids["language_id"] = vocab.language_id(code)
    if frames is not None and not 0 < frames <= MAX_FRAMES:
        raise SynthError(f"--frames must be between 1 and {MAX_FRAMES}")
    if reference is not None and "ref_mel" not in schema.names:
        raise SynthError("--reference needs a run trained with the ref_mel field (batching.fields=ref_mel)")
    ref_mel = reference_mel(run_dir, cfg, reference) if reference is not None else None
    os.environ["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)

    tf, device = configure_tensorflow(None)
    n_mels = cfg.features.n_mels
    pads = {**pad_values(schema, cfg.features, cfg.transforms.mel_norm), "tokens": vocab.padding_id}
    shapes = {"hop_length": cfg.features.hop_length, "ref_frames": cfg.batching.ref_frames, "ref_mel": ref_mel}
    probe = one_batch(tokens, cfg.batching.frames_multiple, n_mels, pads, schema, **ids, **shapes)
    model, found = restore_model(tf, device, run_dir, cfg, vocab.size, probe)
    with tf.device(device):
        generate = getattr(model, "generate", None)
        if callable(generate):
            limit = frames if frames is not None else generation_limit(len(tokens))
            mel = generated_mel(tf, generate, conditioning(probe), limit, spec)
            frames = len(mel)
        else:
            if frames is None:
                frames = predicted_frames(tts.outputs_of(model(probe, training=False)), spec)
            inputs = one_batch(tokens, frames, n_mels, pads, schema, **ids, **shapes)
            mel = np.asarray(tf.cast(tts.outputs_of(model(inputs, training=False))["mel"], tf.float32))[0]
    mel = denormalized(run_dir, cfg, mel)

    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    mel_path = out if out.suffix == ".npy" else out.with_suffix(out.suffix + ".npy")
    np.save(mel_path, mel.astype(np.float32))
    png_path = mel_path.with_suffix(".png")
    melimage.write_png(png_path, melimage.colorize(mel))
    seconds = frames * cfg.features.hop_length / cfg.features.sample_rate_hz
    return SynthResult(mel_path, png_path, frames, seconds, str(found), len(tokens))


def denormalized(run_dir: Path, cfg: Any, mel: np.ndarray) -> np.ndarray:
    """A mel the model made, in the feature definition's log-mel scale: a run that trained on
    normalised mels (transforms.mel_norm: dataset) has their statistics in its directory. Mels
    scaled per clip (clip_minmax) stay in [0, 1]: no clip's minimum and maximum are known."""
    if cfg.transforms.mel_norm != "dataset":
        return mel
    mean, std = _mel_stats(run_dir, cfg)
    return mel * std + mean


def generation_limit(tokens: int) -> int:
    """The most frames a model's own generation loop may make for ``tokens`` tokens (no --frames)."""
    return min(MAX_FRAMES, GENERATE_FRAMES_PER_TOKEN * tokens + GENERATE_EXTRA_FRAMES)


def conditioning(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a model's ``generate`` gets: the batch without the mel fields (there is no target)."""
    return {name: value for name, value in batch.items() if name not in TARGET_FIELDS}


def generated_mel(tf: Any, generate: Any, inputs: dict[str, np.ndarray], max_frames: int, spec: str) -> np.ndarray:
    """The first row of ``generate(inputs, max_frames)``, trimmed to its mel_lengths: float32 [T, F].

    SynthError (one line) when the result breaks the contract of docs/MODELS.md.
    """
    try:
        result = generate(inputs, max_frames)
    except Exception as exc:  # the user's code: report what it raised, in one line
        raise SynthError(f"model {spec}: generate() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, dict) or "mel" not in result or "mel_lengths" not in result:
        raise SynthError(f"model {spec}: generate() must return a dict with 'mel' [B, T, F] and 'mel_lengths' [B]; "
                         f"see docs/MODELS.md")
    mel = np.asarray(tf.cast(result["mel"], tf.float32))
    lengths = np.asarray(result["mel_lengths"])
    if mel.ndim != 3 or lengths.shape != (mel.shape[0],) or mel.shape[0] < 1:
        raise SynthError(f"model {spec}: generate() returned mel {list(mel.shape)} and mel_lengths "
                         f"{list(lengths.shape)}; expected [B, T, F] and [B]")
    length = int(lengths[0])
    if not 0 < length <= min(mel.shape[1], max_frames):
        raise SynthError(f"model {spec}: generate() made {length} frames (of at most {max_frames}, "
                         f"{mel.shape[1]} returned)")
    return mel[0, :length]


def predicted_frames(out: dict[str, Any], spec: str) -> int:
    """T from the model's length head (``log_frames``); SynthError when it has none or it is unusable."""
    if "log_frames" not in out:
        raise SynthError(f"model {spec} predicts no length (no 'log_frames' output): pass --frames N")
    predicted = float(out["log_frames"][0])
    if not math.isfinite(predicted) or math.exp(min(predicted, 50.0)) > MAX_FRAMES:
        raise SynthError(f"the model predicts an unusable length (log frames {predicted:.2f}); pass --frames N")
    return max(1, int(round(math.exp(predicted))))


def run_vocabulary(run_dir: Path) -> Any:
    """The vocabulary a run trained with: its newest checkpoint's, else ``RUN_DIR/vocab.json``."""
    found = Checkpointer(run_dir / CKPT_DIR, keep=1).latest()
    if found is not None:
        try:
            saved = Checkpointer.verify(found)
        except CheckpointError as exc:
            raise SynthError(str(exc)) from None
        if "vocabulary" in saved:
            try:
                return Vocabulary.from_state_dict(saved["vocabulary"])
            except ValueError as exc:
                raise SynthError(f"checkpoint {found}: {exc}") from None
    try:
        return load_vocabulary(run_dir / VOCAB)
    except TextError as exc:
        raise SynthError(str(exc)) from None


def encode_for_run(run_dir: Path, cfg: Any, text: str, language: str) -> tuple[np.ndarray, Any]:
    """Token ids [L] of ``text`` as the run's front-end and vocabulary make them, and the vocabulary.

    SynthError (one line) when the front-end changed since the run, the text has
    characters the vocabulary lacks or loses characters, or nothing is left to say.
    """
    vocab = run_vocabulary(run_dir)
    try:
        frontend = make_frontend(vocab.frontend, cfg.text.digits)
        problem = vocab.check_engine(frontend)
        if problem:
            raise SynthError(f"cannot tokenize as run {run_dir} did: {problem}")
        made = frontend.units([text], language)[0]
    except TextError as exc:
        raise SynthError(str(exc)) from None
    lacking = made.lost + vocab.missing(made.units)
    if lacking:
        shown = ", ".join(f"{ch!r} U+{ord(ch):04X}" for ch in dict.fromkeys(lacking))
        raise SynthError(f"--text has characters the run's {vocab.frontend} vocabulary cannot represent: {shown}")
    tokens = vocab.encode(made.units)
    if frontend.count(made.units) == 0 or (not vocab.is_user and len(tokens) <= 1):
        raise SynthError("--text has nothing to say after normalisation")
    return tokens, vocab


def reference_mel(run_dir: Path, cfg: Any, path: Path) -> np.ndarray:
    """The ref_mel of a recording, made as producers make a reference clip's: read at the run's
    rate, through its transforms, the log-mel, at most batching.ref_frames frames from its
    middle, normalised when the run normalised its mels. SynthError (one line) when unusable."""
    try:
        audio = load_audio(Path(path).expanduser(), cfg.features.sample_rate_hz, str(path))
        chain = Chain(cfg.transforms, cfg.features)
        audio = chain(audio, "", Path(path).stem, 0, 0, {}).audio
        mels = MelComputer(dataclasses.replace(cfg.features, backend="numpy"), weights=chain.weights)
        mel = chain.finish([audio], mels, keep_audio=False)[0].mel if chain.measures else mels([audio])[0]
    except (AudioError, TransformError, ValueError) as exc:
        raise SynthError(f"--reference {path}: {exc}") from None
    start = max(0, (len(mel) - cfg.batching.ref_frames) // 2)
    mel = mel[start:start + cfg.batching.ref_frames]
    if cfg.transforms.mel_norm == "dataset":
        mean, std = _mel_stats(run_dir, cfg)
        mel = (mel - mean) / std
    elif cfg.transforms.mel_norm == "clip_minmax":

        mel = np.array(mel, np.float32)
        minmax(mel[None], np.array([len(mel)]))
    return mel.astype(np.float32)


def _mel_stats(run_dir: Path, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """The mean and std a run normalised its mels with (transforms.mel_norm: dataset)."""
    try:
        return load(json.loads((run_dir / MEL_STATS).read_text(encoding="utf-8")), cfg.features.n_mels)
    except (OSError, ValueError) as exc:
        raise SynthError(f"run {run_dir} trained on normalised mels but its {MEL_STATS} cannot be read: "
                         f"{exc}") from None


def one_batch(tokens: np.ndarray, frames: int, n_mels: int, pads: dict[str, float], schema: Any,
              speaker_id: int = 0, language_id: int = 0, hop_length: int = 0, ref_frames: int = 0,
              ref_mel: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A batch of one row (shared/batch.py): the text's tokens, ``frames`` frames of padding for
    the mel; no waveform, and the reference ``ref_mel`` or none (length 0), when the run has
    those fields (``hop_length`` and ``ref_frames`` give their shapes)."""
    row = example(tokens, np.full((frames, n_mels), pads["mel"], np.float32), schema, speaker_id, language_id,
                  ref_mel=ref_mel)
    return collate([row], batch_dims(1, (len(tokens), frames), n_mels, hop_length, ref_frames), pads, schema)
