"""The spend ledger every generation run of one data root shares while it runs: the pipeline-wide budget across
parallel runs (separate processes, hosts or pods on one volume).

`{data_root}/responses/.spend/ledger` holds one fixed-size slot per running dataset run: its dataset, the dataset's
committed spend when the run started (`baseline_usd`), what its answers cost since (`answered_usd`) and what its
requests in flight are expected to cost (`reserved_usd`). A run owns its slot by holding an flock on
`.spend/slot-N.lock` for as long as it runs; the kernel drops that lock when the process dies (kill -9 included),
which is how the others tell a dead run from a live one. Every `interval_s` (0.05 s) each run, under an flock on
`.spend/ledger.lock`, writes its slot and reads every other one (in place: NFS revalidates a file's data under a lock,
not across a rename). A dataset without a live run counts its spend on disk (`shards.read_committed`: shards, the answer
log a killed run left, retired rows), never less than its last run's slot said: so a run killed -9 loses none of the
spend its answer log or its slot recorded, and its reservation stops counting once its lock is seen free (at most
`probe_every_s` later).

Where the ledger cannot be created, locked, written or read, a run refuses to start; one whose view is older than
`stale_after_s` stops issuing requests. Nothing here knows Dagster.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.generation.store import shards

log = logging.getLogger("eagle_pipeline.generation")

LEDGER_DIR = ".spend"  # under {data_root}/responses/, beside the dataset directories
LEDGER_FILE, LEDGER_LOCK = "ledger", "ledger.lock"
SLOT_BYTES = 512
MAX_SLOTS = 4096
DEFAULT_INTERVAL_S = 0.05  # the answer log's interval: another run sees an answer's cost within about this
DEFAULT_PROBE_S = 0.5  # how often a run checks that the other slots' holders are alive
DEFAULT_STALE_S = 10.0  # a view older than this stops new requests (a hung volume, a starved process)

# Slots held by this process (ledger path, slot): never probed from here (on NFS, where flock is emulated with POSIX
# locks, a second descriptor of the same process would see them free and closing it would drop the holder's lock),
# and never claimed twice. Guarded by _PROCESS_LOCK, which also serializes this process's ledger accesses.
_PROCESS_LOCK = threading.Lock()
_HELD: set[tuple[str, int]] = set()


class SpendLedgerError(RuntimeError):
    """The shared spend ledger is unavailable: the pipeline budget cannot be held, so nothing is requested."""


@dataclass(frozen=True)
class Slot:
    index: int
    dataset: str
    baseline_usd: float
    answered_usd: float
    reserved_usd: float

    @property
    def spent_usd(self) -> float:
        return self.baseline_usd + self.answered_usd


def _encode(slot: Slot) -> bytes:
    body = json.dumps(
        {
            "dataset": slot.dataset,
            "baseline_usd": slot.baseline_usd,
            "answered_usd": slot.answered_usd,
            "reserved_usd": slot.reserved_usd,
            "host": socket.gethostname()[:64],
            "pid": os.getpid(),
            "at": round(time.time(), 3),
        },
        separators=(",", ":"),
    ).encode()
    if len(body) >= SLOT_BYTES:
        raise SpendLedgerError(f"dataset name {slot.dataset!r} is too long for a spend-ledger slot")
    return body.ljust(SLOT_BYTES - 1) + b"\n"


def _decode(index: int, raw: bytes) -> Slot | None:
    """A slot's record; None for an empty slot. Raises ValueError for bytes that are no record."""
    text = raw.strip(b" \n\0")
    if not text:
        return None
    d = json.loads(text)
    return Slot(index, str(d["dataset"]), float(d["baseline_usd"]), float(d["answered_usd"]), float(d["reserved_usd"]))


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # 0666 less the umask, like every file the pipeline writes


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[int]:
    """The ledger file's descriptor, under the exclusive ledger lock (and this process's lock)."""
    with _PROCESS_LOCK:
        lock_fd = _open(directory / LEDGER_LOCK)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            fd = _open(directory / LEDGER_FILE)
            try:
                yield fd
            finally:
                os.close(fd)
        finally:
            os.close(lock_fd)  # closing drops the flock


def _read_slots(fd: int, directory: Path) -> list[tuple[int, Slot | None, str | None]]:
    """(index, record or None, problem) of every slot in the file."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if size else b""
    out: list[tuple[int, Slot | None, str | None]] = []
    for i in range(0, len(data) // SLOT_BYTES):
        raw = data[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]
        try:
            out.append((i, _decode(i, raw), None))
        except (ValueError, KeyError, TypeError) as exc:
            out.append((i, None, f"{directory / LEDGER_FILE}: slot {i} unreadable ({exc})"))
    return out


def _slot_alive(directory: Path, index: int) -> bool:
    """Whether some process holds slot `index` (its lock file is flocked); never called for this process's slots."""
    path = directory / f"slot-{index}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def ledger_dir_for(responses_dirs: list[Path]) -> Path:
    """The ledger of the data root the dataset directories `responses_dirs` (`{root}/responses/{name}`) belong to."""
    parents = {Path(d).resolve().parent for d in responses_dirs}
    if len(parents) != 1:
        raise ValueError(f"the datasets' responses directories must share one parent (a data root), got {parents}")
    return parents.pop() / LEDGER_DIR


class SharedSpend:
    """The view of every run of a data root: the spend of each dataset and what every live run has in flight.

    `budget_usd` caps that total. `responses_dirs` are the datasets the cap covers (their spend counts whether or not
    they run); a live run of any other dataset of the data root counts too. `join` makes this process one of the runs.
    """

    def __init__(
        self,
        budget_usd: float,
        responses_dirs: list[Path],
        *,
        ledger_dir: Path | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        probe_every_s: float = DEFAULT_PROBE_S,
        stale_after_s: float = DEFAULT_STALE_S,
    ) -> None:
        self.budget_usd = float(budget_usd)
        self.dirs = {Path(d).name: Path(d) for d in responses_dirs}
        # Resolved: this process tells its own slots by this path (_HELD).
        self.ledger_dir = (
            Path(ledger_dir).resolve() if ledger_dir is not None else ledger_dir_for(list(self.dirs.values()))
        )
        self.interval_s, self.probe_every_s, self.stale_after_s = interval_s, probe_every_s, stale_after_s

    def dataset_dir(self, dataset: str) -> Path:
        return self.dirs.get(dataset) or self.ledger_dir.parent / dataset

    @property
    def spent_usd(self) -> float:
        """The total now, as a run that joined now would count it (committed spend plus every live run's)."""
        view = _View(self, me=None)
        view.refresh()
        return view.spent_usd

    @contextlib.contextmanager
    def join(self, dataset: str, committed_usd: float) -> Iterator[LedgerRun]:
        """Take a slot for a run of `dataset` whose committed spend is `committed_usd`; the slot is published every
        `interval_s` until the block ends. Raises SpendLedgerError (nothing requested yet) where the ledger cannot be
        used."""
        run = LedgerRun(self, dataset, committed_usd)
        try:
            run.start()
        except OSError as exc:
            run.close()
            raise SpendLedgerError(
                f"generation.budget_usd needs the shared spend ledger in {self.ledger_dir} (flock on a local or "
                f"shared volume every run of the data root mounts): {exc}. Nothing was requested"
            ) from exc
        try:
            yield run
        finally:
            run.close()


class _View:
    """What one run knows of the others: each dataset's last figure, refreshed from the ledger and the disk."""

    def __init__(self, shared: SharedSpend, me: LedgerRun | None) -> None:
        self.shared, self.me = shared, me
        self.floor: dict[str, float] = {}  # dataset -> spend it had at least (disk, or a slot's last figure)
        self.live: dict[str, Slot] = {}  # datasets with a live run other than `me`: their current slot
        self.alive: dict[int, tuple[bool, float]] = {}  # slot -> (alive, when probed)
        self.reader: ThreadPoolExecutor | None = None  # set after the first refresh of a run (`_read_disk`)
        self.reading: dict[str, Future[float]] = {}
        self.spent_usd = 0.0  # every other dataset's spend
        self.reserved_usd = 0.0  # what the other live runs have in flight

    def _is_alive(self, index: int, now: float) -> bool:
        if (str(self.shared.ledger_dir), index) in _HELD:  # this process's own runs
            return True
        known = self.alive.get(index)
        if known is None or now - known[1] >= self.shared.probe_every_s:
            known = (_slot_alive(self.shared.ledger_dir, index), now)
            self.alive[index] = known
        return known[0]

    def _disk(self, dataset: str) -> float:
        return shards.read_committed(self.shared.dataset_dir(dataset)).spend_usd

    def _read_disk(self, dataset: str, at_least: float) -> None:
        """Count `dataset` at no less than `at_least` now, and at no less than its spend on disk once read. The first
        refresh reads at once; later ones on a reader thread (a dataset of a thousand shards on a network volume
        takes seconds), so the run keeps publishing and deciding meanwhile."""
        self.floor[dataset] = max(self.floor.get(dataset, 0.0), at_least)
        if self.reader is None:
            self.floor[dataset] = max(self.floor[dataset], self._disk(dataset))
        elif dataset not in self.reading:
            self.reading[dataset] = self.reader.submit(self._disk, dataset)

    def refresh(self) -> None:
        """Publish `me` (if any), read every slot, and recompute the others' spend and reservations. Raises OSError
        on an I/O failure or an unreadable slot of a live run."""
        shared, now = self.shared, time.monotonic()
        directory = shared.ledger_dir
        if self.me is None and not (directory / LEDGER_FILE).exists():
            slots: list[tuple[int, Slot | None, str | None]] = []
        else:
            with _locked(directory) as fd:
                if self.me is not None:
                    os.pwrite(fd, _encode(self.me.slot()), self.me.index * SLOT_BYTES)
                slots = _read_slots(fd, directory)
        mine = self.me.dataset if self.me is not None else None
        live: dict[str, Slot] = {}
        dead: dict[str, float] = {}
        for index, slot, problem in slots:
            if (self.me is not None and index == self.me.index) or (slot is None and problem is None):
                continue
            alive = self._is_alive(index, now)
            if problem is not None:
                if alive:  # a live run's slot must always read back: refuse rather than guess its spend
                    raise OSError(errno.EIO, problem)
                continue
            assert slot is not None
            if slot.dataset == mine:
                continue
            if alive:
                live[slot.dataset] = slot
            else:
                dead[slot.dataset] = max(dead.get(slot.dataset, 0.0), slot.spent_usd)
        for dataset, read in list(self.reading.items()):  # disk reads started by earlier refreshes
            if read.done():
                del self.reading[dataset]
                self.floor[dataset] = max(self.floor.get(dataset, 0.0), read.result())
        for dataset, slot in self.live.items():
            if dataset not in live:  # its run ended or died: its spend is on disk now, at least what its slot said
                self._read_disk(dataset, slot.spent_usd)
        for dataset in (*shared.dirs, *dead):
            if dataset != mine and dataset not in live and dataset not in self.floor:
                self._read_disk(dataset, 0.0)
        for dataset, figure in dead.items():
            if dataset not in live:
                self.floor[dataset] = max(self.floor[dataset], figure)
        self.live = live
        self.spent_usd = sum(s.spent_usd for s in live.values()) + sum(
            v for d, v in self.floor.items() if d not in live and d != mine
        )
        self.reserved_usd = sum(s.reserved_usd for s in live.values())


class LedgerRun:
    """One run's share of the ledger (what `SpendLedger` calls `run_budget`): `add` each answer's cost, `reached`
    before each request; a thread publishes the run's figures and refreshes its view of the others."""

    def __init__(self, shared: SharedSpend, dataset: str, committed_usd: float) -> None:
        self.shared = shared
        self.dataset = dataset
        self.budget_usd: float | None = shared.budget_usd
        self.baseline_usd = float(committed_usd)
        self.index = -1
        self._answered = 0.0
        self._reserved = 0.0
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._slot_fd: int | None = None
        self._view = _View(shared, self)
        self._fresh_at = 0.0
        self._problem: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def slot(self) -> Slot:
        with self._lock:
            return Slot(self.index, self.dataset, self.baseline_usd, self._answered, self._reserved)

    def start(self) -> None:
        directory = self.shared.ledger_dir
        directory.mkdir(parents=True, exist_ok=True)
        with _PROCESS_LOCK:
            for i in range(MAX_SLOTS):
                if (str(directory), i) in _HELD:
                    continue
                fd = _open(directory / f"slot-{i}.lock")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                except OSError:
                    os.close(fd)
                    raise
                self.index, self._slot_fd = i, fd
                _HELD.add((str(directory), i))
                break
            else:
                raise OSError(errno.ENOSPC, f"all {MAX_SLOTS} slots of {directory} are held")
        self._refresh()
        if self._problem is not None:
            raise OSError(errno.EIO, self._problem)
        self._view.reader = ThreadPoolExecutor(1, thread_name_prefix=f"spend-ledger-disk-{self.dataset}")
        self._thread = threading.Thread(target=self._loop, name=f"spend-ledger-{self.dataset}", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        """Publish this run's figures and refresh its view now (the thread does it every `interval_s`)."""
        self._refresh()

    def _refresh(self) -> None:
        try:
            with self._refresh_lock:
                self._view.refresh()
        except Exception as exc:  # I/O, or another dataset's committed shard unreadable: either way no view
            self._problem = f"the shared spend ledger in {self.shared.ledger_dir} failed: {type(exc).__name__}: {exc}"
            log.error("[%s] %s; no new requests", self.dataset, self._problem)
            return
        self._fresh_at = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.wait(self.shared.interval_s) and self._problem is None:
            self._refresh()

    def close(self) -> None:
        """Stop publishing, empty the slot (the run's spend is on disk now) and release it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._view.reader is not None:
            self._view.reader.shutdown(wait=False, cancel_futures=True)
        if self._slot_fd is None:
            return
        directory = self.shared.ledger_dir
        try:
            with _locked(directory) as fd:
                os.pwrite(fd, b" " * (SLOT_BYTES - 1) + b"\n", self.index * SLOT_BYTES)
        except OSError as exc:  # the slot stays; its lock goes with the descriptor, so it reads as dead
            log.warning("[%s] could not empty slot %d of %s: %s", self.dataset, self.index, directory, exc)
        finally:
            with _PROCESS_LOCK:
                os.close(self._slot_fd)
                _HELD.discard((str(directory), self.index))
            self._slot_fd = None

    # ---- what SpendLedger calls (the run's event loop) -------------------------------------------------------
    def add(self, usd: float) -> None:
        with self._lock:
            self._answered += usd

    @property
    def spent_usd(self) -> float:
        """Every dataset's spend as this run last saw it, this run's own answers included (no reservations)."""
        with self._lock:
            mine = self.baseline_usd + self._answered
        return mine + self._view.spent_usd

    def reached(self, projected_extra_usd: float = 0.0) -> bool:
        """True when the data root's spend plus every run's in-flight reservation (this run's: the projection) reaches
        the cap, or when the shared view is unavailable or older than `stale_after_s`."""
        with self._lock:
            self._reserved = projected_extra_usd
            mine = self.baseline_usd + self._answered + projected_extra_usd
        return self.why_reached(mine) is not None

    def why_reached(self, mine_usd: float | None = None) -> str | None:
        """Why new requests must stop (None: they may go on)."""
        if self._problem is not None:
            return self._problem
        age = time.monotonic() - self._fresh_at
        if age > self.shared.stale_after_s:
            return f"the shared spend view is {age:.1f} s old (ledger {self.shared.ledger_dir})"
        if mine_usd is None:
            with self._lock:
                mine_usd = self.baseline_usd + self._answered + self._reserved
        total = mine_usd + self._view.spent_usd + self._view.reserved_usd
        if total >= self.shared.budget_usd:
            return (
                f"generation.budget_usd ${self.shared.budget_usd:,.4f} reached: ${total:,.4f} spent or in flight "
                "by every run of the data root"
            )
        return None
