"""Dataset agreement (shared/dataset/agreement.py): scans, fingerprints, and check_agreement."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset import (MAX_MISSING_IDS, Agreement, DatasetError, build_index, check_agreement, deferred,
                                   is_deferred, scan_dataset)
from tests.factories import append_metadata, make_dataset


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "trainer"
    return root, make_dataset(root, count=8)


def copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to)
    return to


def test_scan_lists_sizes_and_missing(data) -> None:
    root, ids = data
    (root / "wavs" / f"{ids[2]}.wav").unlink()
    scan = scan_dataset(root)
    assert [e.id for e in scan.entries] == ids
    assert scan.missing == [ids[2]]
    assert set(scan.sizes) == set(ids) - {ids[2]}
    assert scan.sizes[ids[0]] == (root / "wavs" / f"{ids[0]}.wav").stat().st_size
    assert len(scan.fingerprint) == 16


def test_scan_without_metadata_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="metadata.csv not found"):
        scan_dataset(tmp_path)


def test_fingerprints_ignore_path_mtime_and_line_order(data, tmp_path: Path) -> None:
    root, ids = data
    reference = scan_dataset(root)
    other = copy(root, tmp_path / "elsewhere" / "copy")
    for wav in (other / "wavs").iterdir():
        os.utime(wav, (1_000_000, 1_000_000))
    lines = (other / "metadata.csv").read_text().splitlines()
    (other / "metadata.csv").write_text("\n".join(reversed(lines)) + "\n")
    scan = scan_dataset(other)
    assert (scan.metadata_fp, scan.audio_fp) == (reference.metadata_fp, reference.audio_fp)
    assert check_agreement(reference, scan.describe(), "b").ok


def test_another_text_is_refused_with_the_host_and_both_counts(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    lines = (other / "metadata.csv").read_text().splitlines()
    lines[0] = f"{ids[0]}|Other words.|Other words."
    (other / "metadata.csv").write_text("\n".join(lines) + "\n")
    verdict = check_agreement(scan_dataset(root), scan_dataset(other).describe(), "hostb")
    assert not verdict.ok
    assert "dataset on hostb does not match the trainer's: metadata.csv differs" in verdict.reason
    assert "8 entries" in verdict.reason


def test_an_extra_entry_is_refused(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    append_metadata(other, ["NEW|More text.|More text."])
    assert not check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b").ok


def test_a_resized_audio_file_is_refused(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    with open(other / "wavs" / f"{ids[3]}.wav", "ab") as f:
        f.write(b"\0\0")
    verdict = check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b")
    assert not verdict.ok and "differ in size" in verdict.reason


def test_missing_files_are_accepted_and_reported_as_lacks(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    for i in (1, 5):
        (other / "wavs" / f"{ids[i]}.wav").unlink()
    verdict = check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b")
    assert verdict.ok and verdict.lacks == {ids[1], ids[5]}


def test_missing_on_both_sides_is_no_lack(data, tmp_path: Path) -> None:
    root, ids = data
    (root / "wavs" / f"{ids[0]}.wav").unlink()
    other = copy(root, tmp_path / "other")
    (other / "wavs" / f"{ids[4]}.wav").unlink()
    verdict = check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b")
    assert verdict.ok and verdict.lacks == {ids[4]}


def test_a_file_the_trainer_lacks_is_refused(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    (root / "wavs" / f"{ids[6]}.wav").unlink()
    verdict = check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b")
    assert not verdict.ok and "the trainer lacks" in verdict.reason


def test_too_many_missing_files_are_refused(data) -> None:
    root, _ = data
    described = scan_dataset(root).describe()
    described.update(missing=[], missing_count=MAX_MISSING_IDS + 1)
    verdict = check_agreement(scan_dataset(root), described, "b")
    assert not verdict.ok and "finish copying" in verdict.reason


def test_another_metadata_file_is_refused_with_the_one_to_read(data) -> None:
    root, _ = data
    described = scan_dataset(root).describe()
    described["metadata_file"] = "train.csv"
    verdict = check_agreement(scan_dataset(root), described, "b")
    assert not verdict.ok and verdict.metadata_file == "metadata.csv"


@pytest.mark.parametrize("described", [None, "abc", {}, {"metadata": 1}, {"metadata_file": "metadata.csv",
                         "metadata": "a", "audio": "b", "entries": True, "missing": [], "missing_count": 0},
                         {"metadata_file": "metadata.csv", "metadata": "a", "audio": "b", "entries": 1,
                          "missing": [3], "missing_count": 1}])
def test_a_malformed_description_is_refused_not_fatal(data, described) -> None:
    root, _ = data
    verdict = check_agreement(scan_dataset(root), described, "b")
    assert not verdict.ok and "did not describe its dataset" in verdict.reason


def test_missing_ids_not_in_the_metadata_are_refused(data) -> None:
    root, _ = data
    described = scan_dataset(root).describe()
    described.update(missing=["NOT-THERE"], missing_count=1)
    assert not check_agreement(scan_dataset(root), described, "b").ok


def test_the_unused_middle_column_does_not_count(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    text = (other / "metadata.csv").read_text().replace(ids[0] + "|", ids[0] + "|Raw spelling ", 1)
    (other / "metadata.csv").write_text(text)
    assert check_agreement(scan_dataset(root), scan_dataset(other).describe(), "b").ok


def test_the_index_stores_the_scan_it_was_built_from(data, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ids = data
    monkeypatch.setenv("XDG_CACHE_HOME", str(root.parent / "cache"))
    (root / "wavs" / f"{ids[5]}.wav").unlink()
    data_cfg = DataConfig(path=str(root))
    for index in (build_index(data_cfg, FeaturesConfig()), build_index(data_cfg, FeaturesConfig())):
        scan = scan_dataset(root)
        assert index.agreement == {"metadata": scan.metadata_fp, "audio": scan.audio_fp, "missing": 1,
                                   "metadata_sha256": scan.metadata_sha256}
        assert index.dataset_fingerprint == scan.fingerprint
    assert index.stats.cache == "hit"


def test_a_producer_reading_no_metadata_is_accepted_without_a_scan(data) -> None:
    root, _ = data
    described = deferred("metadata.csv")
    assert is_deferred(described) and not is_deferred(scan_dataset(root).describe())
    assert check_agreement(scan_dataset(root), described, "here") == Agreement(True)
