"""The index build's reads shared out (consumer/index/parallel.py): helper processes only when the
work would outlast starting them, a helper's read retries counted in this process, and a pool that
cannot take the work leaving it to this one."""

from __future__ import annotations

import os

import pytest

from stoker.consumer.index import parallel as parallel_module
from stoker.consumer.index.parallel import PARALLEL_MIN_SECONDS, PHONEMES_S, TEXT_S, WAV_HEADER_S
from stoker.shared.dataset.storage import COUNTS


def _retried(n: int) -> tuple[int, int]:
    """A task whose reads were retried ``n`` times (counted as storage.RetryingFile counts them), in
    whichever process works it."""
    COUNTS.retries += n
    return os.getpid(), n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("here", [True, False])
def test_reads_retried_in_a_helper_process_count_in_this_one(here: bool) -> None:
    before = COUNTS.retries
    tasks = [(n,) for n in range(1, 21)]
    results, processes = parallel_module.shared_work(_retried, tasks, 1, "a test's work", here=here)
    assert processes == 1 + here and [n for _, n in results] == list(range(1, 21))
    helped = [pid != os.getpid() for pid, _ in results]
    assert any(helped) if here else all(helped)  # not here: this process only takes the results in
    assert COUNTS.retries - before == sum(range(1, 21))  # each retry once, wherever it was made


@pytest.mark.timeout(60)
@pytest.mark.parametrize("here", [True, False])
def test_a_pool_that_cannot_take_the_work_leaves_it_to_this_process(here: bool,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    tasks = [(n,) for n in range(5)]
    results, processes = parallel_module.shared_work(lambda n: n * n, tasks, 1, "a test's work", here=here)
    assert results == [n * n for n in range(5)] and processes == 1  # a lambda cannot go to a helper
    assert "parallel a test's work failed" in caplog.text


def test_parallel_only_when_the_work_outlasts_starting_a_helper() -> None:
    wavs = [(f"{i}.wav", 1000, "some text") for i in range(20_000)]
    assert parallel_module._estimated_seconds(wavs, TEXT_S) == pytest.approx(20_000 * (WAV_HEADER_S + TEXT_S))
    # LJSpeech-sized: one process
    assert parallel_module._estimated_seconds(wavs, TEXT_S) < PARALLEL_MIN_SECONDS
    # the same texts through the phonemizer are worth spreading over the cores
    assert parallel_module._estimated_seconds(wavs, PHONEMES_S) > PARALLEL_MIN_SECONDS
    flacs = [(f"{i}.flac", 1000, None) for i in range(20_000)]
    assert parallel_module._estimated_seconds(flacs, TEXT_S) > PARALLEL_MIN_SECONDS
