"""Build progress on stderr: one line when a build starts, the elapsed time while it runs, one line at the end.

In a terminal the elapsed time rewrites one line ('\\r'). In a Jupyter kernel it is one display output updated in
place: a notebook keeps each write to stderr as an output of its own, so an executed notebook saved a build's
'\\r' ticks as ~140 lines. In a log file (no tty) it adds a line every 15 s instead, so CI logs stay short.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Any, Optional, Type


def say(message: str) -> None:
    print(f"deform_conv: {message}", file=sys.stderr, flush=True)


def _mode() -> str:
    """'display' in a Jupyter kernel, 'inline' ('\\r') in a terminal, 'log' otherwise. Only a kernel's shell has
    a ``kernel``: a terminal IPython, or a script that merely imported ipykernel, is judged by its stderr."""
    if "ipykernel" in sys.modules:
        try:
            from IPython import get_ipython

            if hasattr(get_ipython(), "kernel"):
                return "display"
        except Exception:  # IPython missing or broken inside a kernel: '\r', which a live cell still shows
            return "inline"
    return "inline" if sys.stderr.isatty() else "log"


class Elapsed:
    """Context manager that shows the elapsed time of ``what`` until it exits; ``seconds`` holds the total."""

    def __init__(self, what: str, quiet: bool = False, period: Optional[float] = None) -> None:
        self.what = what
        self.quiet = quiet  # the compiler's own output is shown instead (DEFORM_CONV_VERBOSE=1)
        self.seconds = 0.0
        self._mode = _mode()
        self.period = period if period is not None else (15.0 if self._mode == "log" else 1.0)
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._display: Any = None  # IPython.display.display, and the handle of the output it made
        self._handle: Any = None

    def __enter__(self) -> "Elapsed":
        self._start = time.perf_counter()
        if self.quiet:
            return self
        if self._mode == "display":
            try:  # here rather than in the thread, which must not wait on the import lock
                from IPython.display import display

                self._display = display
            except Exception:
                self._mode = "inline"
        self._thread = threading.Thread(target=self._tick, name="deform_conv-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.period):
            self._show(time.perf_counter() - self._start)

    def _show(self, elapsed: float) -> None:
        if self._mode == "display":
            text = {"text/plain": f"deform_conv: {self.what}: {elapsed:.0f} s"}
            try:
                if self._handle is None:
                    self._handle = self._display(text, raw=True, display_id=True)
                else:
                    self._handle.update(text, raw=True)
                return
            except Exception:
                self._mode = "inline"
        if self._mode == "inline":
            print(f"\rdeform_conv: {self.what}: {elapsed:4.0f} s", end="", file=sys.stderr, flush=True)
        else:
            say(f"{self.what}: {elapsed:.0f} s")

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        if self._handle is not None and self._mode == "display":
            self._show(self.seconds)  # the total, not the last tick's count
        elif self._mode == "inline" and self.seconds >= 1.0:
            print("\r\033[K" if sys.stderr.isatty() else "\r", end="", file=sys.stderr, flush=True)
