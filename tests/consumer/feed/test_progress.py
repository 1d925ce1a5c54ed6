"""The live progress line (consumer/feed/progress.py): only on a terminal, cleared before log records."""

from __future__ import annotations

import io
import logging

from stoker.consumer.feed.progress import CLEAR, LiveLine


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_is_written_when_not_a_terminal() -> None:
    stream = io.StringIO()
    line = LiveLine(stream)
    assert not line.enabled and not line.due()
    line.update("step 1", force=True)
    line.close()
    assert stream.getvalue() == ""


def test_terminal_line_is_rewritten_and_cleared_before_log_records() -> None:
    stream = _Tty()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        line = LiveLine(stream)
        line.update("step 1  loss 2.0", force=True)
        line.update("step 2  loss 1.9")  # within REDRAW_S of the last: not drawn
        logging.getLogger("x").warning("a record")
        line.update("step 3  loss 1.8", force=True)
        line.close()
    finally:
        root.removeHandler(handler)
    text = stream.getvalue()
    assert text == f"{CLEAR}step 1  loss 2.0{CLEAR}a record\n{CLEAR}step 3  loss 1.8{CLEAR}"
    assert handler.filters == []
