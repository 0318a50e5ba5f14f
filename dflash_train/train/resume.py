"""Where a run starts and ends: the steps it trains."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRange:
    """The steps this run trains: start (0, or the resumed step) up to end (exclusive)."""

    start: int
    end: int

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return max(0, self.end - self.start)
