"""The batch, declared once: every array a training batch carries, its dtype, its
dimensions, the dimensions that vary by bucket, and its padding value.

Producers collate by it (:func:`collate`), the coordinator checks every BATCH against it,
the trainer, validation and synth build and read batches by it. Its table and dimension
legend: docs/design/batches.md (printed by :meth:`BatchSchema.table`; a test keeps them equal).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .text import PAD_ID

LEGEND: dict[str, str] = {
    "B": "rows (batching.batch_size, or max_frames // T per bucket under a frame budget; fewer in the epoch's "
         "one short batch or when a clip is rejected: only real rows, unless rows are fixed (batching.fixed_rows, "
         "replicas, workers): then rows past the real examples are empty, length 0, row_mask 0)",
    "L": "token length of the bucket (padded)",
    "T": "mel frames of the bucket (padded)",
    "F": "mel channels (features.n_mels)",
    "S": "audio samples of the bucket (T x features.hop_length)",
    "R": "reference frames (batching.ref_frames; a longer reference is cropped around its middle)",
}
BUCKETED = ("L", "T")  # the dimensions a bucket fixes; the trainer traces once per (L, T)
# The log-mel's padding is the value of digital silence under the configured convention (0 when
# each clip is scaled to [0, 1]), known from the config: shared/mel.py mel_pad_value.
MEL_PAD = "silence (mel_pad_value)"


@dataclass(frozen=True)
class Field:
    """One array of a batch."""

    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str, ...]  # letters of LEGEND, B first
    pad: float | int | str  # padding value, or MEL_PAD
    description: str
    length_of: str = ""  # a length field: the field whose valid length (its dims[1]) it holds

    def shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(dim_size(d, dims) for d in self.dims)


def dim_size(dim: str, dims: Mapping[str, int]) -> int:
    """The size of one dimension of a field: a letter of LEGEND, a number (a model field's
    fixed size) or ``X/k`` (a model field's: X divided by k, rounded up)."""
    if dim in dims:
        return dims[dim]
    if dim.isdigit():
        return int(dim)
    base, _, k = dim.partition("/")
    return -(-dims[base] // int(k))


@dataclass(frozen=True)
class BatchSchema:
    fields: tuple[Field, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def data_fields(self) -> tuple[Field, ...]:
        """The fields a producer fills from examples (the length fields are derived)."""
        return tuple(f for f in self.fields if not f.length_of)

    @property
    def length_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.length_of)


    def shapes(self, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        return {f.name: f.shape(dims) for f in self.fields}

    def nbytes(self, dims: Mapping[str, int]) -> dict[str, int]:
        """Each field's bytes in a batch of shape ``dims``: what its arrays weigh on the wire."""
        return {f.name: math.prod(f.shape(dims)) * np.dtype(f.dtype).itemsize for f in self.fields}

    def check(self, arrays: Mapping[str, Any], dims: Mapping[str, int]) -> str:
        """Why ``arrays`` are not a batch of shape ``dims`` ("" when they are)."""
        if set(arrays) != set(self.names):
            return f"arrays {sorted(arrays)}, expected {sorted(self.names)}"
        for f in self.fields:
            array = arrays[f.name]
            if array.dtype.name != f.dtype or tuple(array.shape) != f.shape(dims):
                return (f"{f.name} is {array.dtype.name} {list(array.shape)}, expected {f.dtype} "
                        f"{list(f.shape(dims))}")
        return ""

    def check_rows(self, arrays: Mapping[str, np.ndarray], filled: int) -> str:
        """Why the first ``filled`` rows are not all real and the rest all empty ("" when they are)."""
        for f in self.length_fields:
            lengths = arrays[f.name]
            if np.any(lengths[:filled] <= 0) or np.any(lengths[filled:] != 0):
                return f"{f.name} does not match the {filled} clips delivered"
        if "row_mask" in arrays and (np.any(arrays["row_mask"][:filled] != 1) or np.any(arrays["row_mask"][filled:])):
            return f"row_mask does not match the {filled} clips delivered"
        if "clip" in arrays and (np.any(arrays["clip"][:filled] < 0) or np.any(arrays["clip"][filled:] != -1)):
            return f"clip does not match the {filled} clips delivered"
        return ""

    def table(self) -> str:
        """The markdown table of the design notes (array, dtype, shape, padding), then the
        legend of the dimensions its fields use, the bucketed ones marked."""
        rows = ["| array | dtype | shape | padding | what |", "|---|---|---|---|---|"]
        for f in self.fields:
            pad = "0 for empty rows" if f.length_of else str(f.pad)
            rows.append(f"| `{f.name}` | {f.dtype} | [{', '.join(f.dims)}] | {pad} | {f.description} |")
        used = {d for f in self.fields for d in f.dims}
        rows.append("")
        rows += [f"- {d}: {text}{' (bucketed)' if d in BUCKETED else ''}" for d, text in LEGEND.items() if d in used]
        return "\n".join(rows)


SCHEMA = BatchSchema((
    Field("tokens", "int32", ("B", "L"), PAD_ID, "token ids of the run's vocabulary (shared/vocab.py)"),
    Field("token_lengths", "int32", ("B",), 0, "valid tokens per row (EOS included)", length_of="tokens"),
    Field("mel", "float32", ("B", "T", "F"), MEL_PAD, "log-mel (producer/features.py)"),
    Field("mel_lengths", "int32", ("B",), 0, "valid frames per row", length_of="mel"),
))
# Fields a run switches on (``batching.fields``); the model receives them with the others.
OPTIONAL: dict[str, Field] = {f.name: f for f in (
    Field("speaker_id", "int32", ("B",), 0, "speaker id: position in vocab.json's speakers (optional)"),
    Field("language_id", "int32", ("B",), 0, "language id: position in vocab.json's languages (optional)"),
    Field("stop", "float32", ("B", "T"), 1.0, "stop target: 0 before the last valid frame, 1 from it on "
                                              "(optional)"),
    Field("audio", "float32", ("B", "S"), 0.0, "the waveform the mel was computed from, at features.sample_rate_hz "
                                               "(optional)"),
    Field("audio_lengths", "int32", ("B",), 0, "valid samples per row (with audio)", length_of="audio"),
    Field("ref_mel", "float32", ("B", "R", "F"), MEL_PAD, "log-mel of another clip of the same speaker, chosen "
                                                         "per epoch (optional)"),
    Field("ref_mel_lengths", "int32", ("B",), 0, "valid reference frames per row (with ref_mel)",
          length_of="ref_mel"),
    Field("row_mask", "float32", ("B",), 0.0, "1 for a real row, 0 for an empty one (optional; on whenever rows "
                                             "are fixed)"),
    Field("clip", "int32", ("B",), -1, "the row's clip: its position in the run's clip list (stoker.Feed's "
                                       "feed.clips), -1 on an empty row (optional)"),
)}
# A field switched on brings its length field with it.
COMPANIONS = {"audio": ("audio_lengths",), "ref_mel": ("ref_mel_lengths",)}


# Dimensions a declared field (transforms.fields) may have after B: per-clip sizes the producer knows.
DECLARABLE_DIMS = ("L", "T", "F")
DECLARABLE_DTYPES = ("float32", "int32")


def parse_declared_fields(spec: str) -> tuple[Field, ...]:
    """The batch fields a run's user transforms return, declared as ``name:dtype:DIMS:pad``,
    comma-separated (``durations:int32:L:0, pitch:float32:T:0``; DIMS letters after B, which is
    implied: ``T``, ``TF``, or ``-`` for one value per clip). ValueError (one line) when not."""
    fields = []
    taken = set(SCHEMA.names) | set(OPTIONAL)
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        parts = item.split(":")
        if len(parts) != 4:
            raise ValueError(f"declared field {item!r}: expected name:dtype:DIMS:pad, e.g. pitch:float32:T:0")
        name, dtype, dims, pad = (p.strip() for p in parts)
        letters = "" if dims == "-" else dims
        if not name.isidentifier() or name in taken:
            raise ValueError(f"declared field {item!r}: {name!r} is not a new identifier")
        if dtype not in DECLARABLE_DTYPES or any(d not in DECLARABLE_DIMS for d in letters):
            raise ValueError(f"declared field {item!r}: dtype one of {', '.join(DECLARABLE_DTYPES)}, dimensions "
                             f"letters of {', '.join(DECLARABLE_DIMS)} (or - for one value per clip)")
        try:
            value = float(pad)
        except ValueError:
            raise ValueError(f"declared field {item!r}: padding {pad!r} is not a number") from None
        taken.add(name)
        fields.append(Field(name, dtype, ("B", *letters), int(value) if dtype == "int32" else value,
                            "declared in transforms.fields, made by a user transform"))
    return tuple(fields)


# Dimensions a producer model's field (transforms.model_fields) may have after B: the batch's, a
# bucketed one divided (``T/4``: a code sequence at a quarter of the mel frame rate), a number.
MODEL_DIMS = ("L", "T", "F", "S", "R")
_MODEL_DIM = re.compile(r"[LTFSR]/[1-9][0-9]*|[1-9][0-9]*|[LTFSR]")


def parse_model_dims(text: str) -> tuple[str, ...]:
    """A model field's dimensions after B: space-separated (or run together) ``T``, ``T/4``,
    ``64``; ``-`` for one value per clip. ValueError (one line) when not."""
    text = text.strip()
    if text == "-":
        return ()
    dims, at = [], 0
    for match in _MODEL_DIM.finditer(text):
        if text[at:match.start()].strip():
            break
        dims.append(match.group(0))
        at = match.end()
    if not dims or text[at:].strip():
        raise ValueError(f"dimensions {text!r}: letters of {', '.join(MODEL_DIMS)}, X/k (e.g. T/4), numbers, "
                         f"space-separated, or - for one value per clip")
    return tuple(dims)


def parse_model_fields(spec: str, taken: Sequence[str] = ()) -> tuple[Field, ...]:
    """The batch fields a run's producer models return (transforms.model_fields), declared as
    ``name:dtype:DIMS:pad``, comma-separated (``codes:int32:T/4:-1, speaker_embedding:float32:64:0``);
    ``taken``: names already in the batch. ValueError (one line) when not."""
    fields = []
    used = set(SCHEMA.names) | set(OPTIONAL) | set(taken)
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        parts = item.split(":")
        if len(parts) != 4:
            raise ValueError(f"model field {item!r}: expected name:dtype:DIMS:pad, e.g. codes:int32:T/4:-1")
        name, dtype, dims, pad = (p.strip() for p in parts)
        if not name.isidentifier() or name in used:
            raise ValueError(f"model field {item!r}: {name!r} is not a new identifier")
        if dtype not in DECLARABLE_DTYPES:
            raise ValueError(f"model field {item!r}: dtype one of {', '.join(DECLARABLE_DTYPES)}")
        try:
            letters = parse_model_dims(dims)
        except ValueError as exc:
            raise ValueError(f"model field {item!r}: {exc}") from None
        try:
            value = float(pad)
        except ValueError:
            raise ValueError(f"model field {item!r}: padding {pad!r} is not a number") from None
        used.add(name)
        fields.append(Field(name, dtype, ("B", *letters), int(value) if dtype == "int32" else value,
                            "declared in transforms.model_fields, made by a producer model"))
    return tuple(fields)


def schema_for(fields: str | Sequence[str], declared: str = "", models: str = "") -> BatchSchema:
    """The batch of a run: SCHEMA plus the optional fields it switches on (comma-separated names),
    the fields its user transforms declare (:func:`parse_declared_fields`) and those its producer
    models return (:func:`parse_model_fields`)."""
    names = [n.strip() for n in fields.split(",")] if isinstance(fields, str) else list(fields)
    names = [n for n in names if n]
    switchable = [n for n in OPTIONAL if not OPTIONAL[n].length_of]
    unknown = [n for n in names if n not in switchable]
    if unknown:
        raise ValueError(f"unknown batch field {unknown[0]!r} (optional fields: {', '.join(switchable)})")
    names += [c for n in names for c in COMPANIONS.get(n, ())]
    transformed = parse_declared_fields(declared)
    return BatchSchema(SCHEMA.fields + tuple(OPTIONAL[n] for n in OPTIONAL if n in names) + transformed
                       + parse_model_fields(models, [f.name for f in transformed]))


def example(tokens: np.ndarray, mel: np.ndarray, schema: BatchSchema, speaker_id: int = 0,
            language_id: int = 0, audio: np.ndarray | None = None, ref_mel: np.ndarray | None = None,
            declared: Mapping[str, Any] | None = None, clip: int = -1) -> dict[str, Any]:
    """One clip's data fields for :func:`collate`, with the optional ones ``schema`` has
    (``audio``, ``ref_mel`` and the ``declared`` fields default to empty: all padding;
    ``clip``: its position in the run's clip list)."""
    out: dict[str, Any] = {"tokens": tokens, "mel": mel}
    for f in schema.data_fields:
        if f.name not in out and f.name not in OPTIONAL:  # a declared field: the transform's, else empty
            given = (declared or {}).get(f.name)
            out[f.name] = given if given is not None else (
                np.zeros((0,) * (len(f.dims) - 1), f.dtype) if len(f.dims) > 1 else np.array(f.pad, f.dtype))
    names = schema.names
    if "audio" in names:
        out["audio"] = np.zeros(0, np.float32) if audio is None else audio
    if "ref_mel" in names:
        out["ref_mel"] = np.zeros((0, mel.shape[1]), np.float32) if ref_mel is None else ref_mel
    if "speaker_id" in names:
        out["speaker_id"] = np.int32(speaker_id)
    if "language_id" in names:
        out["language_id"] = np.int32(language_id)
    if "row_mask" in names:
        out["row_mask"] = np.float32(1.0)
    if "clip" in names:
        out["clip"] = np.int32(clip)
    if "stop" in names:
        stop = np.zeros(len(mel), np.float32)
        stop[-1:] = 1.0
        out["stop"] = stop
    return out


# The length field the pipeline itself reads: valid frames per row (rows filled, frames trained).
FRAMES = "mel_lengths"


# The fields row_identities reads.
IDENTIFYING = ("tokens", "token_lengths", "mel", FRAMES)


def row_identities(arrays: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What identifies the clip of each real row of a batch, from its data rather than from a
    ledger of ids: its tokens, valid frames and the mean and mean magnitude of its valid mel
    (a trainer notes these inside its step; tests map them back to the clips they made)."""
    tokens, token_lengths = np.asarray(arrays["tokens"]), np.asarray(arrays["token_lengths"])
    mel, frames = np.asarray(arrays["mel"]), np.asarray(arrays[FRAMES])
    rows = []
    for row in range(len(token_lengths)):
        length, valid = int(token_lengths[row]), int(frames[row])
        if length == 0:
            continue  # an empty row of a batch with fixed rows
        values = mel[row, :valid].astype(np.float64)
        rows.append({"tokens": tokens[row, :length].tolist(), "frames": valid,
                     "mel_mean": float(values.mean()) if valid else 0.0,
                     "mel_abs": float(np.abs(values).mean()) if valid else 0.0})
    return rows


def batch_dims(batch_size: int, shape: Sequence[int], n_mels: int, hop_length: int = 0,
               ref_frames: int = 0) -> dict[str, int]:
    """The dimensions of a batch of a bucket ``shape`` = (L, T); S and R need ``hop_length``
    (features.hop_length) and ``ref_frames`` (batching.ref_frames) when the run has audio or
    ref_mel."""
    max_tokens, max_frames = shape
    return {"B": batch_size, "L": int(max_tokens), "T": int(max_frames), "F": n_mels,
            "S": int(max_frames) * hop_length, "R": ref_frames}


def collate(examples: Sequence[Mapping[str, np.ndarray]], dims: Mapping[str, int], pads: Mapping[str, float],
            schema: BatchSchema = SCHEMA) -> dict[str, np.ndarray]:
    """Pad ``examples`` into arrays of shape ``dims`` (shared/batch.py); raise if one does not fit."""
    size = dims["B"]
    if len(examples) > size:
        raise ValueError(f"{len(examples)} examples for a batch of {size}")
    out = {f.name: np.full(f.shape(dims), pads[f.name], dtype=f.dtype) for f in schema.fields}
    for row, example in enumerate(examples):
        for f in schema.data_fields:
            value = np.asarray(example[f.name])
            if value.size == 0 and value.ndim >= 1:
                continue  # an empty field (no audio, no reference): all padding
            bound = f.shape(dims)[1:]
            if value.ndim != len(bound) or any(n > b for n, b in zip(value.shape, bound)) \
                    or value.shape[1:] != bound[1:]:
                raise ValueError(f"example {f.name} of shape {list(value.shape)} exceeds the bucket {list(bound)}")
            out[f.name][(row, *(slice(0, n) for n in value.shape))] = value
        for f in schema.length_fields:
            out[f.name][row] = len(example[f.length_of])
    return out
