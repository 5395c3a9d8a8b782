"""Progress on a terminal for long reads: lines that appear only when a scan takes a while, erased when done."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from concurrent.futures import Future


def progress_stream() -> TextIO | None:
    """stderr when it is a terminal (progress is for people), else None (quiet in CI and pipes)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return sys.stderr if isatty is not None and isatty() else None


_clock = time.monotonic  # the module's own name for it, so a test can drive the display
DELAY = 0.5  # seconds before a line first draws
REDRAW = 0.2  # seconds between redraws: at most five a second, however many files or chunks finish
ETA_AFTER = 1.0  # seconds of reading before a rate and an ETA are shown (the first chunks say little) ...
ETA_FRACTION = 0.01  # ... and the fraction of the bytes that must be read by then


def when_done(tick: Callable[[], None]) -> Callable[[Future[Any]], None]:
    """A ``Future.add_done_callback`` callback that calls ``tick`` (whatever the future's outcome)."""
    return lambda _future: tick()


class _Line:
    """One line on ``stream``, rewritten in place: not before ``DELAY``, at most every ``REDRAW``, erased by close.

    Thread-safe: reads finish on pool threads. Subclasses hold ``lock`` while they update and call ``_update``.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = _clock()
        self.last = -math.inf
        self.width = 0
        self.lock = threading.Lock()

    def _update(self) -> None:
        """Redraw if the line is due (the caller holds ``lock``)."""
        now = _clock()
        if now - self.start < DELAY or now - self.last < REDRAW:
            return
        self.last = now
        line = self._text(now - self.start)
        self.width = max(self.width, len(line))
        self.stream.write("\r" + line.ljust(self.width))  # padded: a shorter line leaves no tail of the last
        self.stream.flush()

    def _text(self, elapsed: float) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Erase the line, if one was drawn, so the report that follows starts on a clean line."""
        with self.lock:
            if self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
                self.width = 0


class Counter(_Line):
    """``read 5,400 files`` on one line of ``stream``, once a scan takes more than ``DELAY`` seconds."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.count = 0

    def tick(self) -> None:
        """Count one more file read."""
        with self.lock:
            self.count += 1
            self._update()

    def _text(self, elapsed: float) -> str:
        return f"ckptdoctor: read {self.count:,} files ({elapsed:.0f} s)"


class Meter(_Line):
    """``deep: 12/40 files, 1.2 GB/4.0 GB, 310.0 MB/s, ETA 0m09s``: files and bytes read of a known total.

    The rate and ETA appear once ``ETA_AFTER`` seconds have passed and ``ETA_FRACTION`` of the bytes are read:
    earlier, a rate measured over the first few chunks (or none, while a worker opens a large file) extrapolates
    to hours.
    """

    def __init__(self, stream: TextIO, files: int, total: int) -> None:
        super().__init__(stream)
        self.files = files
        self.total = total
        self.done_files = 0
        self.done = 0

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes read."""
        with self.lock:
            self.done += n
            self._update()

    def file_done(self) -> None:
        """Count one more file finished."""
        with self.lock:
            self.done_files += 1
            self._update()

    def _text(self, elapsed: float) -> str:
        line = f"deep: {self.done_files:,}/{self.files:,} files, {human_size(self.done)}/{human_size(self.total)}"
        if elapsed < ETA_AFTER or self.done <= 0 or self.done < ETA_FRACTION * self.total:
            return line
        rate = self.done / elapsed
        # Header bytes are not counted, so `done` may stay a little under `total`: never a negative ETA.
        left = max(0.0, (self.total - self.done) / rate)
        return f"{line}, {human_size(int(rate))}/s, ETA {human_duration(left)}"


def human_size(n: int) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``65.6 KB``, ``1.2 GB``."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def human_duration(seconds: float) -> str:
    """``seconds`` as ``4m09s``, or ``2h05m`` from an hour on."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


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
