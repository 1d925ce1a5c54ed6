"""What the model trained, checked against the clips a test made: the one exactly-once checker.

Each row a training step received is noted inside that step from its data (shared/batch.py
``row_identities``: stoker's trainer writes them to trained.jsonl with --record-samples; a loop on
stoker.Feed notes them with :class:`Recorder`). A row is the clip its tokens name (the run's own
vocabulary and text front-end applied to the dataset's texts) only if its valid frames are that
clip's and, where this process can compute the clip's log-mel from its local audio, its mel is
too. Then every expected clip is trained once in each epoch, and no row is anything else. The
feed's own ledger (samples.jsonl) is never read here: a producer that put one clip's mel under
another clip's tokens fails, whatever ids the feed handed out.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from stoker.shared import config as config_mod
from stoker.shared.batch import IDENTIFYING, row_identities
from stoker.shared.runfiles import CONFIG, TRAINED, VOCAB
from tests.procs import read_jsonl

FAULTS = Path(__file__).resolve().parent / "faults"
# A mel computed here agrees with a producer's (another backend, the feature cache's uint16
# store) to about 1e-4; another clip's, even at the same length, is off by orders more.
MEL_TOLERANCE = 5e-3


@dataclass(frozen=True)
class Clip:
    """What identifies one clip of a run's dataset."""

    id: str
    tokens: tuple[int, ...]
    frames: int
    mel: tuple[float, float] | None  # mean and mean magnitude of its valid log-mel, where computed here


class Recorder:
    """A Feed loop's record of what its steps trained: :meth:`note` each batch inside the step;
    :meth:`rewind` to a state's step when the loop resumes from it (what came after is undone)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def note(self, batch: Mapping[str, Any], epoch: int | None) -> None:
        """The rows of ``batch`` (arrays, tensors, or per-replica values), trained in ``epoch``."""
        arrays = {k: _on_host(batch[k]) for k in IDENTIFYING}
        self.steps.append({"step": len(self.steps) + 1, "epoch": epoch, "rows": row_identities(arrays)})

    def rewind(self, step: int) -> None:
        del self.steps[step:]


def _on_host(value: Any) -> np.ndarray:
    parts = getattr(value, "values", None)  # a replicated batch: one part per replica, rows in order
    if isinstance(parts, tuple):
        return np.concatenate([_on_host(p) for p in parts])
    if hasattr(value, "detach"):  # a PyTorch tensor, on any device
        return value.detach().cpu().numpy()
    return np.asarray(value)


def clips_of(run_dir: Path) -> dict[str, Clip]:
    """Every clip of the run's dataset (its config.yaml and vocab.json), with its tokens, its
    frames and, for a local dataset whose mel is stoker's own with no transform, its mel."""
    from stoker.producer.audio import AudioError, load_audio
    from stoker.producer.features import log_mel_spectrogram_numpy
    from stoker.shared.dataset.files import DEMO_DATA_DIR
    from stoker.consumer.index.index import build_index
    from stoker.shared.dataset.corpus.address import File, address_of
    from stoker.shared.dataset.files import audio_path
    from stoker.shared.vocab import load_vocabulary

    cfg = config_mod.load(run_dir / CONFIG)
    vocab = load_vocabulary(run_dir / VOCAB)
    index = build_index(cfg.data, cfg.features, cfg.text, vocab)
    t = cfg.transforms  # the waveform and the mel as the producer left them: stoker's own, untouched
    plain = not (t.user or t.trim_db or t.normalize != "off" or t.preemphasis or t.mel_norm != "off"
                 or cfg.features.user)
    local = "://" not in cfg.data.path
    root = Path(cfg.data.path) if cfg.data.path else Path(DEMO_DATA_DIR)
    if root.is_file():  # a manifest: its audio paths are relative to its directory
        root = root.parent
    clips = {}
    for s in index.samples:
        mel = None
        address = address_of(s.audio) if s.audio else None  # a file, a window of one (a lhotse cut), or a member
        span = address.span if isinstance(address, File) else None
        path = audio_path(root, s.id, address.path if isinstance(address, File) else s.audio)
        if plain and local and path.is_file():
            try:
                audio = load_audio(path, cfg.features.sample_rate_hz, span=span)
            except AudioError:  # a clip the producers reject too: never trained
                audio = None
            if audio is not None:
                values = log_mel_spectrogram_numpy(audio, cfg.features).astype(np.float64)
                mel = (float(values.mean()), float(np.abs(values).mean()))
        clips[s.id] = Clip(s.id, tuple(vocab.encode(s.units).tolist()), s.num_frames, mel)
    return clips


def identify(rows: Iterable[Mapping[str, Any]], clips: Mapping[str, Clip]) -> list[str]:
    """The clip of each trained row (clips the test made alike, which no data tells apart, as
    their ids joined by "="); AssertionError naming the row when its data is no clip's or not
    the clip its tokens name."""
    by_tokens = _by_tokens(clips)
    out = []
    for n, row in enumerate(rows):
        named = by_tokens.get(tuple(row["tokens"]), [])
        assert named, f"row {n}: its tokens are no clip's of the dataset: {row['tokens'][:12]}..."
        fitting = [c for c in named if c.frames == row["frames"] and _same_mel(c.mel, (row["mel_mean"], row["mel_abs"]))]
        assert fitting, (f"row {n}: tokens of {[c.id for c in named]}, but its mel is not theirs "
                         f"(frames {row['frames']} vs {[c.frames for c in named]}, mean and magnitude "
                         f"{row['mel_mean']:.5f}, {row['mel_abs']:.5f} vs {[c.mel for c in named]})")
        out.append("=".join(sorted(c.id for c in fitting)))
    return out


def _by_tokens(clips: Mapping[str, Clip]) -> dict[tuple[int, ...], list[Clip]]:
    by_tokens: dict[tuple[int, ...], list[Clip]] = collections.defaultdict(list)
    for clip in clips.values():
        by_tokens[clip.tokens].append(clip)
    return by_tokens


def _same_mel(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    if a is None or b is None:
        return True
    return abs(a[0] - b[0]) <= MEL_TOLERANCE and abs(a[1] - b[1]) <= MEL_TOLERANCE


def _alike(clips: Mapping[str, Clip], ids: Iterable[str]) -> collections.Counter[str]:
    """How many rows of each identity one pass over ``ids`` trains (identify's names)."""
    by_tokens = _by_tokens(clips)
    counts: collections.Counter[str] = collections.Counter()
    for i in ids:
        clip = clips[i]
        counts["=".join(sorted(c.id for c in by_tokens[clip.tokens]
                               if c.frames == clip.frames and _same_mel(c.mel, clip.mel)))] += 1
    return counts


def trained_steps(*run_dirs: Path) -> list[dict[str, Any]]:
    """The trained.jsonl rows of one run directory, or of the workers' of one job."""
    steps = [row for run_dir in run_dirs for row in read_jsonl(run_dir / TRAINED)]
    assert steps, f"no trained.jsonl rows in {[str(d) for d in run_dirs]} (a run with --record-samples?)"
    return steps


def check_trained(steps: Iterable[Mapping[str, Any]], clips: Mapping[str, Clip], epochs: int,
                  expected: Iterable[str], open_epochs: int = 0) -> dict[int, collections.Counter[str]]:
    """Every row of ``steps`` (trained.jsonl or a Recorder's) is the clip its tokens name, and
    each epoch of ``range(epochs)`` trained each ``expected`` clip once and nothing else (the last
    ``open_epochs`` of them, of an interrupted run, only nothing twice); the counts per epoch,
    by identify's names."""
    expected = set(expected)
    assert expected <= set(clips), f"the test's clips {sorted(expected - set(clips))[:5]} are not in the index"
    want = _alike(clips, expected)
    per_epoch: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for step in steps:
        per_epoch[step["epoch"]].update(identify(step["rows"], clips))
    assert sorted(per_epoch) == list(range(epochs)), f"epochs trained: {sorted(per_epoch)}"
    for epoch, counts in per_epoch.items():
        unexpected = sorted(set(counts) - set(want))
        assert not unexpected, f"epoch {epoch}: not expected {unexpected[:5]}"
        twice = sorted(k for k in counts if counts[k] > want[k])
        assert not twice, f"epoch {epoch}: trained more than once: {twice[:5]}"
        missing = sorted(k for k in want if counts[k] < want[k])
        assert not missing or epoch >= epochs - open_epochs, f"epoch {epoch}: missing {missing[:5]}"
    return per_epoch


def check_run(run_dir: Path, epochs: int, expected: Iterable[str], *more_dirs: Path,
              open_epochs: int = 0) -> dict[int, collections.Counter[str]]:
    """:func:`check_trained` on what stoker's trainer noted in a run directory (and in the other
    workers' of one job)."""
    return check_trained(trained_steps(run_dir, *more_dirs), clips_of(run_dir), epochs, expected, open_epochs)


def fault_env(fault: str) -> dict[str, str]:
    """The environment of processes that carry ``fault`` (tests/faults/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "STOKER_TEST_FAULT": fault}
