"""Tests for shared/dataset/ (files, probe, index): metadata parsing, the index, and precise rejections."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.corpus.registry import read_metadata
from stoker.shared.dataset.files import DEMO_DATA_DIR, resolve_root, scan_audio
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.probe import expected_samples
from stoker.shared.dataset.types import DatasetError
from stoker.shared.dataset.layouts import Rejection
from stoker.shared.text import normalize
from tests.factories import add_clip, append_metadata, make_dataset, make_faulty_dataset, truncate_wav

FEATURES = FeaturesConfig()
HOP = FEATURES.hop_length


def _data(root: Path, **kw) -> DataConfig:
    return DataConfig(path=str(root), **kw)


def _reasons(index) -> dict[str, str]:
    return {r.id: r.reason for r in index.rejected}


def _metadata_lines(root: Path) -> int:
    return len((root / "metadata.csv").read_bytes().splitlines())


@pytest.fixture
def good(tmp_path: Path) -> tuple[Path, list[str]]:
    ids = make_dataset(tmp_path, count=6)
    return tmp_path, ids


def test_build_index_on_factory_dataset(good) -> None:
    root, ids = good
    index = build_index(_data(root), FEATURES)
    assert index.root == root.resolve()
    assert [s.id for s in index.samples] == ids
    assert index.rejected == []
    for sample in index.samples:
        info = soundfile.info(str(root / "wavs" / f"{sample.id}.wav"))
        assert sample.num_frames == 1 + info.frames // HOP
        assert sample.duration_s == pytest.approx(info.frames / info.samplerate)
        assert sample.units == normalize(sample.text, "en")[0] and sample.language == "en"
        assert sample.num_tokens == len(sample.units) + 1 == len(index.vocabulary.encode(sample.units))
        assert sample.speaker == "default" and sample.audio == f"wavs/{sample.id}.wav"
    assert set(index.by_id()) == set(ids)
    assert len(index.fingerprint) == 16


def test_fingerprint_is_stable_and_tracks_content(good) -> None:
    root, _ = good
    first = build_index(_data(root), FEATURES).fingerprint
    assert build_index(_data(root), FEATURES).fingerprint == first
    add_clip(root, "EXTRA", 1.0)
    assert build_index(_data(root), FEATURES).fingerprint != first


def _expect_rejected(root: Path, good_ids: list[str], sample_id: str, fragment: str, **data_kw) -> Rejection:
    index = build_index(_data(root, **data_kw), FEATURES)
    assert [s.id for s in index.samples] == good_ids  # the good clips are all kept
    matches = [r for r in index.rejected if r.id == sample_id]
    assert len(matches) == 1, index.rejected
    assert fragment in matches[0].reason, matches[0].reason
    assert matches[0].producer == "index"
    return matches[0]


def test_missing_wav(good) -> None:
    root, ids = good
    append_metadata(root, ["GONE|Some text.|Some text."])
    _expect_rejected(root, ids, "GONE", f"audio file missing: wavs/GONE.wav (metadata line {_metadata_lines(root)})")


def test_empty_wav(good) -> None:
    root, ids = good
    (root / "wavs" / "ZERO.wav").write_bytes(b"")
    append_metadata(root, ["ZERO|Some text.|Some text."])
    _expect_rejected(root, ids, "ZERO", f"audio file empty: wavs/ZERO.wav (metadata line {_metadata_lines(root)})")


def test_non_audio_file_named_wav(good) -> None:
    root, ids = good
    (root / "wavs" / "TEXT.wav").write_text("this is not audio at all\n" * 20, encoding="utf-8")
    append_metadata(root, ["TEXT|Some text.|Some text."])
    rejection = _expect_rejected(root, ids, "TEXT", "audio file unreadable: wavs/TEXT.wav: ")
    assert rejection.reason.endswith(f"(metadata line {_metadata_lines(root)})") and rejection.file == "wavs/TEXT.wav"
    assert str(root) not in rejection.reason
    assert "\n" not in rejection.reason and len(rejection.reason) < 250


def test_wav_with_a_header_and_no_samples(good) -> None:
    root, ids = good
    soundfile.write(str(root / "wavs" / "HOLLOW.wav"), np.zeros(0, np.float32), 22050, subtype="PCM_16")
    assert (root / "wavs" / "HOLLOW.wav").stat().st_size > 0
    append_metadata(root, ["HOLLOW|Some text.|Some text."])
    _expect_rejected(root, ids, "HOLLOW", "audio file has no samples: wavs/HOLLOW.wav")


def test_malformed_metadata_line(good) -> None:
    root, ids = good
    line = _metadata_lines(root) + 1
    append_metadata(root, ["NOPIPE just some words", "A|b|c|d"])
    index = build_index(_data(root), FEATURES)
    assert [s.id for s in index.samples] == ids
    reasons = [r.reason for r in index.rejected]
    assert reasons == [f"malformed metadata line {line}: 1 field, expected id|text|normalized_text or id|text",
                       f"malformed metadata line {line + 1}: 4 fields, expected id|text|normalized_text or id|text "
                       "(or id|text|normalized_text|speaker|language; set data.columns for other forms)"]
    assert [r.line for r in index.rejected] == [line, line + 1]


@pytest.mark.parametrize("bad_id", ["../escape", "sub/dir", ".hidden"])
def test_ids_that_are_not_plain_file_names(good, bad_id: str) -> None:
    root, ids = good
    append_metadata(root, [f"{bad_id}|Some text.|Some text."])
    index = build_index(_data(root), FEATURES)
    assert [s.id for s in index.samples] == ids
    assert len(index.rejected) == 1 and "malformed metadata line" in index.rejected[0].reason


def test_non_utf8_metadata_line(good) -> None:
    root, ids = good
    line = _metadata_lines(root) + 1
    append_metadata(root, [b"LATIN|caf\xe9 au lait|caf\xe9 au lait"])
    rejection = _expect_rejected(root, ids, "LATIN", f"metadata line {line} is not valid UTF-8 (byte 0xe9 at column 10)")
    assert rejection.line == line


def test_duplicate_id(good) -> None:
    root, ids = good
    line = _metadata_lines(root) + 1
    append_metadata(root, [f"{ids[2]}|Another text.|Another text."])
    index = build_index(_data(root), FEATURES)
    assert [s.id for s in index.samples] == ids
    assert index.by_id()[ids[2]].text != "Another text."  # the first line wins
    assert index.rejected == [Rejection(ids[2], f"duplicate id on metadata line {line} (first on line 3)", line=line)]


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_text(good, text: str) -> None:
    root, ids = good
    add_clip(root, "MUTE", 1.0, text=text)
    line = _metadata_lines(root)
    rejection = _expect_rejected(root, ids, "MUTE", f"empty text on metadata line {line}")
    assert rejection.kind == "empty-text"


@pytest.mark.parametrize(("text", "units"), [("1234 #$%", "one thousand, two hundred and thirty-four #$%"),
                                             ("\u65e5\u672c", "\u65e5\u672c")])
def test_digits_symbols_and_other_scripts_are_kept(good, text: str, units: str) -> None:
    root, ids = good
    add_clip(root, "KEPT", 1.0, text=text)
    index = build_index(_data(root), FEATURES)
    assert index.by_id()["KEPT"].units == units and index.rejected == []
    assert set(units) <= set(index.vocabulary.symbols)


def test_text_of_only_unrepresentable_characters_is_a_loss_not_silence(good) -> None:
    root, ids = good
    add_clip(root, "EMOJI", 1.0, text="\U0001f600\u263a")
    line = _metadata_lines(root)
    rejection = _expect_rejected(root, ids, "EMOJI", "text loses 2 of 2 characters the characters front-end "
                                                     "cannot represent ('\U0001f600' U+1F600, '\u263a' U+263A; "
                                                     f"text.max_lost_frac=0) (metadata line {line})")
    assert rejection.kind == "lost-text"


def test_text_too_long(good) -> None:
    root, ids = good
    longest = max(s.num_tokens for s in build_index(_data(root), FEATURES).samples)
    add_clip(root, "WORDY", 1.0, text="a" * longest)
    _expect_rejected(root, ids, "WORDY", f"text of {longest + 1} tokens exceeds data.max_tokens={longest}",
                     max_tokens=longest)


def test_clip_longer_than_max(good) -> None:
    root, ids = good
    add_clip(root, "LONG", 2.5)
    _expect_rejected(root, ids, "LONG", "clip of 2.50 s longer than data.max_audio_s=2 s: wavs/LONG.wav (metadata line 7)",
                     max_audio_s=2.0)


def test_clip_shorter_than_min(good) -> None:
    root, ids = good
    add_clip(root, "SHORT", 0.1)
    _expect_rejected(root, ids, "SHORT", "clip of 0.10 s shorter than data.min_audio_s=0.2 s: wavs/SHORT.wav")


def test_clip_shorter_than_a_frame(good) -> None:
    root, ids = good
    add_clip(root, "BLIP", 0.02)  # 441 samples < n_fft/2+1
    _expect_rejected(root, ids, "BLIP", "its framing needs (features.padding reflect)", min_audio_s=0.01)


def test_all_faults_at_once_keep_the_good_clips(good) -> None:
    root, ids = good
    (root / "wavs" / "ZERO.wav").write_bytes(b"")
    (root / "wavs" / "TEXT.wav").write_bytes(b"RIFF....WAVEjunk")
    add_clip(root, "LONG", 2.5)
    add_clip(root, "SHORT", 0.1)
    append_metadata(root, ["GONE|a|a", "ZERO|a|a", "TEXT|a|a", "BAD LINE", b"X|\xff\xfe|a", f"{ids[0]}|dup|dup",
                           "EMPTY||"])
    index = build_index(_data(root, max_audio_s=2.0), FEATURES)
    assert [s.id for s in index.samples] == ids
    assert len(index.rejected) == 9


def test_two_field_lines_and_crlf(tmp_path: Path) -> None:
    ids = make_dataset(tmp_path, count=3)
    raw = (tmp_path / "metadata.csv").read_text(encoding="utf-8").splitlines()
    first_id = raw[0].split("|")[0]
    raw[0] = f"{first_id}|Only One Field"
    (tmp_path / "metadata.csv").write_bytes(("\r\n".join(raw) + "\r\n").encode("utf-8"))
    index = build_index(_data(tmp_path), FEATURES)
    assert [s.id for s in index.samples] == ids
    assert index.samples[0].text == "Only One Field"
    entries, rejected = read_metadata(tmp_path)
    assert rejected == [] and [e.line for e in entries] == [1, 2, 3]


def test_normalized_text_is_used(tmp_path: Path) -> None:
    make_dataset(tmp_path, count=1)
    add_clip(tmp_path, "NORM", 1.0)
    lines = (tmp_path / "metadata.csv").read_text(encoding="utf-8").splitlines()
    lines[-1] = "NORM|Dr. Smith paid $5|Doctor Smith paid five dollars"
    (tmp_path / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    index = build_index(_data(tmp_path), FEATURES)
    assert index.by_id()["NORM"].text == "Doctor Smith paid five dollars"


def test_utf8_bom_does_not_reject_the_first_clip(tmp_path: Path) -> None:
    ids = make_dataset(tmp_path, count=3)
    meta = tmp_path / "metadata.csv"
    meta.write_bytes(b"\xef\xbb\xbf" + meta.read_bytes())
    index = build_index(_data(tmp_path), FEATURES)
    assert [s.id for s in index.samples] == ids and index.rejected == []


def test_frame_count_at_16khz(good) -> None:
    root, ids = good
    path = add_clip(root, "SIXTEEN", 1.2345, rate_hz=16000)
    index = build_index(_data(root), FEATURES)
    sample = index.by_id()["SIXTEEN"]
    n_source = soundfile.info(str(path)).frames
    n = expected_samples(n_source, 16000, FEATURES.sample_rate_hz)
    assert n == -(-n_source * 22050 // 16000)  # ceil
    assert sample.num_frames == 1 + n // HOP
    assert sample.duration_s == pytest.approx(n_source / 16000)


def test_frame_count_with_another_hop(good) -> None:
    root, ids = good
    features = FeaturesConfig(hop_length=200)
    index = build_index(_data(root), features)
    for sample in index.samples:
        frames = soundfile.info(str(root / "wavs" / f"{sample.id}.wav")).frames
        assert sample.num_frames == 1 + frames // 200


@pytest.mark.parametrize("padding", ["end", "none"])
def test_frame_count_follows_the_padding(good, padding: str) -> None:
    from stoker.producer.features import log_mel_spectrogram_numpy
    from stoker.producer.audio import load_audio

    root, ids = good
    features = FeaturesConfig(padding=padding, backend="numpy")
    index = build_index(_data(root), features)
    for sample in index.samples[:2]:
        audio = load_audio(root / "wavs" / f"{sample.id}.wav", features.sample_rate_hz)
        frames = {"end": -(-len(audio) // HOP), "none": 1 + (len(audio) - features.n_fft) // HOP}[padding]
        assert sample.num_frames == frames == len(log_mel_spectrogram_numpy(audio, features))


def test_expected_samples() -> None:
    assert expected_samples(1000, 22050, 22050) == 1000
    assert expected_samples(16000, 16000, 22050) == 22050
    assert expected_samples(1, 16000, 22050) == 2  # ceil(1.378)
    assert expected_samples(44100, 44100, 22050) == 22050
    assert expected_samples(3, 44100, 22050) == 2


def test_nonexistent_directory(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        build_index(_data(tmp_path / "nope"), FEATURES)
    with pytest.raises(DatasetError, match="does not exist"):
        resolve_root(str(tmp_path / "nope"))


def test_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(DatasetError, match="not a directory"):
        resolve_root(str(tmp_path / "f"))


def test_directory_without_metadata(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="metadata.csv not found"):
        build_index(_data(tmp_path), FEATURES)


def test_no_usable_clip(tmp_path: Path) -> None:
    (tmp_path / "wavs").mkdir()
    append_metadata(tmp_path, ["A|text|text", "B|text|text"])
    with pytest.raises(DatasetError, match=r"no usable clip \(2 rejected\)"):
        build_index(_data(tmp_path), FEATURES)
    (tmp_path / "metadata.csv").write_bytes(b"")
    with pytest.raises(DatasetError, match="no usable clip"):
        build_index(_data(tmp_path), FEATURES)


def test_demo_set() -> None:
    assert resolve_root("") == DEMO_DATA_DIR.resolve()
    index = build_index(DataConfig(), FEATURES)
    assert len(index.samples) == 64
    assert index.rejected == []
    assert index.samples[0].id == "DEMO-0001"


# ------------------------------------------------------------------ formats and faults


def test_every_fault_of_the_faulty_dataset(tmp_path: Path) -> None:
    faulty = make_faulty_dataset(tmp_path)
    index = build_index(_data(tmp_path, max_audio_s=faulty.max_audio_s), FEATURES)
    assert sorted(s.id for s in index.samples) == sorted(faulty.valid + list(faulty.producer_rejections))
    got = [(r.id, r.reason) for r in index.rejected]
    for expected in faulty.index_rejections:
        assert expected in got
    for sample_id, start, end in faulty.loose_rejections:
        (reason,) = [r for i, r in got if i == sample_id]
        assert reason.startswith(start) and reason.endswith(end), reason
    assert len(got) == len(faulty.index_rejections) + len(faulty.loose_rejections)
    for r in index.rejected:
        assert "\n" not in r.reason and str(tmp_path) not in r.reason and r.line is not None


def test_truncated_wav_is_rejected_from_its_header(good) -> None:
    root, ids = good
    declared, kept = truncate_wav(add_clip(root, "CUT", 1.0))
    assert soundfile.info(str(root / "wavs" / "CUT.wav")).frames == kept // 2  # libsndfile alone clamps silently
    _expect_rejected(root, ids, "CUT", f"audio file truncated: wavs/CUT.wav: holds {kept} of the {declared} "
                                       f"sample bytes its header declares (metadata line {_metadata_lines(root)})")


@pytest.mark.parametrize("keep", [12, 30, 44])
def test_wav_cut_inside_its_header(good, keep: int) -> None:
    root, ids = good
    path = add_clip(root, "STUB", 1.0)
    path.write_bytes(path.read_bytes()[:keep])
    rejection = _expect_rejected(root, ids, "STUB", "audio file truncated: wavs/STUB.wav: ")
    assert rejection.reason.endswith(f"(metadata line {_metadata_lines(root)})")


def test_wav_with_chunks_before_data_and_odd_sizes(good) -> None:
    # A LIST chunk of odd length (padded) between fmt and data, as tagging tools write.
    root, ids = good
    path = add_clip(root, "TAGGED", 1.0)
    raw = path.read_bytes()
    at = raw.index(b"data")
    tag = b"LIST" + (5).to_bytes(4, "little") + b"INFOx" + b"\0"
    path.write_bytes(raw[:at] + tag + raw[at:])
    index = build_index(_data(root), FEATURES)
    assert "TAGGED" in index.by_id() and not index.rejected
    truncate_wav(path)
    meta = root / "metadata.csv"  # a warm start looks at no audio file: the metadata's new stamp re-lists them
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 1_000_000_000))
    _expect_rejected(root, ids, "TAGGED", "audio file truncated: wavs/TAGGED.wav: holds ")


def test_streamed_wav_with_unknown_data_size_is_accepted(good) -> None:
    root, ids = good
    path = add_clip(root, "STREAMED", 1.0)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"data")
    raw[at + 4:at + 8] = (0xFFFFFFFF).to_bytes(4, "little")  # what a tool writing to a pipe leaves
    path.write_bytes(bytes(raw))
    assert "STREAMED" in build_index(_data(root), FEATURES).by_id()


def test_flac_ogg_stereo_and_other_rates_are_indexed(good) -> None:
    root, ids = good
    add_clip(root, "F", 1.25, suffix=".flac")
    add_clip(root, "O", 1.0, suffix=".ogg")
    add_clip(root, "S", 1.0, channels=2)
    add_clip(root, "R", 1.0, rate_hz=44100)
    index = build_index(_data(root), FEATURES)
    assert not index.rejected
    by_id = index.by_id()
    assert (by_id["F"].audio, by_id["O"].audio, by_id["S"].audio) == ("wavs/F.flac", "wavs/O.ogg", "wavs/S.wav")
    assert by_id["F"].num_frames == 1 + int(1.25 * 22050) // HOP
    assert by_id["R"].num_frames == 1 + expected_samples(44100, 44100, 22050) // HOP


def test_wav_is_preferred_when_an_id_has_several_files(good) -> None:
    root, ids = good
    add_clip(root, "TWICE", 1.0, suffix=".flac")
    add_clip(root, "TWICE", 2.0, metadata=False)
    assert build_index(_data(root), FEATURES).by_id()["TWICE"].audio == "wavs/TWICE.wav"
    assert scan_audio(root)["TWICE"].name == "wavs/TWICE.wav"


def test_a_file_named_in_nfd_is_the_clip_of_its_nfc_id(good) -> None:
    """A copy from macOS keeps names decomposed (NFD); the metadata holds them composed (NFC)."""
    import json
    import unicodedata

    from stoker.shared.dataset.agreement import scan_dataset

    root, ids = good
    composed = "Caf\u00e9-\u00c5ngstr\u00f6m"
    decomposed = unicodedata.normalize("NFD", composed)
    assert decomposed != composed
    path = add_clip(root, decomposed, 1.0, metadata=False)
    assert path.name == f"{decomposed}.wav" and not (root / "wavs" / f"{composed}.wav").exists()
    append_metadata(root, [f"{composed}|Some text.|Some text."])
    index = build_index(_data(root), FEATURES)
    assert index.rejected == []
    clip = index.by_id()[composed]
    assert clip.audio == f"wavs/{decomposed}.wav" and clip.duration_s == pytest.approx(1.0)
    assert (root / clip.audio).is_file()  # the name the producers open is the one on disk
    scan = scan_dataset(root)
    assert scan.missing == [] and scan.files[composed] == f"wavs/{decomposed}.wav"
    # the same through a manifest that names the file composed
    lines = [{"audio_filepath": f"wavs/{i}.wav", "text": "Some text."} for i in [*ids, composed]]
    (root / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    index = build_index(_data(root, metadata_file="train.jsonl"), FEATURES)
    assert index.rejected == [] and index.by_id()[composed].audio == f"wavs/{decomposed}.wav"


def test_a_line_that_lost_a_field_is_rejected_for_it_not_as_missing_audio(good) -> None:
    """A 2-field line among 3-field ones is id|text when its id has audio; without, it lost a field."""
    root, ids = good
    add_clip(root, "SHORT", 1.0, metadata=False)
    append_metadata(root, ["SHORT|Just text.", "Printing, in the only sense|Printing, in the only sense"])
    line = _metadata_lines(root)
    index = build_index(_data(root), FEATURES)
    assert [s.id for s in index.samples] == [*ids, "SHORT"] and index.by_id()["SHORT"].text == "Just text."
    assert [(r.id, r.line, r.reason, r.kind) for r in index.rejected] == [
        ("Printing, in the only sense", line,
         f"malformed metadata line {line}: 2 fields where the file's lines have 3 (id|text|normalized_text): a field "
         "is missing (read as id|text, its id has no audio file wavs/Printing, in the only sense.wav)", "")]
    # with data.columns the layout is known: the short line is rejected for its fields at once
    index = build_index(_data(root, columns="id|text|normalized_text"), FEATURES)
    assert {r.id: r.reason for r in index.rejected}["SHORT"] == (
        f"malformed metadata line {line - 1}: 2 fields, data.columns expects 3 (id|text|normalized_text)")


def test_truncated_flac_is_found_by_its_tail(good) -> None:
    root, ids = good
    path = add_clip(root, "HALF", 1.5, suffix=".flac")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _expect_rejected(root, ids, "HALF", "audio file truncated: wavs/HALF.flac: the stream ends before sample 33075 "
                                        f"its header announces (metadata line {_metadata_lines(root)})")


def test_rejections_carry_line_and_file_in_json(good) -> None:
    root, ids = good
    append_metadata(root, ["GONE|text|text"])
    (rejection,) = build_index(_data(root), FEATURES).rejected
    assert rejection.to_json() == {"id": "GONE", "reason": rejection.reason, "producer": "index",
                                   "line": _metadata_lines(root), "file": "wavs/GONE.wav", "kind": "missing-audio"}


@pytest.mark.parametrize("fmt, subtype, channels", [
    ("WAV", "PCM_U8", 1), ("WAV", "PCM_16", 2), ("WAV", "PCM_24", 1), ("WAV", "PCM_32", 3), ("WAV", "FLOAT", 1),
    ("WAV", "DOUBLE", 2), ("WAVEX", "PCM_16", 2), ("WAVEX", "FLOAT", 1), ("RF64", "PCM_16", 1),
    ("WAV", "ULAW", 1), ("WAV", "IMA_ADPCM", 1), ("FLAC", "PCM_16", 2), ("OGG", "VORBIS", 1),
])
def test_header_facts_agree_with_libsndfile(tmp_path: Path, fmt: str, subtype: str, channels: int) -> None:
    from stoker.shared.dataset.probe import probe_audio

    path = tmp_path / f"clip.{ {'WAV': 'wav', 'WAVEX': 'wav', 'RF64': 'wav', 'FLAC': 'flac', 'OGG': 'ogg'}[fmt] }"
    audio = np.stack([np.sin(np.arange(12345) * 0.01 * (c + 1)) * 0.3 for c in range(channels)], axis=1)
    soundfile.write(str(path), audio, 16000, format=fmt, subtype=subtype)
    info = soundfile.info(str(path))
    probe = probe_audio(path)
    assert probe.error == ""
    assert (probe.frames, probe.rate, probe.channels) == (info.frames, info.samplerate, info.channels)
