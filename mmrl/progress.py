"""mmrl's progress bars: tqdm on a terminal; elsewhere (a log file, a pipe, a job's captured
stderr) one plain log line per interval, never a carriage return or a cursor code.

Every bar mmrl draws is a `ProgressBar` (tqdm's arguments). Whether its output goes to a
terminal is decided once, from its `file` (default: `sys.stderr`, looked up when the bar is
made). Off a terminal the bar writes nothing itself: it logs its state (`mmrl.progress`, INFO)
when it starts, at most once every `LOG_INTERVAL_S` seconds while it moves, and when it closes,
with tqdm's counts, elapsed time, ETA and postfix (`warm-up: 40% 600/1500 [02:10<03:15, ...]`).
`disable=None` keeps tqdm's meaning: no bar at all off a terminal.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 30.0
"""Off a terminal: at most one line per this many seconds (besides the first and the last)."""


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _Discard:
    """Where an off-terminal bar's own writes go (tqdm still writes its clears and newlines)."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class ProgressBar(tqdm):
    """tqdm on a terminal; off one, one log line per `LOG_INTERVAL_S` (see module docs)."""

    def __init__(self, *args, **kwargs):
        stream = kwargs.get("file") or sys.stderr
        self._plain = not is_terminal(stream)
        self._logged_at: float | None = None
        self._logged_n: float | None = None
        if self._plain:
            if kwargs.get("disable", False) is None:  # tqdm's "only on a terminal"
                kwargs["disable"] = True
            kwargs.setdefault("miniters", 1)  # (tqdm's adaptive count stretches the interval)
            kwargs.update(
                file=_Discard(),
                ncols=0,  # counts, times and postfix; no bar
                dynamic_ncols=False,
                mininterval=LOG_INTERVAL_S,
                maxinterval=LOG_INTERVAL_S,
            )
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        if not self._plain:
            return super().display(msg, pos)
        if self.disable or msg is not None:  # (closing: `close` logged the last line)
            return True
        now = self._time()
        if self._logged_at is not None and now - self._logged_at < LOG_INTERVAL_S:
            return True  # (a postfix change refreshes the bar each time: not a line each)
        self._log_line(now)
        return True

    def close(self):
        if self._plain and not self.disable and self._logged_n != self.n:
            self._log_line(self._time())
        super().close()

    def _log_line(self, now: float) -> None:
        self._logged_at, self._logged_n = now, self.n
        log.info("%s", str(self))  # (now: a record formats its arguments later)
