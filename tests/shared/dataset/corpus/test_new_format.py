"""A new corpus format is one module (a Format of base.py's contract) and one line of the registry
(shared/dataset/corpus/registry.py): a toy format, registered here, is indexed, cached and read
as the formats of the package are, with nothing else of stoker changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import soundfile

from stoker.producer.audio import load_audio
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.files import audio_path
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.corpus import registry
from stoker.shared.dataset.corpus.address import File, address_of
from stoker.shared.dataset.corpus.base import Format
from stoker.shared.dataset.files import locate_audio, read_file
from stoker.shared.dataset.types import AudioFile
from stoker.shared.dataset.layouts import Entry, Rejection
from stoker.shared.mel import num_frames
from tests.factories import tone

FEATURES = FeaturesConfig()
RATE = 22050


class Toy(Format):
    """``*.toy``: one clip a line, ``FILE<TAB>TEXT``, its id the file's stem (the module a new format is)."""

    name = "toy"

    def claims(self, metadata_file: str) -> bool:
        return metadata_file.endswith(".toy")

    def read(self, root: Path, metadata_file: str) -> bytes:
        return read_file(root, metadata_file)

    def parse(self, raw: bytes, columns: str) -> tuple[list[Entry], list[Rejection]]:
        entries, rejected = [], []
        for number, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
            file, tab, text = line.partition("\t")
            if not tab:
                rejected.append(Rejection(f"line:{number}", f"toy line {number} has no tab", line=number))
                continue
            entries.append(Entry(Path(file).stem, text, number, audio=file))
        return entries, rejected

    def audio(self, root: Path, metadata_file: str, raw: bytes, columns: str) -> dict[str, AudioFile]:
        return locate_audio(root, self.parse(raw, columns)[0])


def _corpus(root: Path) -> dict[str, float]:
    durations = {"a": 0.7, "b": 1.1, "c": 0.9}
    (root / "clips").mkdir(parents=True)
    for n, (clip, seconds) in enumerate(durations.items()):
        soundfile.write(str(root / "clips" / f"{clip}.wav"), tone(seconds, RATE, seed=n), RATE, subtype="PCM_16")
    lines = [f"clips/{clip}.wav\tClip {clip} is spoken." for clip in durations] + ["no tab here"]
    (root / "corpus.toy").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return durations


@pytest.mark.timeout(60)
def test_a_toy_format_registered_in_one_line_is_indexed_cached_and_read(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    durations = _corpus(tmp_path / "toy")
    monkeypatch.setattr(registry, "FORMATS", [Toy(), *registry.FORMATS])  # the registry's one line
    assert registry.format_of("corpus.toy").name == "toy" and registry.format_of("metadata.csv").name == "ljspeech"
    data = DataConfig(path=str(tmp_path / "toy"), metadata_file="corpus.toy", index_cache=str(tmp_path / "cache"))
    cold = build_index(data, FEATURES)
    assert cold.stats.cache == "miss"
    assert sorted(s.id for s in cold.samples) == sorted(durations)
    assert [(r.id, r.reason) for r in cold.rejected] == [("line:4", "toy line 4 has no tab")]
    warm = build_index(data, FEATURES)  # found again in its cache, as a metadata file is
    assert warm.stats.cache == "hit" and list(warm.samples) == list(cold.samples)
    for sample in cold.samples:  # each clip read as a producer reads it: its text from the index, its audio by address
        assert sample.text == f"Clip {sample.id} is spoken."
        address = address_of(sample.audio)
        assert isinstance(address, File) and address.path == f"clips/{sample.id}.wav"
        audio = load_audio(audio_path(cold.root, sample.id, address.path), FEATURES.sample_rate_hz)
        assert num_frames(len(audio), FEATURES) == sample.num_frames  # the frames the index planned
        assert abs(sample.duration_s - durations[sample.id]) < 1e-3
