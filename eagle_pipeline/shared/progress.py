"""Throttled progress reports (done/total, tokens, rate, ETA) for long-running work, whatever shows them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The callback a piece of work calls as it advances: (done, total, tokens_done, tokens_total).
ProgressCallback = Callable[[int, int, int, int], None]


@dataclass(frozen=True)
class WorkProgress:
    """Where one piece of work stands: `done` of `total` units (rows of a shard, ...) and their tokens."""

    label: str
    unit: str
    done: int
    total: int
    tokens_done: int
    tokens_total: int
    elapsed_s: float

    @property
    def rate_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far, by tokens (rows differ in length); None before any progress."""
        if self.tokens_total and self.tokens_per_s > 0:
            return (self.tokens_total - self.tokens_done) / self.tokens_per_s
        if self.rate_per_s > 0:
            return (self.total - self.done) / self.rate_per_s
        return None

    def figures(self) -> dict[str, Any]:
        """The figures as plain values, keyed `<unit>_done`, `<unit>_total`, `tokens_done`, ... (`eta_s` only when
        known); `tokens_per_s` means what the finished work's `tokens_per_s` means."""
        eta = self.eta_s
        return {
            f"{self.unit}_done": self.done,
            f"{self.unit}_total": self.total,
            "percent_done": round(100.0 * self.done / self.total, 2) if self.total else 100.0,
            **({"eta_s": round(eta, 1)} if eta is not None else {}),
            "tokens_done": self.tokens_done,
            "tokens_total": self.tokens_total,
            "tokens_per_s": round(self.tokens_per_s, 1),
            f"{self.unit}_per_s": round(self.rate_per_s, 3),
            "elapsed_s": round(self.elapsed_s, 2),
        }

    def headline(self) -> str:
        """A few words: `shard 00003 12/256 rows (5%) 3,400 tokens/s eta 95s`."""
        eta = self.eta_s
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self.label} {self.done:,}/{self.total:,} {self.unit} ({pct:.0f}%) {self.tokens_per_s:,.0f} tokens/s "
            f"eta {'-' if eta is None else f'{eta:,.0f}s'}"
        )

    def format(self) -> str:
        """One log line, each figure labelled."""
        eta = self.eta_s
        return (
            f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({self.done / max(self.total, 1):.0%}), "
            f"{self.tokens_done:,}/{self.tokens_total:,} tokens, {self.rate_per_s:,.1f} {self.unit}/s, "
            f"{self.tokens_per_s:,.0f} tokens/s, ETA {'unknown' if eta is None else f'{eta:,.0f} s'}"
        )


def progress_reporter(
    report: Callable[[WorkProgress], None], label: str, unit: str = "rows", every_s: float = 5.0
) -> ProgressCallback:
    """A `ProgressCallback` that hands `report` a `WorkProgress` at most every `every_s` seconds, and always at the
    end (done == total)."""
    start = time.monotonic()
    last = [float("-inf")]

    def callback(done: int, total: int, tokens_done: int, tokens_total: int) -> None:
        now = time.monotonic()
        if now - last[0] < every_s and done < total:
            return
        last[0] = now
        report(WorkProgress(label, unit, done, total, tokens_done, tokens_total, now - start))

    return callback
