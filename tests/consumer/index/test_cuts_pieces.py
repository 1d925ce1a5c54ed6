"""A large lhotse cut manifest built in pieces (consumer/index/cuts_pieces.py: its gzip stream cut
into blocks of lines, each parsed in a helper, merged by chunked.py) is the index the one-process
build makes: the same samples, the same rejections with the same reasons and lines, the same
vocabulary and fingerprints, and a cache file of the same bytes."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.consumer.index.index import build_index
from stoker.consumer.index import cuts_pieces as cuts_pieces_module

FEATURES = FeaturesConfig()


def _cut(i: int, **changed: object) -> dict:
    """A MonoCut of a window of a recording (every third cut all of it), as lhotse writes it."""
    whole = i % 3 == 0
    start, duration = (0.0, 2.0) if whole else (0.25 * (i % 4), 0.5 + (i % 7) / 10)
    cut = {"id": f"cut-{i:03d}", "start": start, "duration": duration, "channel": 0,
           "supervisions": [{"id": f"s{i}", "recording_id": f"r{i % 5}", "start": 0.0, "duration": duration,
                             "text": f"clip number {i}, said.", "speaker": f"spk{i % 4}",
                             "language": "de" if i % 11 == 3 else "en"}],
           "recording": {"id": f"r{i % 5}", "sources": [{"type": "file", "channels": [0],
                                                         "source": f"audio/r{i % 5}.wav"}],
                         "sampling_rate": 16000, "num_samples": 32000, "duration": 2.0},
           "type": "MonoCut"}
    cut.update(changed)
    return cut


def _lines() -> list[bytes]:
    """A cut manifest's lines, good cuts and some of every fault, repeats within and across blocks."""
    rows = [json.dumps(_cut(i), ensure_ascii=i % 2 == 0).encode() + (b"\r\n" if i % 9 == 4 else b"\n")
            for i in range(60)]
    bad = {
        5: b'{"id": "broken", "start": 0\n',  # not JSON
        9: b'[1, 2]\n',  # not an object
        12: json.dumps(_cut(1)).encode() + b"\n",  # a repeat in the same block
        17: b'\n',  # blank
        20: json.dumps(_cut(70, id="snow", supervisions=[{"text": "\u2603\u2603 x"}])).encode() + b"\n",
        27: json.dumps(_cut(71, id="past", start=1.5, duration=1.0)).encode() + b"\n",  # beyond the recording
        31: json.dumps(_cut(72, id="silent", supervisions=[])).encode() + b"\n",  # no text
        33: json.dumps(_cut(73, id="norec", recording=None)).encode() + b"\n",
        38: json.dumps(_cut(74, id="many", supervisions=[{"text": "word " * 80}])).encode() + b"\n",
        44: json.dumps(_cut(40, supervisions=[{"text": "a later repeat"}])).encode() + b"\n",
        50: json.dumps(_cut(75, id="xx", supervisions=[{"text": "unknown", "language": "zz"}])).encode() + b"\n",
    }
    for at in sorted(bad, reverse=True):
        rows.insert(at, bad[at])
    rows.append(json.dumps(_cut(59, supervisions=[{"text": "the last, a repeat"}])).encode())
    return rows


def _build(root: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, chunked: bool, workers: int = 1,
           max_lost_frac: float = 0.0):
    monkeypatch.setattr(cuts_pieces_module, "CUTS_CHUNKED_MIN_BYTES", 1 if chunked else 1 << 40)
    monkeypatch.setattr(cuts_pieces_module, "BLOCK_BYTES", 2000)  # a few cuts a block
    data = DataConfig(path=str(root / "cuts.jsonl.gz"), index_cache=str(cache), index_workers=workers,
                      max_tokens=200)
    return build_index(data, FEATURES, TextConfig(max_lost_frac=max_lost_frac))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "max_lost_frac"), [(1, 0.0), (2, 0.0), (1, 0.7)])
def test_a_cut_manifest_built_in_pieces_is_the_one_process_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  workers: int, max_lost_frac: float) -> None:
    root = tmp_path / "data"
    root.mkdir()
    lines = b"".join(_lines())
    half = len(lines) // 2  # two gzip members, as a manifest written in two goes is
    (root / "cuts.jsonl.gz").write_bytes(gzip.compress(lines[:half]) + gzip.compress(lines[half:]))
    one = _build(root, tmp_path / "one", monkeypatch, chunked=False, max_lost_frac=max_lost_frac)
    assert one.stats.workers <= 1
    blocks, chunk = [], cuts_pieces_module.cuts_chunk

    def parsed(*task):  # each block removed once its piece is parsed
        piece = chunk(*task)
        assert not Path(task[0]).exists()
        blocks.append(task[1])
        return piece

    with monkeypatch.context() as m:  # the blocks this process parsed (all of them, without helpers)
        if workers == 1:
            m.setattr(cuts_pieces_module, "cuts_chunk", parsed)
        pieces = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, workers=workers,
                        max_lost_frac=max_lost_frac)
    assert pieces.stats.workers == workers and len(blocks) >= (10 if workers == 1 else 0)
    assert list(pieces.samples) == list(one.samples) and len(one.samples) > 40
    assert pieces.rejected == one.rejected
    reasons = " ".join(r.reason for r in one.rejected)
    for fault in ("is not JSON", "is not a JSON object", "duplicate cut id on cut manifest line", "beyond its "
                  "recording's end", "no supervision with text", "without a recording", "exceeds data.max_tokens",
                  "unknown language"):
        assert fault in reasons
    assert sum("duplicate cut id" in r.reason for r in one.rejected) == 3  # within a block and across blocks
    assert any(s.id == "snow" for s in one.samples) == (max_lost_frac > 0)
    assert pieces.lost == one.lost and one.lost["clips"] == 1
    assert pieces.vocabulary.state_dict() == one.vocabulary.state_dict()
    assert pieces.fingerprint == one.fingerprint and pieces.agreement == one.agreement
    (one_file,) = (tmp_path / "one").iterdir()
    (pieces_file,) = (tmp_path / "pieces").iterdir()  # the spilled blocks gone with the runs
    assert pieces_file.read_bytes() == one_file.read_bytes()
    warm = _build(root, tmp_path / "pieces", monkeypatch, chunked=True, max_lost_frac=max_lost_frac)
    assert warm.stats.cache == "hit" and list(warm.samples) == list(one.samples)


def test_the_blocks_end_at_line_ends_and_number_the_lines_as_one_read(tmp_path: Path) -> None:
    lines = [b"a" * n + end for n, end in zip(range(1, 200, 7), [b"\n", b"\r\n", b"\r", b"\n"] * 50)]
    lines.insert(10, b"x" * 500 + b"\n")  # a line longer than a block
    raw = b"".join(lines) + b"tail"
    (tmp_path / "cuts.jsonl.gz").write_bytes(gzip.compress(raw))
    blocks, sha256 = cuts_pieces_module._spilled_blocks(tmp_path / "cuts.jsonl.gz", tmp_path, 100)
    read = [(path.read_bytes(), first) for path, first in blocks]
    assert b"".join(block for block, _ in read) == raw and len(read) > 5
    assert all(block.endswith(b"\n") for block, _ in read[:-1])
    whole = raw.splitlines()
    for block, first in read:
        assert block.splitlines() == whole[first - 1:first - 1 + len(block.splitlines())]
    assert sha256 == hashlib.sha256(raw).hexdigest()


def test_a_block_removed_once_parsed_is_read_again_from_the_manifest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece worked again (a cache write retried, a helper lost) finds its block gone: its
    lines are read again from the manifest's stream, the same piece."""
    monkeypatch.setattr(cuts_pieces_module, "BLOCK_BYTES", 2000)
    lines = b"".join(_lines())
    (tmp_path / "cuts.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "spill").mkdir()
    data = DataConfig(path=str(tmp_path / "cuts.jsonl.gz"), max_tokens=200)
    tasks, _ = cuts_pieces_module.cuts_tasks(tmp_path / "cuts.jsonl.gz", tmp_path / "spill", data, FEATURES,
                                             TextConfig())
    assert len(tasks) > 1
    task = tasks[len(tasks) // 2]
    first = cuts_pieces_module.cuts_chunk(*task)
    assert not Path(task[0]).exists()
    again = cuts_pieces_module.cuts_chunk(*task)
    assert again["rejected"] == first["rejected"] and again["parsed"] == first["parsed"]
    assert all(again["strings"][name][1] == first["strings"][name][1] for name in first["strings"])
