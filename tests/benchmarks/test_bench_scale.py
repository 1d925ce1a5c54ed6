"""The scale benchmark's pieces without a run: its generated manifest and its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile

from stoker.benchmarks import mix_corpus, scale
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index


def test_the_generated_manifest_is_indexed_from_its_durations(tmp_path: Path) -> None:
    manifest = scale.make_dataset(tmp_path, 60)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(rows) == 60 and len({r["text"] for r in rows}) == 60 and len({r["id"] for r in rows}) == 60
    assert len(list((tmp_path / "audio").iterdir())) == scale.AUDIO_FILES
    # each file as long as the duration its clips give (a producer rejects a clip 0.1 s off)
    lengths = {f"audio/a{n}.wav": soundfile.info(str(tmp_path / "audio" / f"a{n}.wav")).duration
               for n in range(scale.AUDIO_FILES)}
    assert all(abs(lengths[r["audio_filepath"]] - r["duration"]) < 1e-3 for r in rows)
    assert scale.make_dataset(tmp_path / "again", 60).read_text() == manifest.read_text()  # the same corpus twice
    index = build_index(DataConfig(path=str(tmp_path), metadata_file="manifest.jsonl", index_cache="off"),
                        FeaturesConfig())
    assert len(index.samples) == 60 and index.rejected == [] and index.stats.headers_read == 0
    assert [s.duration_s for s in index.samples] == [r["duration"] for r in rows]


def test_the_report_names_growth_and_targets() -> None:
    figures = dict.fromkeys(scale.GROWN + ("cold_build_peak_rss_mb", "warm_load_peak_rss_mb", "samples_per_s",
                                           "launcher_peak_rss_mb"), 1.0)
    rows = [{**figures, "clips": 1_000_000, "command": "c"},
            {**figures, "clips": 10_000_000, "consumer_peak_rss_mb": 20.0, "command": "c"}]
    growth = {k: (rows[1][k] / rows[0][k]) / 10 for k in scale.GROWN}
    result = {"sizes": rows, "growth_per_clip": growth,
              "targets": [{"what": "consumer_peak_rss_mb at 10,000,000 clips", "value": 20.0, "limit": 1500.0,
                           "met": True}]}
    text = scale.render(result)
    assert "1,000,000 clips" in text and "10,000,000 clips" in text
    assert "met: consumer_peak_rss_mb at 10,000,000 clips = 20.000 (limit 1500)" in text
    assert growth["consumer_peak_rss_mb"] == 2.0


def test_the_generated_loose_layout_is_a_file_per_clip_and_indexed_from_their_headers(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setattr(scale, "LINKS_PER_FILE", 25)  # a copy of the clip every 25 links, as every 50,000
    scale.make_loose(tmp_path, 60)
    lines = (tmp_path / scale.LOOSE_METADATA).read_text().splitlines()
    assert len(lines) == 60 and len({line.split("|")[0] for line in lines}) == 60
    wavs = sorted((tmp_path / "wavs").iterdir())
    assert [p.stem for p in wavs] == [line.split("|")[0] for line in lines]
    assert len({p.stat().st_ino for p in wavs}) == 3  # hard links to three copies of one clip
    index = build_index(DataConfig(path=str(tmp_path), index_cache="off"), FeaturesConfig())
    assert len(index.samples) == 60 and index.rejected == [] and index.stats.headers_read == 60


def test_the_report_names_the_loose_files_target() -> None:
    figures = dict.fromkeys(("cold_build_s", "cold_build_peak_rss_mb", "warm_load_s", "launch_to_first_batch_s",
                             "samples_per_s", "consumer_peak_rss_mb", "producer_peak_rss_mb",
                             "launcher_peak_rss_mb"), 1.0)
    loose = [{**figures, "clips": 1_000_000, "launch_to_first_batch_s": 4.0, "command": "c"}]
    result = {"sizes": [], "loose": loose, "growth_per_clip": {},
              "targets": scale._met(scale.LOOSE_TARGETS, loose, "loose files")}
    text = scale.render(result)
    assert "1,000,000 loose files" in text
    assert "NOT met: launch_to_first_batch_s at 1,000,000 loose files = 4.000 (limit 3)" in text


def test_the_report_names_the_mix_builds_their_growth_and_the_targets_at_ten_to_the_eight() -> None:
    small = {"clips": 1_000_000, "mix.cold_build_s": 10.0, "mix.streamed": False, "cuts.all_peak_rss_mb": 800.0}
    large = {"clips": 10_000_000, "mix.cold_build_s": 120.0, "mix.streamed": False, "cuts.all_peak_rss_mb": None}
    growth = scale._growth([small, large])
    assert growth == {"mix.cold_build_s": 1.2, "mix.streamed": None, "cuts.all_peak_rss_mb": None}
    at_scale = [{"clips": 100_000_000, "mix.cold_build_s": 1300.0, "mix.all_peak_rss_mb": None}]
    targets = scale._met(scale.MIX_TARGETS, at_scale, "clips in a mix")
    text = scale.render({"sizes": [], "mix": [small, large], "mix_growth_per_clip": growth, "targets": targets})
    assert "10,000,000 clips in a mix" in text and "mix.streamed" in text
    assert "NOT met: mix.cold_build_s at 100,000,000 clips in a mix = 1300.000 (limit 1200)" in text
    assert "all_peak_rss_mb at 100,000,000" not in text  # a build stopped has no figure to judge


@pytest.mark.timeout(120)
def test_a_watched_build_past_its_memory_limit_is_stopped_and_one_within_it_gives_its_figures(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mix_corpus, "CHUNK", 500)
    mix_corpus.write_mix(tmp_path, 1500)
    stopped = scale._watched_index(tmp_path / "cuts", "cuts.jsonl.gz", limit_mb=1.0)
    assert stopped["killed"] and not (tmp_path / "cuts" / ".stoker").exists()
    done = scale._watched_index(tmp_path / "manifest", "manifest.jsonl", limit_mb=10_000.0)
    assert not done["killed"] and done["clips"] == 500 and done["rejected"] == 0
    assert not done["streamed"] and done["all_peak_rss_mb"] > 0  # a small manifest: one process, no run files


@pytest.mark.timeout(120)
def test_a_watched_build_past_its_time_limit_is_stopped_with_the_figures_it_reached(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mix_corpus, "CHUNK", 500)
    mix_corpus.write_mix(tmp_path, 1500)
    monkeypatch.setattr(scale, "BUILD_TIMEOUT_S", 0.05)
    stopped = scale._watched_index(tmp_path / "manifest", "manifest.jsonl", limit_mb=10_000.0)
    assert stopped["timed_out"] and not stopped["killed"] and stopped["wall_s"] >= 0.05
    assert "clips" not in stopped  # a build stopped has no index figures, only what the watch saw


def test_a_kept_mix_is_generated_once_and_reused_with_its_generation_figures(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mix_corpus, "CHUNK", 500)
    first = scale._generated(tmp_path / "mix900", 900, lambda text: None)
    made = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def no_generation(*args, **kwargs):
        raise AssertionError("a kept mix was generated again")

    monkeypatch.setattr(mix_corpus, "write_mix", no_generation)
    said: list[str] = []
    again = scale._generated(tmp_path / "mix900", 900, said.append)
    assert again == first and first["clips"] == 900 and first["generation_s"] > 0
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == made
    assert "reusing the corpus" in said[0]
