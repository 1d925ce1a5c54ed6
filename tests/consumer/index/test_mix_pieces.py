"""A large mix built in pieces (consumer/index/mix_pieces.py: each part's pieces as its format
alone makes them, its clips named as the mix names them in the helpers, merged by chunked.py) is
the index the one-process build makes: the same samples in the same order, the same rejections
with the same reasons and lines in (part, line) order, the same vocabulary and fingerprints, and
a cache file of the same bytes. The parts' faults are those of the formats' own tests."""

from __future__ import annotations

import gzip
import hashlib
import logging
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.consumer.index import cuts_pieces as cuts_pieces_module
from stoker.consumer.index import mix_pieces as mix_pieces_module
from stoker.consumer.index import parquet_pieces as parquet_pieces_module
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.cache import open_index
from stoker.shared.dataset.corpus.cuts import Cuts
from stoker.shared.dataset.corpus.manifest import Manifest
from stoker.shared.dataset.corpus.mix import Mix
from stoker.shared.dataset.corpus.parquet import Parquet
from tests.factories import make_dataset
from tests.consumer.index import test_chunked, test_cuts_pieces, test_parquet_pieces

FEATURES = FeaturesConfig()

PARQUET_PART = """  - path: rows
    name: hf
    language: de
    metadata_file: "*.parquet"
"""
MIX = f"""datasets:
  - path: lines
    metadata_file: train.jsonl
{PARQUET_PART}  - path: cuts
    metadata_file: cuts.jsonl.gz
"""


def _mix(root: Path) -> None:
    """A mix of a JSON-lines manifest, Parquet files and a lhotse cut manifest (two gzip members),
    each with the faults of its own format's test: repeats within and across pieces, lines that
    are not JSON, texts that lose characters or are too long, unknown languages."""
    (root / "lines").mkdir(parents=True)
    (root / "lines" / "train.jsonl").write_bytes(b"".join(test_chunked._lines()))
    rows = test_parquet_pieces._rows()
    for name in rows:  # twice over: repeated ids in a later piece
        rows[name] = rows[name] + rows[name][:5]
    test_parquet_pieces._write(root / "rows", rows)
    (root / "cuts").mkdir()
    lines = b"".join(test_cuts_pieces._lines())
    half = len(lines) // 2
    (root / "cuts" / "cuts.jsonl.gz").write_bytes(gzip.compress(lines[:half]) + gzip.compress(lines[half:]))
    (root / "mix.yaml").write_text(MIX)


def _build(root: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, pieces: bool, workers: int = 1,
           max_lost_frac: float = 0.0):
    monkeypatch.setattr(mix_pieces_module, "MIX_CHUNKED_MIN_BYTES", 1 if pieces else 1 << 40)
    monkeypatch.setattr(mix_pieces_module, "PIECE_BYTES", 700)  # a few lines a piece
    monkeypatch.setattr(cuts_pieces_module, "BLOCK_BYTES", 2000)
    monkeypatch.setattr(parquet_pieces_module, "PIECE_ROWS", 4)  # a row group a piece
    data = DataConfig(path=str(root / "mix.yaml"), index_cache=str(cache), index_workers=workers, max_tokens=200)
    return build_index(data, FEATURES, TextConfig(max_lost_frac=max_lost_frac))


def _same_cache_files(one: Path, pieces: Path, parquet: bool) -> None:
    """The two cache files alike: of the same bytes; with a Parquet part, the same sections and
    header but the index key and the one-process build's file columns, the Parquet rows' shards
    listed (as a Parquet dataset's own pieces build leaves them out, the key with them)."""
    if not parquet:
        assert pieces.read_bytes() == one.read_bytes()
        return
    a, b = open_index(one), open_index(pieces)
    assert sorted(a.sections) == sorted([*b.sections, "n.file_size", "n.file_mtime_ns"])
    assert all(bytes(a.sections[name]) == bytes(section) for name, section in b.sections.items())
    assert {k: v for k, v in a.header.items() if k not in ("key", "sections")} == \
        {k: v for k, v in b.header.items() if k not in ("key", "sections")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "max_lost_frac", "parquet"), [(1, 0.0, True), (2, 0.0, True), (1, 0.7, False)])
def test_a_mix_built_in_pieces_is_the_one_process_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        workers: int, max_lost_frac: float, parquet: bool) -> None:
    root = tmp_path / "data"
    _mix(root)
    if not parquet:
        (root / "mix.yaml").write_text(MIX.replace(PARQUET_PART, ""))
    parts = ["lines", "hf", "cuts"] if parquet else ["lines", "cuts"]
    one = _build(root, tmp_path / "one", monkeypatch, pieces=False, max_lost_frac=max_lost_frac)
    assert one.stats.workers <= 1
    made, chunk = [], mix_pieces_module.mix_chunk
    with monkeypatch.context() as m:  # the pieces this process worked (all of them, without helpers)
        if workers == 1:
            m.setattr(mix_pieces_module, "mix_chunk", lambda fn, *task: made.append(fn.__name__) or chunk(fn, *task))
        pieces = _build(root, tmp_path / "pieces", monkeypatch, pieces=True, workers=workers,
                        max_lost_frac=max_lost_frac)
    assert pieces.stats.workers == workers
    if workers == 1:  # every part in several pieces
        assert {name: made.count(name) > 3 for name in set(made)} == {
            "manifest_chunk": True, "cuts_chunk": True, **({"parquet_chunk": True} if parquet else {})}
    assert list(pieces.samples) == list(one.samples) and len(one.samples) > 100
    assert {s.id.partition(":")[0] for s in one.samples} == set(parts)
    assert pieces.rejected == one.rejected
    reasons = [r.reason for r in one.rejected]
    for part, repeat in (("lines", "duplicate id on manifest line"), ("hf", "duplicate id on row"),
                         ("cuts", "duplicate cut id on cut manifest line")):
        # within a piece and across pieces
        assert part not in parts or sum(r.startswith(f"{part}: {repeat}") for r in reasons) >= 2
    assert any("exceeds data.max_tokens" in r for r in reasons) and any("unknown language" in r for r in reasons)
    assert pieces.lost == one.lost and one.lost["clips"] >= 2
    assert pieces.vocabulary.state_dict() == one.vocabulary.state_dict()
    assert pieces.agreement == one.agreement and (pieces.fingerprint == one.fingerprint) != parquet
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()  # the spilled blocks gone with the runs
    _same_cache_files(one_file, pieces_file, parquet)
    with monkeypatch.context() as m:  # found by the parts' stamps: no part read nor hashed
        for fmt in (Manifest, Cuts, Parquet):
            m.setattr(fmt, "read", lambda *args: pytest.fail("a part read"))
            m.setattr(fmt, "sha256", lambda *args: pytest.fail("a part hashed"))
        warm = _build(root, tmp_path / "pieces", monkeypatch, pieces=True, max_lost_frac=max_lost_frac)
    assert warm.stats.cache == "hit" and list(warm.samples) == list(one.samples)


@pytest.mark.timeout(60)
def test_a_mix_with_an_ljspeech_part_is_built_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its clips' audio headers are read (as an LJSpeech layout's alone): no pieces."""
    root = tmp_path / "data"
    _mix(root)
    make_dataset(root / "lj", count=3, prefix="L")
    (root / "mix.yaml").write_text(MIX + "  - path: lj\n")
    monkeypatch.setattr(mix_pieces_module, "mix_chunk", lambda *task: pytest.fail("built in pieces"))
    index = _build(root, tmp_path / "cache", monkeypatch, pieces=True)
    assert {s.id for s in index.samples} >= {"lj:L0000", "lj:L0001", "lj:L0002"}


@pytest.mark.timeout(60)
def test_a_mix_with_a_clip_without_duration_takes_the_one_process_build(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece that meets a clip without a duration hands the mix back to the one-process build,
    which reads its header (as a manifest's alone)."""
    root = tmp_path / "data"
    _mix(root)
    make_dataset(root / "lines", count=1, prefix="W")  # wavs/W0000.wav
    with open(root / "lines" / "train.jsonl", "ab") as f:
        f.write(b'\n{"audio_filepath": "wavs/W0000.wav", "id": "measured", "text": "its header read"}\n')
    one = _build(root, tmp_path / "one", monkeypatch, pieces=False)
    tried = _build(root, tmp_path / "pieces", monkeypatch, pieces=True)
    assert tried.stats.headers_read == one.stats.headers_read == 1
    assert list(tried.samples) == list(one.samples) and tried.rejected == one.rejected
    assert any(s.id == "lines:measured" for s in one.samples)


@pytest.mark.timeout(60)
def test_a_mix_cache_of_the_earlier_key_is_rebuilt_once_with_a_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A cache file written when a mix was keyed by all its parts' bytes (no stamp, another
    SHA-256) is not misread: rebuilt once, saying so; the next build finds the new one."""
    root = tmp_path / "data"
    _mix(root)
    with monkeypatch.context() as m:
        m.setattr(Mix, "stamp", lambda *args: "")
        m.setattr(mix_pieces_module, "mix_digest", lambda *args: hashlib.sha256(b"all the parts' bytes"))
        old = _build(root, tmp_path / "cache", monkeypatch, pieces=True)
    with caplog.at_level(logging.INFO, logger="stoker.consumer.index"):
        new = _build(root, tmp_path / "cache", monkeypatch, pieces=True)
    assert new.stats.cache == "stale" and list(new.samples) == list(old.samples)
    assert sum("of an earlier key; rebuilding the index" in r.getMessage() for r in caplog.records) == 1
    assert _build(root, tmp_path / "cache", monkeypatch, pieces=True).stats.cache == "hit"
