"""lhotse cut manifests, written by lhotse itself: each cut's fields as a clip (its window of a
longer recording included), gzip and plain; the producer reads exactly the cut's frames, as
lhotse's own load_audio does; a cut beyond its recording's end or without its recording is a
rejection naming the cut, never a crash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
from lhotse import CutSet, MonoCut, Recording, RecordingSet, SupervisionSegment, SupervisionSet

from stoker.producer.audio import AudioError, AudioMissing, load_audio
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.corpus.address import address_of
from stoker.shared.mel import num_frames
from tests.factories import tone

RATE = 16000
def parse_span(name: str) -> tuple[str, float, float] | None:
    """(file, start, end) of a window of a recording, None for a whole file's name."""
    address = address_of(name)
    return (address.path, *address.span) if address.span is not None else None  # type: ignore[union-attr]


FEATURES = FeaturesConfig()


def _supervision(cut_id: str, recording: Recording, duration: float, text: str, speaker: str | None = None,
                 language: str | None = None, start: float = 0.0) -> SupervisionSegment:
    return SupervisionSegment(id=f"{cut_id}-s{start}", recording_id=recording.id, start=start, duration=duration,
                              text=text, speaker=speaker, language=language)


def _window(cut_id: str, recording: Recording, start: float, duration: float,
            supervisions: list[SupervisionSegment]) -> MonoCut:
    return MonoCut(id=cut_id, start=start, duration=duration, channel=0, recording=recording,
                   supervisions=supervisions)


def write_corpus(root: Path, name: str = "cuts.jsonl.gz") -> tuple[Path, CutSet]:
    """WAVs and a cut manifest over them: a whole short recording, two windows of a long one (one
    of two supervisions), a window past the long one's end, a cut without text, and a cut whose
    recording file is gone. Returns the manifest's path and the cuts."""
    (root / "audio").mkdir(parents=True)
    soundfile.write(str(root / "audio" / "long.wav"), tone(3.0, RATE, seed=1), RATE, subtype="PCM_16")
    soundfile.write(str(root / "audio" / "short.wav"), tone(1.0, RATE, seed=2), RATE, subtype="PCM_16")
    soundfile.write(str(root / "audio" / "gone.wav"), tone(1.0, RATE, seed=3), RATE, subtype="PCM_16")
    long = Recording.from_file(root / "audio" / "long.wav")
    short = Recording.from_file(root / "audio" / "short.wav")
    gone = Recording.from_file(root / "audio" / "gone.wav")
    whole = CutSet.from_manifests(
        recordings=RecordingSet.from_recordings([short]),
        supervisions=SupervisionSet.from_segments([_supervision("short", short, 1.0, "A whole file.", "bob", "en")]))
    cuts = whole + CutSet.from_cuts([
        _window("w1", long, 0.5, 1.25, [_supervision("w1", long, 0.5, "second half.", "al", "fa", start=0.75),
                                         _supervision("w1", long, 0.75, "First half,", "al", "fa")]),
        _window("w2", long, 2.0, 1.0, [_supervision("w2", long, 1.0, "The end.", speaker="cy")]),
        _window("past", long, 2.5, 1.0, [_supervision("past", long, 1.0, "Beyond.")]),
        _window("mute", long, 0.0, 0.5, []),
        _window("lost", gone, 0.0, 0.5, [_supervision("lost", gone, 0.5, "Lost file.")]),
    ])
    (root / "audio" / "gone.wav").unlink()
    path = root / name
    cuts.to_file(path)
    return path, cuts.to_eager()


@pytest.mark.parametrize("name", ["cuts.jsonl.gz", "cuts.jsonl", "librispeech_cuts_dev.jsonl.gz"])
def test_every_field_of_a_lhotse_cut_manifest_is_read(tmp_path: Path, name: str) -> None:
    manifest, cuts = write_corpus(tmp_path, name)
    assert (manifest.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    index = build_index(DataConfig(path=str(manifest), index_cache="off"), FEATURES)
    samples = {s.id: s for s in index.samples}
    assert sorted(samples) == ["lost", "short-0", "w1", "w2"]  # "lost": its file is a producer's to find
    short = samples["short-0"]
    long = str(tmp_path / "audio" / "long.wav")
    assert (short.text, short.speaker, short.language, short.duration_s) == ("A whole file.", "bob", "en", 1.0)
    assert short.audio == str(tmp_path / "audio" / "short.wav")  # all of its recording: the file itself
    w1, w2 = samples["w1"], samples["w2"]
    # supervisions in order of their start; the first one's speaker and language
    assert (w1.text, w1.speaker, w1.language, w1.duration_s) == ("First half, second half.", "al", "fa", 1.25)
    assert parse_span(w1.audio) == (long, 0.5, 1.75)
    assert (w2.text, w2.speaker, w2.language, w2.duration_s) == ("The end.", "cy", "en", 1.0)
    assert parse_span(w2.audio) == (long, 2.0, 3.0)
    for cut in cuts:
        if cut.id in samples:
            assert samples[cut.id].num_frames == num_frames(round(cut.duration * FEATURES.sample_rate_hz), FEATURES)
    assert [s.line for s in index.samples] == [1, 2, 3, 6]
    reasons = {r.id: r.reason for r in index.rejected}
    assert sorted(reasons) == ["mute", "past"]
    assert "cut past (cut manifest line 4) ends at 3.500 s, beyond its recording's end (3.000 s" in reasons["past"]
    assert "cut mute (cut manifest line 5) has no supervision with text" in reasons["mute"]


def test_a_producer_reads_only_the_cuts_frames_as_lhotse_does(tmp_path: Path) -> None:
    manifest, cuts = write_corpus(tmp_path)
    index = build_index(DataConfig(path=str(manifest), index_cache="off"), FEATURES)
    for sample in index.samples:
        if sample.id == "lost":
            continue
        span = parse_span(sample.audio)
        file, seconds = (span[0], span[1:]) if span is not None else (sample.audio, None)
        ours = load_audio(Path(file), RATE, span=seconds)
        theirs = cuts[sample.id].load_audio()[0]
        assert ours.shape == theirs.shape and np.allclose(ours, theirs, atol=1e-6), sample.id
        resampled = load_audio(Path(file), FEATURES.sample_rate_hz, span=seconds)
        assert num_frames(len(resampled), FEATURES) == sample.num_frames  # the frames the index planned


def test_a_cut_beyond_its_files_end_or_without_its_file_is_an_audio_error_naming_it(tmp_path: Path) -> None:
    manifest, _ = write_corpus(tmp_path)
    index = build_index(DataConfig(path=str(manifest), index_cache="off"), FEATURES)
    samples = {s.id: s for s in index.samples}
    file, start, end = parse_span(samples["w2"].audio)
    soundfile.write(file, tone(2.5, RATE, seed=1), RATE, subtype="PCM_16")  # shorter than the manifest says
    with pytest.raises(AudioError, match=r"cut ends at 3\.000 s, beyond its recording's end \(2\.500 s\)"):
        load_audio(Path(file), RATE, "audio/long.wav#t=2.0,3.0", (start, end))
    with pytest.raises(AudioMissing, match="audio file missing"):
        load_audio(Path(samples["lost"].audio), RATE, span=(0.0, 0.5))


def test_a_broken_gzip_cut_manifest_is_one_line_for_the_user(tmp_path: Path) -> None:
    from stoker.shared.dataset.types import DatasetError

    (tmp_path / "cuts.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00broken")
    with pytest.raises(DatasetError, match="not a readable gzip file"):
        build_index(DataConfig(path=str(tmp_path / "cuts.jsonl.gz"), index_cache="off"), FEATURES)
