"""Throttled progress lines (done/total, rate, ETA) for long-running work, whatever logs them."""

from __future__ import annotations

import time
from collections.abc import Callable


def progress_reporter(
    log: Callable[[str], None], label: str, unit: str = "rows", every_s: float = 5.0
) -> Callable[[int, int], None]:
    """A `(done, total)` callback that logs at most every `every_s` seconds, and always at the end."""
    start = time.monotonic()
    last = [float("-inf")]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < every_s and done < total:
            return
        last[0] = now
        rate = done / max(now - start, 1e-9)
        eta = f"{(total - done) / rate:.0f} s" if rate > 0 else "unknown"
        log(f"{label}: {done}/{total} {unit} ({done / max(total, 1):.0%}), {rate:.1f} {unit}/s, ETA {eta}")

    return report
