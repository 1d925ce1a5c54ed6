"""The one base class of errors a user causes and can fix.

Its message is one line, shown as it is (``stoker: error: ...``), with no traceback: a bad
flag or config key, a dataset that cannot be used, a model that breaks its contract, a
checkpoint of another plan. Each part of stoker raises its own subclass (ConfigError,
DatasetError, ModelError, ...); entry points catch this base, not a list of them. A
failure of stoker itself is not one of these: it keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; ``str(exc)`` is the one line to show."""
