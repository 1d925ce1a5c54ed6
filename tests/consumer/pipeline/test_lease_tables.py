"""What a lease carries for its clips: their reference clips (ref_mel)."""

from __future__ import annotations

from stoker.consumer.pipeline.lease_tables import ReferenceTable
from stoker.shared.dataset import Sample


def test_references_are_another_clip_of_the_same_speaker_fixed_per_epoch() -> None:
    samples = [Sample(f"A{i}", "x", 5, 50, 1.0, speaker="anna") for i in range(6)] + \
              [Sample(f"B{i}", "x", 5, 50, 1.0, speaker="bob") for i in range(3)] + \
              [Sample("C0", "x", 5, 50, 1.0, speaker="carl")]
    table = ReferenceTable(samples, seed=7)
    ids = [s.id for s in samples]
    speaker = {s.id: s.speaker for s in samples}
    first = table(0, ids)
    assert first == table(0, ids) == ReferenceTable(list(reversed(samples)), seed=7)(0, ids)  # a pure function
    assert table(0, ids[3:5]) == first[3:5]  # of each clip alone, not of its batch
    for sample_id, ref in zip(ids, first):
        assert speaker[ref] == speaker[sample_id]
        assert ref != sample_id or sample_id == "C0"  # only a speaker's single clip is its own reference
    epochs = [tuple(table(e, ids)) for e in range(6)]
    assert len(set(epochs)) > 1  # another epoch, other references
    assert ReferenceTable(samples, seed=8)(0, ids) != first
