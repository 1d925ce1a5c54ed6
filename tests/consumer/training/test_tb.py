"""TensorBoard events of a resumed run: what the crashed session wrote past the checkpoint goes."""

from __future__ import annotations

from pathlib import Path

from stoker.consumer.training.tb import TB_DIR, TensorBoard, trim_events


def write_steps(directory: Path, steps: range, tag: str = "train/loss") -> None:
    import tensorflow as tf

    writer = tf.summary.create_file_writer(str(directory))
    with writer.as_default():
        for step in steps:
            tf.summary.scalar(tag, float(step), step=step)
    writer.close()


def steps_in(directory: Path) -> list[int]:
    """The steps of the scalar events (not the file-version event) of every file, in order."""
    import tensorflow as tf

    steps = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
            event = tf.compat.v1.Event.FromString(record)
            if event.HasField("summary"):
                steps.append(event.step)
    return steps


def test_trim_drops_only_the_steps_after_the_checkpoint(tmp_path):
    import tensorflow as tf

    write_steps(tmp_path, range(1, 11))
    assert trim_events(tmp_path, 6) == 4
    assert steps_in(tmp_path) == [1, 2, 3, 4, 5, 6]
    # the file is still one TensorBoard reads: its version event leads it
    (path,) = tmp_path.glob("events.out.tfevents.*")
    first = tf.compat.v1.Event.FromString(next(tf.data.TFRecordDataset(str(path)).as_numpy_iterator()))
    assert first.file_version.startswith("brain.Event")


def test_trim_leaves_a_file_with_nothing_later_untouched(tmp_path):
    write_steps(tmp_path, range(1, 4))
    (path,) = tmp_path.glob("events.out.tfevents.*")
    before = path.stat().st_mtime_ns, path.read_bytes()
    assert trim_events(tmp_path, 3) == 0
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before
    assert not list(tmp_path.glob("*.tmp"))


def test_trim_drops_a_torn_last_record_and_keeps_the_rest(tmp_path):
    write_steps(tmp_path, range(1, 6))
    (path,) = tmp_path.glob("events.out.tfevents.*")
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the crash came in the middle of the last record
    assert trim_events(tmp_path, 100) == 0
    assert steps_in(tmp_path) == [1, 2, 3, 4]


def test_resumed_writer_goes_on_from_the_checkpoint(tmp_path):
    write_steps(tmp_path / TB_DIR, range(1, 9))  # the session that crashed after step 8
    tb = TensorBoard(tmp_path, resumed_step=5)
    tb.write(6, {"wait_frac": 0.1}, 1.0, alive=1)
    tb.close()
    # loss, wait share and producers alive at 6; the old file keeps 1..5
    assert sorted(steps_in(tmp_path / TB_DIR)) == [1, 2, 3, 4, 5, 6, 6, 6]


def scalars_in(directory: Path) -> dict[str, float]:
    """{tag: value} of the scalar events of every file, read with TensorFlow's own event records."""
    import tensorflow as tf

    found = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
            for value in tf.compat.v1.Event.FromString(record).summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    found[value.tag] = float(tf.make_ndarray(value.tensor))
    return found


def test_loss_terms_are_scalars_of_their_own(tmp_path):
    tb = TensorBoard(tmp_path)
    tb.write(1, {}, 1.5, alive=1, train={"loss/mel_l1": 1.25, "loss/stop": 0.25})
    tb.validation(1, 2.0, None, {"mel_l1": 1.75, "stop": 0.25})
    tb.close()
    scalars = scalars_in(tmp_path / TB_DIR)
    assert {tag: scalars[tag] for tag in ("train/loss", "train/loss/mel_l1", "train/loss/stop", "val/loss",
                                          "val/loss/mel_l1", "val/loss/stop")} == {
        "train/loss": 1.5, "train/loss/mel_l1": 1.25, "train/loss/stop": 0.25, "val/loss": 2.0,
        "val/loss/mel_l1": 1.75, "val/loss/stop": 0.25}
