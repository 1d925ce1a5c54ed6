"""stoker's application layer: the command line, the launcher and its supervision of the
processes, the producer auto-scaler, device planning, ``diagnose``, ``watch``, and the
feed for the user's own training loop (``stoker.Feed``, stoker/feed.py).

It sits above the libraries it drives (``consumer/``, ``producer/``, ``shared/``): it
imports them, they never import it (tests/test_layers.py keeps it so). The processes it
starts are named by module (``python -m stoker.consumer.training.main``, ``python -m stoker.producer.worker``).

``import stoker`` is cheap: ``stoker.Feed`` and ``stoker.FeedError`` load stoker/feed.py
on first use, and TensorFlow is imported only when a feed starts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Feed", "FeedError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import feed  # on first use: `import stoker` stays cheap

        return getattr(feed, name)
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")
