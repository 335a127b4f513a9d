"""What the benchmark ran on: CPU, memory, OS, database and library versions."""

from __future__ import annotations

import os
import platform
import sqlite3
import subprocess
from collections.abc import Collection
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any


def _first(path: str, prefix: str) -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _command(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def engine_version(package: Path | None = None) -> str:
    """The git commit of the measured django_anarchon (``+changes`` if its files differ from it)."""
    if package is not None:
        return f"copy at {package}"
    root = Path(__file__).resolve().parent.parent
    commit = _command("git", "-C", str(root), "rev-parse", "--short", "HEAD")
    changed = _command("git", "-C", str(root), "status", "--porcelain", "--", "django_anarchon")
    return f"{commit}{' +uncommitted changes' if changed else ''}"


def cpu_ticks() -> tuple[int, int] | None:
    """The whole machine's CPU time so far, (busy, total) in clock ticks, from /proc/stat; None off Linux.

    Busy is everything but idle and I/O wait, summed over every core.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in (fields[1:9] + ["0"] * 8)[:8])
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait, total


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """How busy the machine's CPUs were between two :func:`cpu_ticks` readings (0-1, all cores)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime 14, stime 15 (1-based), so 11 and 12 here.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuMark:
    """A process's CPU so far: in clock ticks for the whole process, to the nanosecond by thread."""

    ticks_s: float
    threads: dict[int, int]  # native thread id -> nanoseconds on a CPU (schedstat)


def cpu_mark(pid: int) -> CpuMark:
    """Read where process ``pid``'s CPU stands now (``ticks_s`` 0.0 once it is gone)."""
    threads: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            threads[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return CpuMark(process_cpu_s(pid) or 0.0, threads)


def cpu_used_s(before: CpuMark, after: CpuMark, leave_out: Collection[int] = ()) -> float:
    """CPU seconds used between two marks of one process, less the threads ``leave_out``.

    Summed to the nanosecond from each thread's schedstat: the process's user and system times
    are whole clock ticks (10 ms), and a reference that uses 40 ms in a window would be read
    25 % off. A thread that ended between the marks takes its last nanoseconds with it: the
    process's ticks are used then (those keep the time of ended threads), less the threads left out.
    """
    ended = any(tid not in after.threads or after.threads[tid] < ns for tid, ns in before.threads.items())
    if ended:
        left_out = sum(after.threads.get(t, 0) - before.threads.get(t, 0) for t in leave_out) / 1e9
        return after.ticks_s - before.ticks_s - left_out
    return sum(ns - before.threads.get(tid, 0) for tid, ns in after.threads.items() if tid not in leave_out) / 1e9


def describe() -> dict[str, Any]:
    mem_kb = _first("/proc/meminfo", "MemTotal").split()[0]
    os_name = platform.freedesktop_os_release().get("PRETTY_NAME", platform.platform())
    host, user = (
        os.environ.get("ANARCHON_BENCH_PG_HOST", "127.0.0.1"),
        os.environ.get("ANARCHON_BENCH_PG_USER", "postgres"),
    )
    return {
        "cpu": _first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory_gb": round(int(mem_kb) / 1024 / 1024, 1) if mem_kb.isdigit() else "?",
        "os": f"{os_name} (kernel {platform.release()})",
        "python": platform.python_version(),
        "django": _version("Django"),
        "psycopg": _version("psycopg"),
        "apscheduler": _version("APScheduler"),
        "croniter": _version("croniter"),
        "postgresql": _command("psql", "-h", host, "-U", user, "-Atc", "SHOW server_version", "postgres"),
        "mariadb": _command("mariadb", "-h", "127.0.0.1", "-u", "root", "-N", "-e", "SELECT VERSION()"),
        "sqlite": sqlite3.sqlite_version,
        "pgbench": _command("pgbench", "--version"),
    }
