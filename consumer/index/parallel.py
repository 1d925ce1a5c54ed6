"""The index build's reads, shared out: audio headers and texts through the front-end as work
items, done in spawned helper processes when the work would outlast starting them, each
helper's read retries counted with this process's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ...shared.config import DataConfig
from ...shared.dataset.probe import probe_audio
from ...shared.dataset.corpus.address import File, address_of
from ...shared.dataset.shards import probe_member
from ...shared.dataset.storage import COUNTS
from ...shared.dataset.types import AudioProbe
from ...shared.text import Frontend, TextError, make_frontend

log = logging.getLogger(__name__)


# Header reads are shared with spawned helper processes only when the work would take
# this long in one process: a helper needs ~0.5 s to start (a fresh interpreter importing
# numpy and this package), so shorter work is done sooner alone.
PARALLEL_MIN_SECONDS = 2.0


# Estimated cost of one item, to apply that rule before reading anything (measured on a
# 2-core VM): a WAV header walk, a libsndfile header read, a FLAC header plus the decode
# of its last block, and one text's tokenization.
WAV_HEADER_S = 50e-6


OTHER_HEADER_S = 100e-6


FLAC_HEADER_S = 400e-6


TEXT_S = 10e-6


PHONEMES_S = 400e-6  # one sentence through espeak-ng


# Headers per task handed to a worker: large enough to amortise the task overhead,
# small enough that the last tasks balance the load.
CHUNK_ITEMS = 1000


# Texts through the phonemizer cost ~8x a header: smaller chunks, so the last ones still balance.
PHONEME_CHUNK_ITEMS = 250


def probe_tuple(p: AudioProbe) -> tuple[int, int, int, str, str]:
    return tuple(p)  # type: ignore[return-value]


# A text work item: (language, text); its result: (units, lost characters).
TextKey = tuple[str, str]


Item = tuple["str | None", int, "TextKey | None"]


_FRONTENDS: dict[tuple[str, str], Frontend] = {}  # per process: a phonemizer backend is set up once


def frontend_of(spec: tuple[str, str], fresh: bool = False) -> Frontend:
    """The front-end of ``spec`` (text.frontend, text.digits), made once per process and again when
    its code changed; a user tokenizer again when ``fresh`` (an index build's start: the files its
    factory reads may have changed, and with them its ids and the cache key)."""
    frontend = _FRONTENDS.get(spec)
    if frontend is None or frontend.changed() or (fresh and frontend.is_user()):
        frontend = _FRONTENDS[spec] = make_frontend(*spec)
    return frontend


def _work_items(root: str, items: Sequence[Item], text_spec: tuple[str, str]) -> list[tuple[tuple | None,
                                                                                               tuple | None]]:
    """Read headers and make units: [(audio name or None, its size, (language, text) or None)]
    -> [(probe, (units, lost))].

    Runs in worker processes (so it takes and returns plain tuples) and in-process. Texts
    go to the front-end one list per language (a phonemizer call has a set-up cost).
    """
    join = os.path.join
    probes = [probe_tuple(probe_member(Path(root), name) if not isinstance(address_of(name), File)
                           else probe_audio(join(root, name), size))
              if name is not None else None for name, size, _ in items]
    by_language: dict[str, list[int]] = collections.defaultdict(list)
    for n, (_, _, key) in enumerate(items):
        if key is not None:
            by_language[key[0]].append(n)
    units: list[tuple | None] = [None] * len(items)
    if by_language:
        frontend = frontend_of(text_spec)
        for code, positions in by_language.items():
            made = frontend.units([items[n][2][1] for n in positions], code)  # type: ignore[index]
            for n, u in zip(positions, made):
                units[n] = (u.units, u.lost)
    return list(zip(probes, units))


def _estimated_seconds(items: Sequence[Item], text_s: float) -> float:
    """What :func:`_work_items` would take in one process, from the file suffixes alone."""
    total = 0.0
    for name, _, text in items:
        if name is not None:
            suffix = name.rpartition(".")[2].lower()
            total += WAV_HEADER_S if suffix == "wav" else FLAC_HEADER_S if suffix == "flac" else OTHER_HEADER_S
        if text is not None:
            total += text_s
    return total


def run_items(root: Path, items: list[Item], workers: int,
              text_spec: tuple[str, str]) -> tuple[list[tuple[tuple | None, tuple | None]], int]:
    """:func:`_work_items` over all items, in ``workers`` processes (this one included)."""
    text_s = PHONEMES_S if text_spec[0] == "phonemes" else TEXT_S
    if workers <= 1 or len(items) < 2 or _estimated_seconds(items, text_s) < PARALLEL_MIN_SECONDS:
        return _work_items(str(root), items, text_spec), 1
    size = PHONEME_CHUNK_ITEMS if text_spec[0] == "phonemes" else CHUNK_ITEMS
    tasks = [(str(root), items[i:i + size], text_spec) for i in range(0, len(items), size)]
    results, processes = shared_work(_work_items, tasks, workers - 1, "header reading")
    return [item for chunk in results for item in chunk], processes


def shared_work(fn: Callable[..., Any], tasks: Sequence[tuple], helpers: int, what: str,
                here: bool = True) -> tuple[list[Any], int]:
    """``[fn(*task) for task in tasks]``, in order, worked by up to ``helpers`` spawned processes
    (never forked: the caller may have imported TensorFlow), and by this one where ``here``: the
    helpers take tasks from the front while this process works from the back. Not ``here``
    (results of megabytes each): this process only takes the results in, at once, so that a
    helper never waits in a full pipe for this process to finish a task of its own. A broken
    pool (e.g. a script without a __main__ guard) must not stop the work: the rest is done here,
    logged; a TextError (the front-end itself failed, as it would here) is raised. Returns the
    results and how many processes worked."""
    results: list[Any] = [None] * len(tasks)
    done = [False] * len(tasks)
    helpers = min(helpers, len(tasks) - here) if len(tasks) > 1 else 0
    if helpers > 0:
        todo = collections.deque(range(len(tasks)))
        context = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(helpers, mp_context=context) as pool:
                running: dict[concurrent.futures.Future, int] = {}

                def top_up() -> None:
                    while todo and len(running) < 2 * helpers:
                        n = todo.popleft()
                        running[pool.submit(_counted, fn, *tasks[n])] = n

                def take(future: concurrent.futures.Future) -> None:
                    m = running.pop(future)
                    results[m], retries = future.result()
                    done[m] = True
                    COUNTS.retries += retries  # a helper's reads retried, counted as this process's

                top_up()
                while todo or running:
                    if here and todo:
                        n = todo.pop()
                        results[n], done[n] = fn(*tasks[n]), True
                        finished = [f for f in running if f.done()]
                    else:
                        finished = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED).done
                    for future in finished:
                        take(future)
                    top_up()
        except TextError:
            raise
        except Exception as exc:  # any failure of the pool itself; the work is redone here
            log.warning("parallel %s failed (%s: %s); doing the rest in this process", what,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            helpers = 0
    for n, finished in enumerate(done):
        if not finished:
            results[n] = fn(*tasks[n])
    return results, helpers + here if helpers else 1


def _counted(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` in a helper process, with the read retries it made there (storage.COUNTS),
    for :func:`shared_work` to add to this process's count."""
    before = COUNTS.retries
    result = fn(*args)
    return result, COUNTS.retries - before


def index_workers(data: DataConfig) -> int:
    if data.index_workers > 0:
        return data.index_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1

