"""Progress on a terminal for long reads: a counter that appears only when a scan takes a while."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TextIO


def progress_stream() -> TextIO | None:
    """stderr when it is a terminal (progress is for people), else None (quiet in CI and pipes)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return sys.stderr if isatty is not None and isatty() else None


_clock = time.monotonic  # the module's own name for it, so a test can drive the display
DELAY = 0.5  # seconds before a counter first draws
REDRAW = 0.2  # seconds between redraws


def when_done(tick: Callable[[], None]) -> Callable[[Future[Any]], None]:
    """A ``Future.add_done_callback`` callback that calls ``tick`` (whatever the future's outcome)."""
    return lambda _future: tick()


class Counter:
    """``read 5,400 files`` on one line of ``stream``, redrawn at most five times a second.

    Nothing is drawn during the first ``DELAY`` seconds (a quick scan shows no flicker); ``close`` erases the line,
    so the report that follows starts on a clean line. Thread-safe: reads finish on pool threads.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.count = 0
        self.start = _clock()
        self.last = 0.0
        self.width = 0
        self.lock = threading.Lock()

    def tick(self) -> None:
        """Count one more file read."""
        with self.lock:
            self.count += 1
            now = _clock()
            if now - self.start < DELAY or now - self.last < REDRAW:
                return
            self.last = now
            line = f"ckptdoctor: read {self.count:,} files ({now - self.start:.0f} s)"
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line)
            self.stream.flush()

    def close(self) -> None:
        """Erase the line, if one was drawn."""
        with self.lock:
            if self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
                self.width = 0


class Waiting:
    """One line, ``ckptdoctor: <what> ...``, on ``stream`` when the block it guards takes longer than ``DELAY``.

    For calls that wait on something outside (listing a bucket while a backend retries): the line is printed once,
    on its own line, so backend messages logged meanwhile do not mangle it. No stream (not a terminal): no line.
    """

    def __init__(self, stream: TextIO | None, what: str) -> None:
        self.stream = stream
        self.what = what
        self.timer: threading.Timer | None = None

    def _say(self) -> None:
        assert self.stream is not None
        self.stream.write(f"ckptdoctor: {self.what} ...\n")
        self.stream.flush()

    def __enter__(self) -> Waiting:
        if self.stream is not None:
            self.timer = threading.Timer(DELAY, self._say)
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
