"""Dataset agreement (shared/dataset/agreement.py): the trainer's scan and fingerprints, a remote
producer's description of its copy (the metadata's SHA-256), check_agreement, and the per-file
check at reading time (file_sizes, size_problem)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.shared.dataset.agreement import (Agreement, Reference, check_agreement, deferred, describe_copy,
                                             file_sizes, is_deferred, metadata_sha256, scan_dataset, size_problem)
from stoker.shared.dataset.corpus.registry import locate
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.types import DatasetError
from stoker.shared.dataset import storage
from tests.factories import append_metadata, make_dataset, make_shards


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "trainer"
    return root, make_dataset(root, count=8)


def copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to)
    return to


def reference(root: Path, metadata_file: str = "metadata.csv") -> Reference:
    """The trainer's side, as the feed makes it from its index (the SHA-256 the index stores)."""
    return Reference(root, metadata_file, stored_sha256=scan_dataset(root, metadata_file).metadata_sha256)


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
    with pytest.raises(DatasetError, match="metadata.csv not found"):  # the same line for a remote producer
        describe_copy(tmp_path)


def test_fingerprints_ignore_path_mtime_and_line_order(data, tmp_path: Path) -> None:
    root, ids = data
    reference_scan = scan_dataset(root)
    other = copy(root, tmp_path / "elsewhere" / "copy")
    for wav in (other / "wavs").iterdir():
        os.utime(wav, (1_000_000, 1_000_000))
    lines = (other / "metadata.csv").read_text().splitlines()
    (other / "metadata.csv").write_text("\n".join(reversed(lines)) + "\n")
    scan = scan_dataset(other)
    assert (scan.metadata_fp, scan.audio_fp) == (reference_scan.metadata_fp, reference_scan.audio_fp)


def test_the_metadata_sha256_is_the_files_read_in_pieces(data, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = data
    whole = hashlib.sha256((root / "metadata.csv").read_bytes()).hexdigest()
    monkeypatch.setattr(storage, "HASH_CHUNK_BYTES", 7)
    assert metadata_sha256(root) == whole == scan_dataset(root).metadata_sha256


def test_a_copy_elsewhere_with_other_mtimes_is_accepted(data, tmp_path: Path) -> None:
    root, _ = data
    other = copy(root, tmp_path / "elsewhere" / "copy")
    for path in [other / "metadata.csv", *(other / "wavs").iterdir()]:
        os.utime(path, (1_000_000, 1_000_000))
    described = describe_copy(other)
    assert described == {"metadata_file": "metadata.csv", "columns": "", "sha256": metadata_sha256(root)}
    assert check_agreement(reference(root), described, "b") == Agreement(True)


def test_another_text_is_refused_with_the_host_and_both_digests(data, tmp_path: Path) -> None:
    root, ids = data
    other = copy(root, tmp_path / "other")
    lines = (other / "metadata.csv").read_text().splitlines()
    lines[0] = f"{ids[0]}|Other words.|Other words."
    (other / "metadata.csv").write_text("\n".join(lines) + "\n")
    verdict = check_agreement(reference(root), describe_copy(other), "hostb")
    assert verdict == Agreement(False, f"dataset on hostb does not match the trainer's: metadata.csv differs (SHA-256 "
                                       f"{metadata_sha256(other)[:16]} there, {metadata_sha256(root)[:16]} on the "
                                       "trainer); point --data at a copy of the trainer's dataset")


@pytest.mark.parametrize("change", ["an extra entry", "lines reordered"])
def test_a_metadata_file_not_byte_for_byte_the_trainers_is_refused(data, tmp_path: Path, change: str) -> None:
    """Deliberately strict: a copy is the trainer's bytes (cp, scp, rsync keep them), so one hash
    decides without parsing anything; reordered lines are another file."""
    root, _ = data
    other = copy(root, tmp_path / "other")
    if change == "an extra entry":
        append_metadata(other, ["NEW|More text.|More text."])
    else:
        lines = (other / "metadata.csv").read_text().splitlines()
        (other / "metadata.csv").write_text("\n".join(reversed(lines)) + "\n")
    verdict = check_agreement(reference(root), describe_copy(other), "b")
    assert not verdict.ok and "metadata.csv differs" in verdict.reason


def test_another_metadata_file_is_refused_with_the_one_to_read(data) -> None:
    root, _ = data
    shutil.copy(root / "metadata.csv", root / "train.csv")
    verdict = check_agreement(reference(root), describe_copy(root, "train.csv"), "b")
    assert verdict == Agreement(False, "producer on b read 'train.csv' (columns ''); the trainer reads "
                                       "'metadata.csv' (columns '')", metadata_file="metadata.csv", columns="")


@pytest.mark.parametrize("described", [
    None, "abc", {}, {"metadata_file": "metadata.csv"}, {"metadata_file": "metadata.csv", "sha256": 3},
    # what a producer of protocol version 4 described: fingerprints and its missing files
    {"metadata_file": "metadata.csv", "metadata": "a", "audio": "b", "entries": 1, "missing": [], "missing_count": 0}])
def test_a_malformed_description_is_refused_not_fatal(data, described) -> None:
    root, _ = data
    verdict = check_agreement(reference(root), described, "b")
    assert not verdict.ok and "did not describe its dataset" in verdict.reason


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
        assert check_agreement(Reference.of(index), describe_copy(root), "b").ok
    assert index.stats.cache == "hit"


def test_a_producer_reading_no_metadata_is_accepted_without_reading_anything(tmp_path: Path) -> None:
    described = deferred("metadata.csv")
    assert is_deferred(described) and not is_deferred({"metadata_file": "metadata.csv", "sha256": "ab"})
    nowhere = Reference(tmp_path / "absent", "*.tar")  # a shard digest would list the shards: not made
    assert check_agreement(nowhere, described, "here") == Agreement(True)


def test_the_trainer_checks_a_copy_against_its_stored_sha256_reading_nothing(tmp_path: Path) -> None:
    """No parse of the trainer's metadata in the coordinator's thread, whatever the size: its
    metadata file need not even be readable once the index holds the SHA-256."""
    gone = Reference(tmp_path / "absent", "metadata.csv", stored_sha256="ab" * 32)
    assert check_agreement(gone, {"metadata_file": "metadata.csv", "columns": "", "sha256": "ab" * 32}, "b").ok


def test_file_sizes_are_the_trainers_files_and_leave_out_members_urls_and_absent_files(data) -> None:
    root, ids = data
    files = {ids[0]: f"wavs/{ids[0]}.wav", ids[1]: str(root / "wavs" / f"{ids[1]}.wav"),
             "member": "s-0.tar#clips/a.flac@1536+4800", "url": "https://example.org/a.wav", "gone": "wavs/gone.wav"}
    assert file_sizes(root, files) == {i: (root / "wavs" / f"{i}.wav").stat().st_size for i in ids[:2]}


def test_a_file_of_another_size_is_named_with_both_sizes() -> None:
    assert size_problem("wavs/a.wav", 1000, 1000) == "" and size_problem("wavs/a.wav", 1000, None) == ""
    assert size_problem("wavs/a.wav", 998, 1000) == ("wavs/a.wav is 998 bytes on this host and 1000 on the trainer "
                                                     "(a resampled, re-encoded or truncated copy?)")


def test_tar_shards_agree_by_their_names_and_sizes_without_reading_members(tmp_path: Path) -> None:
    made = make_shards(tmp_path / "trainer", shards=2, per_shard=3)
    located = locate(str(tmp_path / "trainer"), "metadata.csv")
    root, pattern = located.where
    trainer = Reference(root, pattern, stored_sha256="the manifest's: not what shards are compared by")
    other = copy(tmp_path / "trainer", tmp_path / "other")
    other_root, other_pattern = locate(str(other), "metadata.csv").where
    assert check_agreement(trainer, describe_copy(other_root, other_pattern), "b").ok
    expected = "".join(f"{p.name}\t{p.stat().st_size}\n" for p in sorted(made.paths))
    assert located.sha256() == hashlib.sha256(expected.encode()).hexdigest()
    with open(other / made.paths[1].name, "ab") as f:  # a shard of another size: another copy
        f.write(bytes(512))
    verdict = check_agreement(trainer, describe_copy(other_root, other_pattern), "b")
    assert not verdict.ok and f"{pattern} differs" in verdict.reason
