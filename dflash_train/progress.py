"""Progress display for long commands: a live bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_seconds(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """`Progress(total, "regenerate")`; call `update(n, note)`; `close()` prints the last state.

    On a terminal the bar redraws in place at most 5× a second; in a log file (CI, nohup)
    it prints a line every `every_seconds` so progress stays visible without flooding.
    """

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, every_seconds: float = 10.0):
        self.total = max(0, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self.last_draw = 0.0
        self.every_seconds = every_seconds
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.note = ""
        self.logged: tuple[int, str] | None = None  # (done, note) of the last line written to a log

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total else float("nan")
        if self.total:
            filled = int(24 * self.done / self.total)
            bar = "#" * filled + "." * (24 - filled)
            head = f"{self.label} [{bar}] {self.done}/{self.total}"
        else:
            head = f"{self.label} {self.done}"
        tail = f" {rate:.2f}/s elapsed {format_seconds(elapsed)} eta {format_seconds(eta)}"
        return head + tail + (f" | {self.note}" if self.note else "")

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.live and now - self.last_draw >= 0.2:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
            self.last_draw = now
        elif not self.live and now - self.last_draw >= self.every_seconds:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.last_draw, self.logged = now, (self.done, self.note)

    def print(self, text: str) -> None:
        """A permanent line above the live bar."""
        if self.live:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self.last_draw = 0.0 if self.live else self.last_draw

    def close(self) -> None:
        if not self.live and self.logged == (self.done, self.note):
            return  # a log already holds this state's line (the last update drew it)
        self.stream.write(("\r\033[K" if self.live else "") + self.line() + "\n")
        self.stream.flush()
