"""A ``stoker.Feed``'s options: its keyword options, ``set=`` and ``config=`` as one resolved
config, each mistake one FeedError line. docs/FEED.md, Options, is the user's side.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from . import service
from .feed_staging import FeedError
from .shared import config as config_mod

# Options of python run.py that are not the feed's, and why.
NOT_FEED_OPTIONS = {"model": "it sets trainer.model, stoker's trainer's; the feed trains no model: your loop does"}
# The feed's keyword options and the config key each one sets: python run.py's long option
# names (service.KEY_NAMES), as docs/FEED.md lists them. Any other config key goes through set=.
OPTION_KEYS = {name: key for key, name in service.KEY_NAMES.items() if name not in NOT_FEED_OPTIONS}


def feed_overrides(options: Mapping[str, Any], sets: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys a feed's keyword ``options`` (OPTION_KEYS; None: not given) and its
    ``set=`` give, ``set=`` last; FeedError (one line) for an option that is not the feed's."""
    given: dict[str, Any] = {}
    for name, value in options.items():
        if name in NOT_FEED_OPTIONS:
            raise FeedError(f"stoker.Feed: option {name!r} is not the feed's ({NOT_FEED_OPTIONS[name]})")
        if name not in OPTION_KEYS:
            raise FeedError(f"stoker.Feed: unknown option {name!r}; the options are {', '.join(sorted(OPTION_KEYS))} "
                            f"(and config=, set= for any config key, resume=, framework=, strategy=, sharding=)")
        if value is not None:
            given[OPTION_KEYS[name]] = value
    producers = given.get("pipeline.producers")
    if producers is not None and (isinstance(producers, bool) or not isinstance(producers, (int, str))):
        raise FeedError(f"stoker.Feed: producers (pipeline.producers) must be a number or 'auto', got {producers!r}")
    given.update({str(key): value for key, value in sets.items()})
    return given


def feed_config(config: str | os.PathLike[str] | None, sets: Mapping[str, Any], options: Mapping[str, Any],
                framework: str | None, strategy: Any) -> config_mod.Config:
    """A feed's config: the YAML file ``config``, then its keyword ``options`` and ``set=``
    (:func:`feed_overrides`), ``framework=`` and the replicas of ``strategy``; FeedError (one
    line) for each mistake."""
    given = feed_overrides(options, sets)
    if strategy is not None:
        replicas = len(strategy.extended.worker_devices)  # this worker's (all of them but on several workers)
        if given.get("devices.replicas") not in (None, replicas):
            raise FeedError(f"stoker.Feed: devices.replicas is {given['devices.replicas']}, but the strategy has "
                            f"{replicas}")
        given["devices.replicas"] = replicas
    if framework is not None:
        if given.get("trainer.framework", framework) != framework:
            raise FeedError(f"stoker.Feed: framework={framework!r}, but set= has trainer.framework="
                            f"{given['trainer.framework']!r}")
        given["trainer.framework"] = framework
    try:
        return service.resolve(config, given)
    except config_mod.ConfigError as exc:
        raise FeedError(f"stoker.Feed: {exc}") from None
