"""What a benchmark handler does: write one line per start, as cheaply as possible.

Each process appends to its own file with a single ``os.write`` on an ``O_APPEND``
descriptor (no lock, no database, no buffering to flush): ``job slot start pid attempt
reason``, where ``start`` is ``time.time()`` taken first thing in the handler and ``slot``
is the scheduled instant in ms. The anarchon handlers and the APScheduler reference use
the same function, so lateness is measured the same way for both.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

ENV = "ANARCHON_BENCH_OUT"
_fd: int | None = None
_lock = threading.Lock()


def _descriptor() -> int:
    global _fd
    if _fd is None:
        with _lock:
            if _fd is None:
                folder = Path(os.environ.get(ENV, "/tmp/anarchon-bench-records"))
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"records-{os.getpid()}.tsv"
                _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return _fd


def record(job: str, slot_ms: int, start: float, attempt: int = 1, reason: str = "scheduled") -> None:
    """Append one start record (``start`` is the handler's ``time.time()``)."""
    line = f"{job}\t{slot_ms}\t{start:.6f}\t{os.getpid()}\t{attempt}\t{reason}\n"
    os.write(_descriptor(), line.encode())


@dataclass(frozen=True)
class Start:
    job: str
    slot_ms: int
    start: float
    pid: int
    attempt: int
    reason: str

    @property
    def lateness(self) -> float:
        """Seconds from the slot to the handler's start."""
        return self.start - self.slot_ms / 1000


def read(folder: Path) -> list[Start]:
    """Every start recorded under ``folder``, oldest first."""
    starts = []
    for path in sorted(folder.glob("records-*.tsv")):
        for line in path.read_text().splitlines():
            job, slot, start, pid, attempt, reason = line.split("\t")
            starts.append(Start(job, int(slot), float(start), int(pid), int(attempt), reason))
    starts.sort(key=lambda s: s.start)
    return starts
