"""Build progress on stderr: one line when a build starts, the elapsed time while it runs, one line at the end.

In a terminal or a Jupyter cell the elapsed time rewrites one line ('\\r'); in a log file (no tty) it adds
a line every 15 s instead, so CI logs stay short.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Optional, Type


def say(message: str) -> None:
    print(f"deform_conv: {message}", file=sys.stderr, flush=True)


def _rewrites_lines() -> bool:
    return sys.stderr.isatty() or "ipykernel" in sys.modules


class Elapsed:
    """Context manager that shows the elapsed time of ``what`` until it exits; ``seconds`` holds the total."""

    def __init__(self, what: str, quiet: bool = False, period: Optional[float] = None) -> None:
        self.what = what
        self.period = period if period is not None else (1.0 if _rewrites_lines() else 15.0)
        self.quiet = quiet  # the compiler's own output is shown instead (DEFORM_CONV_VERBOSE=1)
        self.seconds = 0.0
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._inline = _rewrites_lines()

    def __enter__(self) -> "Elapsed":
        self._start = time.perf_counter()
        if not self.quiet:
            self._thread = threading.Thread(target=self._tick, name="deform_conv-progress", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.period):
            elapsed = time.perf_counter() - self._start
            if self._inline:
                print(f"\rdeform_conv: {self.what}: {elapsed:4.0f} s", end="", file=sys.stderr, flush=True)
            else:
                say(f"{self.what}: {elapsed:.0f} s")

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._inline and self.seconds >= 1.0:
                print("\r\033[K" if sys.stderr.isatty() else "\r", end="", file=sys.stderr, flush=True)
