"""The live progress line: one line rewritten in place on a terminal.

Shown only when stderr is a terminal, so log files (stderr redirected) get the periodic
progress records of the training loop and nothing else. Before any log record is
written the line is cleared, so records and the line never share a row.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

# Redraw at most this often: fast enough to look live, rare enough to cost nothing.
REDRAW_S = 0.5
# ANSI: carriage return, then erase to the end of the line.
CLEAR = "\r\x1b[K"


class LiveLine(logging.Filter):
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        super().__init__()
        self.stream = stream if stream is not None else sys.stderr
        try:
            tty = self.stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        self.enabled = tty if enabled is None else enabled
        self._last = 0.0
        self._shown = False
        self._handlers: list[logging.Handler] = []
        if self.enabled:
            for handler in logging.getLogger().handlers:
                handler.addFilter(self)
                self._handlers.append(handler)

    def filter(self, record: logging.LogRecord) -> bool:
        """Called before each log record is written: clear the line first."""
        self.clear()
        return True

    def due(self) -> bool:
        """Whether an update now would be drawn (so callers compose the text only then)."""
        return self.enabled and time.monotonic() - self._last >= REDRAW_S

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled or not (force or self.due()):
            return
        self._last = time.monotonic()
        self.stream.write(CLEAR + text)
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write(CLEAR)
            self.stream.flush()
            self._shown = False

    def close(self) -> None:
        self.clear()
        for handler in self._handlers:
            handler.removeFilter(self)
        self._handlers = []
