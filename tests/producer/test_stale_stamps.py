"""A producer on the trainer's host checks each file against the index's size and mtime, which
its lease carries (wire.Lease.stamps): a file rewritten since indexing, even at the same length,
is rejected naming it, not made into a batch with the index's facts of the old file."""

from __future__ import annotations

import os
from pathlib import Path

import soundfile

from stoker.producer.batches import BatchMaker
from stoker.shared import wire
from stoker.shared.config import DataConfig, FeaturesConfig
from stoker.consumer.index.index import build_index
from tests.factories import make_dataset

FEATURES = FeaturesConfig(backend="numpy")
SHAPE = (64, 160)  # (L, T): room for every clip of make_dataset


def _through_the_wire(lease: wire.Lease) -> wire.Lease:
    """The lease as a producer receives it."""
    return wire.Lease.from_header(wire.decode(lease.encode()).fields)


def test_a_file_rewritten_at_the_same_length_is_rejected_and_the_others_delivered(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    root = tmp_path / "data"
    ids = make_dataset(root, count=4)
    index = build_index(DataConfig(path=str(root)), FeaturesConfig())
    table = index.samples
    stamps = {s.id: (int(size), int(mtime)) for s, size, mtime in
              zip(table, table.column("file_size"), table.column("file_mtime_ns"))}
    wav = root / "wavs" / f"{ids[1]}.wav"
    audio, rate = soundfile.read(str(wav), dtype="int16")
    soundfile.write(str(wav), audio[::-1], rate, subtype="PCM_16")  # another take of the same length
    st = wav.stat()
    os.utime(wav, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # whatever the clock's grain
    assert wav.stat().st_size == stamps[ids[1]][0]
    lease = _through_the_wire(wire.Lease(1, 0, 0, tuple(ids), SHAPE, 4, tuple((2, 3, 1) for _ in ids),
                                         files={i: f"wavs/{i}.wav" for i in ids}, stamps=stamps))
    assert lease.stamps == stamps
    maker = BatchMaker(root, {i: "text" for i in ids}, FEATURES, None, "p0")
    batch = maker.make(lease).batch
    assert batch.ids == tuple(i for i in ids if i != ids[1]) and batch.missed == ()
    (rejected,) = batch.rejected
    assert rejected.id == ids[1]
    assert rejected.reason == (f"wavs/{ids[1]}.wav changed since the index was built (same size {st.st_size}, "
                               f"mtime {stamps[ids[1]][1]} -> {wav.stat().st_mtime_ns})")
