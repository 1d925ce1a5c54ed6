"""The scheduler as a pure state machine: events in (a producer's messages, a free slot, the
clock, connection events), messages out. No sockets, no threads, no timeouts: time is the
number each event carries. Here joining, liveness and validation passes; its leases, credits
and re-planning in test_leases.py, test_credits.py and test_replan.py."""

from __future__ import annotations

import collections

import msgpack
import numpy as np

from stoker.consumer.coordinator.peers import DISCONNECT_GRACE_S
from stoker.consumer.plan import EpochPlanner, validation_batches
from stoker.shared import wire
from stoker.shared.dataset.agreement import deferred
from stoker.shared.dataset.types import Sample
from tests.consumer.harness import lacking, make_config, samples
from tests.consumer.coordinator.scheduler_bench import IDS, Bench
from tests.factories import copy_described, fake_reference, fake_sha256


def test_hello_gets_welcome_and_lease_ahead_leases() -> None:
    b = Bench()
    b.hello(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)
    assert welcome.producer_name == "p1" and welcome.config.features.n_mels == 8
    leases = b.take(b"p1", wire.LEASE)
    assert len(leases) == 2 and leases[0].lease != leases[1].lease


def test_a_silent_producer_is_presumed_dead_after_the_heartbeat_timeout_and_its_work_moves() -> None:
    b = Bench()
    b.hello(b"silent")
    held = {i for m in b.take(b"silent", wire.LEASE) for i in m.ids}
    b.hello(b"alive")
    b.tick(0.5)
    b.send(b"alive", wire.Heartbeat())
    b.tick(0.6)  # 1.1 s since "silent" spoke: past heartbeat_timeout_s=1.0
    assert [p["status"] for p in b.scheduler.snapshot()["producers"]] == ["dead", "alive"]
    trained = []
    for _ in range(20):
        b.work(b"alive")
        trained += b.drain_queue()
    assert held <= set(trained) and sorted(trained) == sorted(IDS)  # its work moved, nothing twice


def test_heartbeats_go_out_every_interval_and_a_ping_is_answered() -> None:
    b = Bench()
    b.hello(b"p1")
    b.tick(0.1)
    assert b.take(b"p1", wire.HEARTBEAT) == []
    b.tick(0.15)  # 0.25 s: past heartbeat_interval_s=0.2
    assert len(b.take(b"p1", wire.HEARTBEAT)) == 1
    b.send(b"p1", wire.Heartbeat(ping=7.5))
    pong, = b.take(b"p1", wire.HEARTBEAT)
    assert pong.pong == 7.5


def test_garbage_and_strangers_are_counted_and_a_stranger_is_asked_to_rejoin_once_a_second() -> None:
    b = Bench()
    rng = np.random.default_rng(0)
    for _ in range(200):
        b.scheduler.on_message(b"x", [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 3)))],
                               b.now)
    b.send(b"stranger", wire.Heartbeat())
    b.send(b"stranger", wire.Heartbeat())
    assert len(b.take(b"stranger", wire.REFUSE)) == 1
    b.tick(1.0)
    b.send(b"stranger", wire.Heartbeat())
    refuse, = b.take(b"stranger", wire.REFUSE)
    assert refuse.rejoin is True
    assert sum(b.scheduler.snapshot()["rejected_messages"].values()) == 203


def test_a_closed_connection_means_dead_unless_a_new_one_takes_its_descriptor() -> None:
    b = Bench()
    b.hello(b"p1", fd=7)
    b.hello(b"p2", fd=8)
    b.scheduler.on_connection_closed(7, b.now)
    b.scheduler.on_connection_accepted(7)  # the close was of an older connection: p1 is on the new one
    b.scheduler.on_connection_closed(8, b.now)
    b.tick(DISCONNECT_GRACE_S + 0.01)
    status = {p["id"]: p["status"] for p in b.scheduler.snapshot()["producers"]}
    assert status == {"p1": "alive", "p2": "dead"}
    assert b.scheduler.snapshot()["rejected_messages"]["connection_dropped"] == 2


def test_stop_says_stop_to_every_producer_and_names_those_on_a_connection() -> None:
    b = Bench()
    b.hello(b"p1", fd=3)
    b.hello(b"p2")
    b.hello(b"p3", fd=4)
    b.scheduler.on_connection_closed(4, b.now)  # held against p3 for the grace: no BYE can come on it
    assert b.scheduler.stop() == [b"p1"]
    b._collect()
    assert all(len(b.take(p, wire.STOP)) == 1 for p in (b"p1", b"p2", b"p3"))
    assert {p["status"] for p in b.scheduler.snapshot()["producers"]} == {"stopped"}


def test_a_producer_with_another_dataset_is_refused_with_the_reason_and_given_nothing() -> None:
    b = Bench(dataset=fake_reference())
    b.hello(b"stranger", dataset=copy_described(fake_sha256("another dataset")))
    refuse, = b.take(b"stranger", wire.REFUSE)
    assert refuse.reason == (f"dataset on test does not match the trainer's: metadata.csv differs (SHA-256 "
                             f"{fake_sha256('another dataset')[:16]} there, {fake_sha256('trainer')[:16]} on the "
                             "trainer); point --data at a copy of the trainer's dataset")
    assert b.inbox[b"stranger"] == []  # no WELCOME, no lease
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "stranger", "host": "test", "reason": refuse.reason}]
    assert snap["producers"] == []


def test_a_copy_of_the_trainers_metadata_joins_and_a_clip_it_misses_is_trained_by_another_once() -> None:
    b = Bench(dataset=fake_reference(), max_epochs=2)
    b.hello(b"remote", dataset=copy_described())
    b.hello(b"local", dataset=deferred("metadata.csv"))
    assert b.take(b"remote", wire.WELCOME) and b.take(b"local", wire.WELCOME)
    gone = sorted(IDS)[0]  # absent on the remote host, or of another size there: missed when read
    trained: list[str] = []
    for _ in range(50):
        b.work(b"remote", missing={gone})
        b.work(b"local")
        trained += b.drain_queue()
    assert collections.Counter(trained) == collections.Counter(sorted(IDS) * 2)  # each clip once an epoch
    producers = {p["id"]: p for p in b.scheduler.snapshot()["producers"]}
    assert producers["remote"]["lacks"] == 1 and producers["remote"]["misses"] == 1  # not leased it again
    assert producers["local"]["lacks"] == 0 and b.rejected == []


def test_a_hello_of_the_previous_protocol_version_is_refused_in_that_version() -> None:
    """What a producer of version 3 sends; it reads the REFUSE, whose layout is every version's."""
    b = Bench()
    old = wire.PROTOCOL_VERSION - 1
    b.send_frames(b"old", [msgpack.packb({"v": old, "k": "hello", "a": [], "producer": "p0", "host": "h3", "pid": 9,
                                          "dataset": {}}, use_bin_type=True)])
    (frames,) = b.frames[b"old"]
    header = msgpack.unpackb(frames[0], raw=False)
    reason = (f"the producer speaks protocol version {old} and the trainer {wire.PROTOCOL_VERSION}: run the "
              "trainer's stoker version on host h3")
    assert header == {"v": old, "k": "refuse", "a": [], "reason": reason} and len(frames) == 1
    assert b.inbox[b"old"] == []  # no WELCOME, no lease
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "p0", "host": "h3", "reason": reason}]
    assert snap["producers"] == [] and snap["rejected_messages"] == {"bad_version": 1}
    b.hello(b"p1")  # a producer of this version joins as ever
    assert len(b.take(b"p1", wire.WELCOME)) == 1


def test_a_producer_lacking_a_config_key_the_trainer_sends_is_refused_naming_it() -> None:
    b = Bench()
    b.hello(b"old", config=lacking("transforms", "mel_norm"))
    refuse, = b.take(b"old", wire.REFUSE)
    assert refuse.reason == ("the producer's config schema differs from the trainer's (it lacks the config keys "
                             "transforms.mel_norm): run the trainer's stoker version on host test")
    assert b.inbox[b"old"] == []
    snap = b.scheduler.snapshot()
    assert snap["refused_producers"] == [{"producer": "old", "host": "test", "reason": refuse.reason}]
    assert snap["producers"] == [] and snap["rejected_messages"] == {}
    b.hello(b"other", config=wire.ConfigSchema(wire.CONFIG_VERSION + 1, wire.ConfigSchema.local().sections))
    refuse, = b.take(b"other", wire.REFUSE)
    assert f"config version {wire.CONFIG_VERSION + 1} here and {wire.CONFIG_VERSION} on the trainer" in refuse.reason


def test_the_welcome_carries_the_trainers_config_sections_as_they_are() -> None:
    b = Bench()
    b.hello(b"p1")
    welcome, = b.take(b"p1", wire.WELCOME)
    cfg = b.cfg
    assert welcome.config == wire.ProducerConfig(cfg.features, cfg.transforms, cfg.faults)
    assert (welcome.heartbeat_interval_s, welcome.ref_frames) == (cfg.pipeline.heartbeat_interval_s,
                                                                  cfg.batching.ref_frames)


def test_a_repeated_hello_of_one_session_is_welcomed_again_and_changes_nothing() -> None:
    b = Bench()
    b.hello(b"p", session="s1")
    b.take(b"p", wire.WELCOME)
    assert len(b.take(b"p", wire.LEASE)) == 2
    b.hello(b"p", session="s1")  # a retry that crossed the WELCOME
    assert len(b.take(b"p", wire.WELCOME)) == 1 and b.inbox[b"p"] == []  # no new lease, nothing re-planned
    snap = b.scheduler.snapshot()
    assert snap["reissued_leases"] == 0 and snap["producers"][0]["connections"] == 1


# Held-out clips: five fit the training buckets (L 8, T 32), V005 is longer, V006 has more tokens.
HELD = [Sample(f"V{i:03d}", "text", 4 + i, 18 + 3 * i, 0.5) for i in range(5)] + [
    Sample("V005", "text", 6, 40, 0.5), Sample("V006", "text", 12, 20, 0.5)]


def test_validation_batches_take_the_smallest_training_shape_that_holds_each_clip() -> None:
    planner = EpochPlanner(samples(12), make_config().batching)
    batches = validation_batches(HELD, planner)
    assert sorted(i for b in batches for i in b.ids) == [s.id for s in HELD]
    by_id = {s.id: s for s in HELD}
    for b in batches:
        fits = [s for s in planner.shapes if all(by_id[i].num_frames <= s[2] and by_id[i].num_tokens <= s[1]
                                                 for i in b.ids)]
        if fits:  # the smallest training shape that holds every clip of the batch, its rows the clips'
            smallest = min(fits, key=lambda s: (s[2], s[1]))
            assert b.shape == smallest[1:] and b.rows == len(b.ids) <= smallest[0]
        else:  # clips no training bucket holds: buckets of their own, each clip within its shape
            assert set(b.ids) <= {"V005", "V006"} and b.shape not in [s[1:] for s in planner.shapes]
            assert all(by_id[i].num_frames <= b.shape[1] and by_id[i].num_tokens <= b.shape[0] for i in b.ids)
    assert [b.index for b in batches] == list(range(len(batches))) and {b.epoch for b in batches} == {0}
    assert validation_batches(list(reversed(HELD)), planner) == batches  # the same plan at every pass


def test_a_validation_pass_gives_every_held_out_clip_once_beside_a_full_training_queue_and_a_dying_producer():
    b = Bench(held=HELD, max_epochs=2, buffer_size=2, lease_ahead=2)
    b.hello(b"p1")
    b.hello(b"p2")
    while b.work(b"p1") + b.work(b"p2"):  # the training queue fills; the trainer, validating, takes none
        pass
    training = {lease.id: lease.batch for lease in b.scheduler.leases}
    queued = b.queue.positions()
    assert len(queued) == 2 and len(training) == 4  # both producers' slots hold ready batches, no credit
    for number in (1, 2):
        b.scheduler.start_validation(number, b.now)
        b._collect()
        got: list = []
        if number == 1:  # p2 delivers all but one of its validation batches and dies holding that one, credited
            leases = b.take(b"p2", wire.LEASE)
            assert leases and all(m.epoch == -1 for m in leases)  # slots beside its training ones
            for lease in leases:
                b.send(b"p2", wire.Ready(lease.lease))
            assert len(b.take(b"p2", wire.CREDIT)) == len(leases)  # credits of the validation queue, not the full one
            for lease in leases[:-1]:
                b.deliver(b"p2", lease)
            got += b.take_items(b.val_queue)
            b.send(b"p2", wire.Bye())
        while b.scheduler.validation_finished < number:
            assert b.work(b"p1"), "the pass stalled"
            got += b.take_items(b.val_queue)
        assert {item.epoch for item in got} == {-number}
        assert sorted(i for item in got for i in item.ids) == sorted(s.id for s in HELD)  # each once per pass
        assert b.queue.positions() == queued  # no validation batch in the training queue, none taken from it
        p1 = [b.scheduler.leases[i] for i in b.scheduler.peers.live[b"p1"].leases]
        assert all(training[lease.id] == lease.batch for lease in p1 if lease.batch.epoch >= 0)  # untouched
        assert not [m for m in b.take(b"p1", wire.REVOKE) if m.lease in training]
    trained = b.drain_queue()
    while b.work(b"p1"):
        trained += b.drain_queue()
    assert sorted(trained) == sorted([*IDS, *IDS])  # training: every clip once per epoch, no held-out one
    assert not b.rejected and b.scheduler.figures.reissued > 0


def test_a_validation_pass_left_early_stops_leasing_and_the_next_one_is_whole() -> None:
    b = Bench(held=HELD, max_epochs=0)
    b.hello(b"p1")
    b.scheduler.start_validation(1, b.now)
    b._collect()
    b.work(b"p1")  # two validation batches made and queued, more leased
    b.scheduler.cancel_validation(1, b.now)
    b._collect()
    assert b.take(b"p1", wire.REVOKE) and b.scheduler.validation_finished == 1
    assert all(lease.state == "credited" for lease in b.scheduler.leases)
    got = b.take_items(b.val_queue)  # the trainer skips what is left of pass 1
    b.scheduler.start_validation(2, b.now)
    b._collect()
    while b.scheduler.validation_finished < 2:
        assert b.work(b"p1"), "the pass stalled"
        got += b.take_items(b.val_queue)
    assert {item.epoch for item in got} == {-1, -2}
    assert sorted(i for item in got if item.epoch == -2 for i in item.ids) == sorted(s.id for s in HELD)


def test_a_held_out_clip_every_producer_lacks_leaves_the_pass_which_still_ends() -> None:
    b = Bench(held=HELD, max_epochs=0)
    b.hello(b"p1")
    b.scheduler.start_validation(1, b.now)
    b._collect()
    got = []
    while b.scheduler.validation_finished < 1:
        assert b.work(b"p1", missing={"V002"}), "the pass stalled"
        got += b.take_items(b.val_queue)
    assert sorted(i for item in got for i in item.ids) == sorted(s.id for s in HELD if s.id != "V002")
    assert [r.id for r in b.rejected] == ["V002"] and b.scheduler.rejected_in_epoch(0) == 0
