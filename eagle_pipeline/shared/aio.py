"""Event-loop plumbing of the runs (generation's runner, the vLLM hidden-state client): running a coroutine from sync code (uvloop when available), and the cyclic-GC
tuning that keeps thousands of in-flight requests from stalling the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

try:  # optional: uvloop cuts the event loop's share of per-request CPU
    import uvloop
except ImportError:
    uvloop = None  # type: ignore[assignment]

_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, int, int] | None = None
_gc_froze = False


@contextlib.contextmanager
def gc_tuned() -> Iterator[None]:
    """Fewer, cheaper cyclic-GC passes while requests are in flight.

    Every response allocates a few dozen containers (parsed JSON); with thousands of coroutines and connections alive,
    CPython's default thresholds trigger full collections that stall the loop for hundreds of milliseconds, and every
    stall delays every queued response (measured: ~15% of the throughput at 2,000 in flight). Objects alive at the
    start are frozen out of collection and gen-0 runs every 200,000 allocations instead of 700; refcounting still frees
    everything acyclic at once. At 20,000 the objects alive across 2,000 requests in flight (a streamed answer's
    assembler, a parsed body) still crossed the threshold ~30 times per 1,000 responses, ~2 ms each while streaming
    (8% of a streamed answer's client CPU); at 200,000 it is crossed about once per run, and what it can hold back
    is a few tens of MB at most. Restored when the last concurrent run ends.
    """
    global _gc_users, _gc_saved, _gc_froze
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            # A process that froze objects itself (e.g. before forking) keeps its own freeze untouched.
            _gc_froze = gc.get_freeze_count() == 0
            if _gc_froze:
                gc.freeze()
            gc.set_threshold(max(_gc_saved[0], 200_000), max(_gc_saved[1], 50), max(_gc_saved[2], 50))
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                if _gc_froze:
                    gc.unfreeze()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    # EAGLE_NO_UVLOOP=1 turns uvloop off (e.g. to compare, or to rule it out).
    if uvloop is None or os.environ.get("EAGLE_NO_UVLOOP"):
        return None
    return uvloop.new_event_loop


def run_coroutine(make_coro: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from sync code: in this thread when it has no running loop, else in a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop here: the run starts below, outside this handler, so its errors are not chained to this one
    else:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-generation") as ex:
            return ex.submit(run_coroutine, make_coro).result()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(make_coro())
