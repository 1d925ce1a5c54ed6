"""The exactly-once checker (tests/trained.py) fails where the model trained the wrong thing: a
row whose data is another clip's, a clip lost or trained twice; and on a real run whose producers
swap two clips' mels in every batch (tests/faults/sitecustomize.py), while the feed's own ledger of
ids (samples.jsonl) still says every clip was trained once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from stoker.shared.batch import row_identities
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import DEMO_DATA_DIR
from tests.procs import read_jsonl, run_cli
from tests.trained import Clip, check_run, check_trained, fault_env, identify

CLIPS = {"a": Clip("a", (5, 6, 1), 3, (-1.0, 1.0)), "b": Clip("b", (7, 1), 2, (-2.0, 2.0)),
         "c": Clip("c", (8, 9, 1), 3, None)}


def batch_of(*rows: tuple[tuple[int, ...], np.ndarray]) -> dict[str, np.ndarray]:
    """A padded batch of (tokens, mel) rows."""
    length, frames = max(len(t) for t, _ in rows), max(len(m) for _, m in rows)
    out = {"tokens": np.zeros((len(rows), length), np.int32), "token_lengths": np.zeros(len(rows), np.int32),
           "mel": np.full((len(rows), frames, 2), -11.5, np.float32), "mel_lengths": np.zeros(len(rows), np.int32)}
    for i, (tokens, mel) in enumerate(rows):
        out["tokens"][i, :len(tokens)] = tokens
        out["token_lengths"][i] = len(tokens)
        out["mel"][i, :len(mel)] = mel
        out["mel_lengths"][i] = len(mel)
    return out


def mel(value: float, frames: int) -> np.ndarray:
    return np.full((frames, 2), value, np.float32)


def test_each_row_is_the_clip_its_tokens_mel_and_frames_say():
    rows = row_identities(batch_of(((5, 6, 1), mel(-1.0, 3)), ((7, 1), mel(-2.0, 2)), ((8, 9, 1), mel(4.0, 3))))
    assert identify(rows, CLIPS) == ["a", "b", "c"]


@pytest.mark.parametrize(("tokens", "values", "says"), [
    ((5, 6, 1), mel(-2.0, 3), "its mel is not theirs"),  # b's mel under a's tokens, at a's length
    ((5, 6, 1), mel(-1.0, 2), "its mel is not theirs"),  # a's mel values at b's length
    ((5, 6, 2), mel(-1.0, 3), "no clip's"),  # tokens of no clip
], ids=["another-mel", "another-length", "unknown-tokens"])
def test_a_row_with_another_clips_data_fails(tokens, values, says):
    with pytest.raises(AssertionError, match=says):
        identify(row_identities(batch_of((tokens, values))), CLIPS)


def step(epoch: int, *clips: str) -> dict:
    values = {"a": mel(-1.0, 3), "b": mel(-2.0, 2), "c": mel(0.5, 3)}
    return {"epoch": epoch, "rows": row_identities(batch_of(*((CLIPS[c].tokens, values[c]) for c in clips)))}


def test_every_clip_once_per_epoch_passes_and_a_lost_or_repeated_one_fails():
    counts = check_trained([step(0, "a", "b"), step(0, "c"), step(1, "c", "a"), step(1, "b")], CLIPS, 2, "abc")
    assert counts == {0: collections.Counter("abc"), 1: collections.Counter("abc")}
    with pytest.raises(AssertionError, match="missing"):
        check_trained([step(0, "a", "b")], CLIPS, 1, "abc")
    with pytest.raises(AssertionError, match="more than once"):
        check_trained([step(0, "a", "b"), step(0, "c", "a")], CLIPS, 1, "abc")
    with pytest.raises(AssertionError, match="epochs trained"):
        check_trained([step(0, "a", "b", "c")], CLIPS, 2, "abc")
    # an interrupted run's last epoch: nothing twice, not necessarily everything
    check_trained([step(0, "a", "b", "c"), step(1, "a")], CLIPS, 2, "abc", open_epochs=1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_producer_that_swaps_two_clips_mels_fails_the_check_the_ledger_passes(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("--model", "synthetic:1", "--epochs", "1", "--producers", "1", "--record-samples",
                     "--model-start-delay", "0", "--run-dir", str(run_dir), "--set", "features.backend=numpy",
                     env=fault_env("swap-mels"))
    assert result.returncode == 0, result.stderr[-3000:]
    demo = {e.id for e in read_metadata(DEMO_DATA_DIR)[0]}
    ledger = collections.Counter(i for r in read_jsonl(run_dir / "samples.jsonl") for i in r["ids"])
    assert set(ledger) == demo and set(ledger.values()) == {1}  # handed out: every clip once
    with pytest.raises(AssertionError, match="its mel is not theirs"):
        check_run(run_dir, 1, demo)  # trained: rows with another clip's mel


def test_clips_made_alike_count_together():
    """Two clips with the same text and audio: no data tells which one a row was, so each epoch
    must train that data exactly twice."""
    twins = {**CLIPS, "d": Clip("d", (7, 1), 2, (-2.0, 2.0))}  # b's twin
    assert identify(step(0, "b")["rows"], twins) == ["b=d"]
    check_trained([step(0, "a", "b"), step(0, "b", "c")], twins, 1, "abcd")
    with pytest.raises(AssertionError, match=r"missing \['b=d'\]"):
        check_trained([step(0, "a", "b"), step(0, "c")], twins, 1, "abcd")
    with pytest.raises(AssertionError, match="more than once"):
        check_trained([step(0, "a", "b", "b"), step(0, "b", "c")], twins, 1, "abcd")
