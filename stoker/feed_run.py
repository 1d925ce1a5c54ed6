"""A ``stoker.Feed``'s run from start to stop, on the run service (stoker/service.py): the run
directory and its lock, the dataset indexed and the epochs planned (prepare), the run opened,
staged and its producers started (start), and the shutdown protocol (close); and the feed's
state, which a resume starts from. docs/FEED.md (Shutdown, Resume) is the user's side.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from . import service
from .consumer.feed.feed import FeedCore, PreparedRun
from .feed_staging import FeedError, make_staging
from .shared import config as config_mod
from .shared.proc import EXIT_FAILED, EXIT_INTERRUPTED
from .shared.runfiles import CONFIG, TRAINED_BY_FEED, clear_untrained, trained_nothing
from .shared.runlock import RunLock

log = logging.getLogger("stoker.feed")


class FeedRun:
    """One feed's run: not started, prepared (:meth:`prepare`), running (:meth:`start`), closed
    (:meth:`close`). ``at_exit``: what closes the feed when the interpreter exits with it open."""

    def __init__(self, cfg: config_mod.Config, framework: str, strategy: Any, sharding: Any,
                 resume: dict[str, Any] | None, at_exit: Callable[[], None]) -> None:
        self.cfg = cfg
        self.framework = framework
        self.strategy, self.sharding = strategy, sharding
        self.replicas = cfg.devices.replicas  # None: the loop's business (summary.json says null)
        self.resume = resume
        self.device = "host"  # where batches are staged, from start() on
        self.prepared: PreparedRun | None = None  # from prepare() on: the dataset indexed, the epochs planned
        self.core: FeedCore | None = None  # from start() on: the run opened (coordinator, queues, step logs)
        self.producers: service.BackgroundProducers | None = None  # from start() on: the run service's
        self.stop = threading.Event()
        self.closed = False
        self.started_once = False
        self.reused_dir = False
        self.run_lock: RunLock | None = None  # the run directory's, from prepare() to close()
        self.run_dir: Path | None = None
        self.endpoint = ""
        self._at_exit_close = at_exit

    def prepare(self) -> PreparedRun:
        """Check the options, make the run directory, index the dataset and plan the epochs,
        starting no process; the prepared run."""
        if self.prepared is not None:
            return self.prepared
        if self.closed:
            raise FeedError("this feed is closed; make a new stoker.Feed to train again")
        cfg, plan = service.prepare_run(self.cfg, trains_model=False)  # another framework's producers: backend numpy
        run_dir = self._run_dir(cfg)
        self.run_lock = RunLock.acquire(run_dir)  # before anything in the run directory is written; close() frees it
        try:
            if self.reused_dir and self.resume is None and trained_nothing(run_dir):
                # A start that failed (or a loop stopped before its first step) trained nothing: no rerun is refused.
                log.info("run directory %s held a run that trained no step; its files are replaced (%s)", run_dir,
                         ", ".join(clear_untrained(run_dir)))
                self.reused_dir = False
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
            self.cfg, self.run_dir, self.plan = cfg, run_dir, plan
            config_mod.save(cfg, run_dir / CONFIG)
            log.info("%s", plan.describe(cfg.pipeline.producers))
            log.info("run directory %s", run_dir)
            self.prepared = PreparedRun(cfg, run_dir, hold_out=True)  # trainer.val_clips / data.eval_file (FEED.md)
        except BaseException:
            self.run_lock.release()
            self.run_lock = None
            raise
        atexit.register(self._at_exit)
        return self.prepared

    def start(self) -> FeedCore:
        """Prepare, then start the producers and beside them bind, then stage; the open run."""
        if self.closed:
            raise FeedError("this feed is closed; make a new stoker.Feed to train again")
        prepared = self.prepare()
        if self.started_once:
            assert self.core is not None  # start() raised otherwise, or the feed is closed
            return self.core
        self.started_once = True
        if self.reused_dir and self.resume is None:
            self.started_once = False
            self.close()
            raise FeedError(f"run.run_dir: {self.run_dir} holds a run; choose another run directory, or continue it "
                            f"with resume=feed.state_dict() (or a restored feed.trackable())")
        try:
            assert self.run_dir is not None
            self.producers = service.producers_before_bind(self.cfg, self.plan, self.run_dir)
            self.core = core = FeedCore(prepared, self.stop, state=self.resume)
            self.endpoint = core.endpoint
            if self.producers is not None:
                self.producers.connect([self.endpoint])
            staging = make_staging(self.framework, self.cfg.devices, self.strategy, self.sharding)
            self.device = staging.device
            core.use_staging(staging)
            if self.producers is None:
                self.producers = service.start_producers(self.cfg, self.plan, self.endpoint, self.run_dir)
        except BaseException:
            self.close()
            raise
        return core

    def _run_dir(self, cfg: config_mod.Config) -> Path:
        """The run directory: a new one, or a stoker run directory to continue (its step logs
        go on; :meth:`start` refuses it unless the feed resumes, or its run trained no step)."""
        requested = service.job_run_dir(cfg.run.run_dir)  # each trainer worker's feed writes RUN_DIR/worker-N
        if requested:
            path = Path(requested).expanduser().resolve()
            if (path / CONFIG).is_file():
                self.reused_dir = True
                return path
        return service.make_run_dir(requested)

    def state_dict(self) -> dict[str, Any]:
        """The open run's state (FeedCore.state_dict), or before the start the state it resumes from."""
        if self.core is None or not self.started_once:
            if self.resume is not None:
                return self.resume
            raise FeedError("state_dict() before the feed started: nothing to save yet")
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state`` when the run starts."""
        if self.started_once:
            raise FeedError("load_state_dict() after the feed started: give resume=state to stoker.Feed, or "
                            "restore the checkpoint before the `with` block")
        self.resume = state

    def close(self, exc: BaseException | None = None, ended: bool = False, taken_by: str | None = None) -> None:
        """The shutdown protocol (close_core, then the producers joined and the lock freed); once."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.core is not None and self.core.opened:
                close_core(self.core, exc, ended, taken_by, self.replicas)
        finally:
            if self.producers is not None:
                self.producers.close()  # they were told STOP
                self.producers = None
            atexit.unregister(self._at_exit)
            if self.run_lock is not None:
                self.run_lock.release()
                self.run_lock = None

    def _at_exit(self) -> None:
        if not self.closed:
            log.warning("a stoker.Feed was never closed; closing it at exit (use `with stoker.Feed(...) as feed:` "
                        "or call feed.close())")
            self._at_exit_close()


def close_core(core: FeedCore, exc: BaseException | None, ended: bool, taken_by: str | None,
               replicas: int | None) -> None:
    """Close a feed's open run: its exit reason (``exc``: what ended the user's loop; ``ended``:
    the loop took every batch), the step logs and summary.json; a file it could not write
    is raised unless the loop's own exception is on its way."""
    if isinstance(exc, KeyboardInterrupt):
        core.exit_reason, core.code = "interrupted", EXIT_INTERRUPTED
    elif exc is not None:
        core.exit_reason, core.code = f"failed: {type(exc).__name__}: {exc}"[:500], EXIT_FAILED
    elif not ended and not core.finished():
        core.exit_reason = f"stopped by the training loop at step {core.step}"
    if taken_by == "as_dataset()" and not core.step and core.handed_steps:
        log.warning("%d batches went out through as_dataset() and no step was confirmed: pass "
                    "callbacks=[feed.callback()] to fit, or call feed.step_done() after each step of your "
                    "loop; the feed's state counts confirmed steps only", core.handed_steps)
    # The user's loop trains: its model, and its replicas (a tf.distribute strategy), are not the
    # feed's to know.
    core.close({"trained_by": TRAINED_BY_FEED, "model": None, "replicas": replicas})
    failure = core.files.failure()  # a file of the run it could not write while closing (a full disk)
    if failure is not None and exc is None:
        raise failure
