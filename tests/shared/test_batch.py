"""Tests for shared/batch.py: the declared batch, its checks, and collation into it."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.shared.batch import FRAMES, MEL_PAD, SCHEMA, batch_dims, collate, example, parse_model_fields, schema_for
from stoker.shared.config import FeaturesConfig
from stoker.shared.text import PAD_ID
from stoker.shared.mel import pad_values
from tests.factories import make_batch

PAD = float(np.log(1e-5))
B, L, T, F = 4, 12, 20, 6


def _collate(tokens, mels, size, max_tokens, max_frames, n_mels, mel_pad):
    pads = {**pad_values(SCHEMA, FeaturesConfig(), "off"), "mel": mel_pad}
    return collate([{"tokens": t, "mel": m} for t, m in zip(tokens, mels)],
                   batch_dims(size, (max_tokens, max_frames), n_mels), pads)


def _examples(lengths: list[tuple[int, int]], seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(2, 38, size=n).astype(np.int32) for n, _ in lengths]
    mels = [rng.standard_normal((t, F)).astype(np.float32) for _, t in lengths]
    return tokens, mels


def test_shapes_dtypes_and_names() -> None:
    tokens, mels = _examples([(3, 5), (12, 20), (1, 1)])
    out = _collate(tokens, mels, B, L, T, F, PAD)
    assert tuple(out) == SCHEMA.names == ("tokens", "token_lengths", "mel", "mel_lengths")
    assert out["tokens"].shape == (B, L) and out["tokens"].dtype == np.int32
    assert out["token_lengths"].shape == (B,) and out["token_lengths"].dtype == np.int32
    assert out["mel"].shape == (B, T, F) and out["mel"].dtype == np.float32
    assert out["mel_lengths"].shape == (B,) and out["mel_lengths"].dtype == np.int32
    for array in out.values():
        assert array.flags.c_contiguous


def test_values_and_padding() -> None:
    lengths = [(3, 5), (12, 20), (1, 1)]
    tokens, mels = _examples(lengths, seed=1)
    out = _collate(tokens, mels, B, L, T, F, PAD)
    np.testing.assert_array_equal(out["token_lengths"], [3, 12, 1, 0])
    np.testing.assert_array_equal(out["mel_lengths"], [5, 20, 1, 0])
    for row, (n, t) in enumerate(lengths):
        np.testing.assert_array_equal(out["tokens"][row, :n], tokens[row])
        assert np.all(out["tokens"][row, n:] == PAD_ID)
        np.testing.assert_array_equal(out["mel"][row, :t], mels[row])
        assert np.all(out["mel"][row, t:] == np.float32(PAD))


def test_empty_rows_are_all_padding() -> None:
    tokens, mels = _examples([(4, 7)])
    out = _collate(tokens, mels, B, L, T, F, PAD)
    assert list(out["token_lengths"][1:]) == [0, 0, 0]
    assert list(out["mel_lengths"][1:]) == [0, 0, 0]
    assert np.all(out["tokens"][1:] == PAD_ID)
    assert np.all(out["mel"][1:] == np.float32(PAD))


def test_no_examples_gives_an_all_empty_batch() -> None:
    out = _collate([], [], B, L, T, F, PAD)
    assert out["tokens"].shape == (B, L) and not out["token_lengths"].any() and not out["mel_lengths"].any()


def test_pad_value_is_used() -> None:
    tokens, mels = _examples([(2, 2)])
    out = _collate(tokens, mels, 2, L, T, F, -3.5)
    assert out["mel"][0, 2, 0] == -3.5 and np.all(out["mel"][1] == -3.5)


@pytest.mark.parametrize(("lengths", "match"), [
    ([(L + 1, 5)], "exceeds the bucket"),
    ([(3, T + 1)], "exceeds the bucket"),
])
def test_too_long_example_raises(lengths, match: str) -> None:
    tokens, mels = _examples(lengths)
    with pytest.raises(ValueError, match=match):
        _collate(tokens, mels, B, L, T, F, PAD)


def test_wrong_mel_channels_raises() -> None:
    tokens = [np.ones(3, np.int32)]
    mels = [np.zeros((4, F + 1), np.float32)]
    with pytest.raises(ValueError, match="exceeds the bucket"):
        _collate(tokens, mels, B, L, T, F, PAD)


def test_count_errors() -> None:
    tokens, mels = _examples([(2, 2)] * (B + 1))
    with pytest.raises(ValueError, match=f"{B + 1} examples for a batch of {B}"):
        _collate(tokens, mels, B, L, T, F, PAD)


def test_exact_fit_is_accepted() -> None:
    tokens, mels = _examples([(L, T)] * B)
    out = _collate(tokens, mels, B, L, T, F, PAD)
    assert np.all(out["token_lengths"] == L) and np.all(out["mel_lengths"] == T)
    assert not np.any(out["mel"] == np.float32(PAD))  # no padding at all (random values)


def test_factory_batch_is_consistent() -> None:
    batch = make_batch(batch_size=5, max_tokens=9, max_frames=11, n_mels=7, valid=3, seed=4)
    assert batch["mel"].shape == (5, 11, 7)
    assert np.all(batch["token_lengths"][:3] > 0) and np.all(batch["token_lengths"][3:] == 0)
    for row in range(5):
        n = batch["token_lengths"][row]
        assert np.all(batch["tokens"][row, :n] != PAD_ID)
        assert np.all(batch["tokens"][row, n:] == PAD_ID)


def test_schema_checks_names_dtypes_and_bucket_shapes() -> None:
    dims = batch_dims(B, (L, T), F)
    good = _collate(*_examples([(3, 5), (2, 2)]), B, L, T, F, PAD)
    assert SCHEMA.check(good, dims) == "" and SCHEMA.check_rows(good, 2) == ""
    assert SCHEMA.check({k: v for k, v in good.items() if k != "mel"}, dims).startswith("arrays ")
    assert SCHEMA.check({**good, "tokens": good["tokens"].astype(np.int64)}, dims) == (
        f"tokens is int64 [{B}, {L}], expected int32 [{B}, {L}]")
    assert SCHEMA.check(good, batch_dims(B, (L, T + 16), F)) == (
        f"mel is float32 [{B}, {T}, {F}], expected float32 [{B}, {T + 16}, {F}]")
    assert SCHEMA.check_rows(good, 3) == "token_lengths does not match the 3 clips delivered"
    pads = pad_values(SCHEMA, FeaturesConfig(), "off")
    assert pads == {"tokens": 0.0, "token_lengths": 0.0, "mel": PAD, "mel_lengths": 0.0}
    assert FRAMES in SCHEMA.names and [f.length_of for f in SCHEMA.fields if f.name == FRAMES] == ["mel"]


def test_the_design_notes_print_the_schema() -> None:
    from pathlib import Path

    design = (Path(__file__).resolve().parents[2] / "docs" / "design" / "batches.md").read_text(encoding="utf-8")
    assert SCHEMA.table() in design
    assert MEL_PAD in SCHEMA.table()
    from stoker.shared.batch import OPTIONAL, BatchSchema

    assert BatchSchema(tuple(OPTIONAL.values())).table() in design
    assert "- L: token length of the bucket (padded) (bucketed)" in SCHEMA.table()


def test_optional_fields_are_declared_collated_and_checked() -> None:
    from stoker.shared.batch import OPTIONAL, example, schema_for

    schema = schema_for("stop, speaker_id")
    assert schema.names == ("tokens", "token_lengths", "mel", "mel_lengths", "speaker_id", "stop")  # declared order
    rows = [example(np.array([3, 4, 1], np.int32), np.zeros((5, F), np.float32), schema, speaker_id=2),
            example(np.array([3, 1], np.int32), np.zeros((3, F), np.float32), schema, speaker_id=1)]
    out = collate(rows, batch_dims(3, (4, 6), F), pad_values(schema, FeaturesConfig(), "off"), schema)
    assert out["speaker_id"].tolist() == [2, 1, 0] and out["speaker_id"].dtype == np.int32
    assert out["stop"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert schema.check(out, batch_dims(3, (4, 6), F)) == ""
    assert SCHEMA.check(out, batch_dims(3, (4, 6), F)).startswith("arrays ")  # a run without them refuses it
    for name, field in OPTIONAL.items():
        assert f"`{name}`" in schema_for(field.length_of or name).table()  # a length field comes with its field
    with pytest.raises(ValueError, match="unknown batch field 'speakers'"):
        schema_for("speakers")


def test_audio_and_reference_round_trip_with_their_padding() -> None:
    from stoker.shared.batch import example, schema_for

    schema = schema_for("audio,ref_mel")
    assert schema.names[-4:] == ("audio", "audio_lengths", "ref_mel", "ref_mel_lengths")
    rng = np.random.default_rng(3)
    hop, ref_frames, T = 4, 5, 6
    waves = [rng.standard_normal(n).astype(np.float32) for n in (23, 9)]
    refs = [rng.standard_normal((n, F)).astype(np.float32) for n in (5, 2)]
    rows = [example(np.array([3, 1], np.int32), np.zeros((4, F), np.float32), schema, audio=w, ref_mel=r)
            for w, r in zip(waves, refs)]
    rows.append(example(np.array([5, 1], np.int32), np.zeros((2, F), np.float32), schema))  # none: all padding
    dims = batch_dims(4, (4, T), F, hop, ref_frames)
    pads = pad_values(schema, FeaturesConfig(), "off")
    out = collate(rows, dims, pads, schema)
    assert schema.check(out, dims) == "" and out["audio"].shape == (4, T * hop) and out["ref_mel"].shape == (4, 5, F)
    assert out["audio_lengths"].tolist() == [23, 9, 0, 0] and out["ref_mel_lengths"].tolist() == [5, 2, 0, 0]
    for row, (w, r) in enumerate(zip(waves, refs)):
        np.testing.assert_array_equal(out["audio"][row, :len(w)], w)
        assert not out["audio"][row, len(w):].any()
        np.testing.assert_array_equal(out["ref_mel"][row, :len(r)], r)
        assert (out["ref_mel"][row, len(r):] == np.float32(pads["ref_mel"])).all()
    with pytest.raises(ValueError, match="exceeds the bucket"):
        collate([example(np.array([1], np.int32), np.zeros((2, F), np.float32), schema,
                         audio=np.zeros(T * hop + 1, np.float32))], dims, pads, schema)
    with pytest.raises(ValueError, match="unknown batch field 'audio_lengths'"):
        schema_for("audio_lengths")  # it comes with audio


def test_row_mask_is_one_on_the_real_rows_and_checked() -> None:
    from stoker.shared.batch import example, schema_for

    schema = schema_for("row_mask")
    rows = [example(np.array([3, 4, 1], np.int32), np.zeros((5, F), np.float32), schema) for _ in range(2)]
    out = collate(rows, batch_dims(3, (4, 6), F), pad_values(schema, FeaturesConfig(), "off"), schema)
    assert out["row_mask"].tolist() == [1.0, 1.0, 0.0] and out["row_mask"].dtype == np.float32
    assert schema.check(out, batch_dims(3, (4, 6), F)) == "" and schema.check_rows(out, 2) == ""
    out["row_mask"][2] = 1.0  # an empty row marked real
    assert schema.check_rows(out, 2) == "row_mask does not match the 2 clips delivered"


def test_model_fields_take_derived_and_fixed_dimensions_and_collate_to_their_padding() -> None:
    """transforms.model_fields: T/4 is the bucket's frames divided by 4, rounded up; a number is
    fixed; "-" one value per clip; a row a producer model has not filled is all padding."""
    fields = parse_model_fields("codes:int32:T/4:-1, emb:float32:64:0, latents:float32:T/4 8:0.5, n:int32:-:7")
    assert [f.dims for f in fields] == [("B", "T/4"), ("B", "64"), ("B", "T/4", "8"), ("B",)]
    schema = schema_for("", "", "codes:int32:T/4:-1, emb:float32:64:0, latents:float32:T/4 8:0.5, n:int32:-:7")
    dims = batch_dims(2, (16, 30), 80)  # T = 30: 8 codes
    assert schema.shapes(dims)["codes"] == (2, 8) and schema.shapes(dims)["latents"] == (2, 8, 8)
    pads = {**pad_values(SCHEMA, FeaturesConfig(), "off"), **{f.name: f.pad for f in fields}}
    batch = collate([example(np.ones(3, np.int32), np.zeros((5, 80), np.float32), schema)], dims, pads, schema)
    assert (batch["codes"] == -1).all() and (batch["latents"] == 0.5).all() and batch["n"].tolist() == [7, 7]
    assert schema.check(batch, dims) == ""


def test_the_clip_field_pads_with_minus_one_and_the_check_knows_a_real_row_from_an_empty_one() -> None:
    schema = schema_for("clip")
    mel = np.zeros((5, 8), np.float32)
    examples = [example(np.array([3, 1], np.int32), mel, schema, clip=clip) for clip in (7, 0)]
    pads = {f.name: 0.0 if f.pad == MEL_PAD else float(f.pad) for f in schema.fields}
    arrays = collate(examples, batch_dims(3, (4, 8), 8), pads, schema)
    assert arrays["clip"].dtype == np.int32 and arrays["clip"].tolist() == [7, 0, -1]
    assert schema.check_rows(arrays, 2) == ""
    assert "clip" in schema.check_rows({**arrays, "clip": np.array([7, -1, -1], np.int32)}, 2)
    assert "clip" in schema.check_rows({**arrays, "clip": np.array([7, 0, 5], np.int32)}, 2)
