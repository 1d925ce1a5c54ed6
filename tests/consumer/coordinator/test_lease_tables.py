"""What a lease carries for its clips: their reference clips (ref_mel) and their positions in the run's clip list."""

from __future__ import annotations

from stoker.consumer.coordinator.lease_tables import ReferenceTable, TokenTable
from stoker.consumer.coordinator.leases import Lease, LeaseWriter
from stoker.consumer.plan import PlannedBatch
from stoker.shared.dataset.table import SampleTable
from stoker.shared.dataset.types import Sample
from stoker.shared.vocab import Vocabulary


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


def test_a_lease_carries_each_clips_position_in_the_index_through_a_hold_out_view() -> None:
    index = SampleTable.from_samples([Sample(f"c{i}", "ab", 3, 50, 1.0, units="ab") for i in range(6)])
    train = index.take([0, 2, 3, 5])  # c1 and c4 held out
    vocab = Vocabulary("characters", ("<pad>", "<eos>", "a", "b"), 4, {})
    tokens = TokenTable(train, vocab)
    assert tokens.lease_fields(["c5", "c2"])["positions"] == (5, 2)
    assert tokens.lease_fields(["c5", "c2"], [3, 1])["positions"] == (5, 2)  # from the plan's rows
    held = TokenTable([index[1], index[4]], vocab, positions=[1, 4])  # a list of the held-out clips
    assert held.lease_fields(["c4"])["positions"] == (4,)
    batch = Lease(1, PlannedBatch(0, 0, 0, ("c3", "c0"), (8, 64), 2), b"p")
    assert LeaseWriter(tokens, None, None, None, positions=True).message(batch, False).positions == (3, 0)
    assert LeaseWriter(tokens, None, None, None).message(batch, False).positions == ()  # the clip field off
