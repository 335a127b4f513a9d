"""Shared fixtures: a guard that fails loudly when a database server is down, and
``cluster``, which starts real ``manage.py anarchon`` processes on the test database."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connection

ROOT = Path(__file__).resolve().parent.parent
MANAGE = ROOT / "tests" / "manage.py"

# libfaketime, for the tests that skew or step an instance's clock (Debian's faketime).
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

# An interval for jobs that must run only when a test asks (run_now, a hand-over):
# slots are aligned to the epoch, so the previous one was 2024-10-04 and the next
# is 2052-02-20. "1h" or "1d" here made tests flaky on the hour or at midnight.
ON_DEMAND = "10000d"

HOW_TO_START = {
    "postgresql": "PostgreSQL is not reachable at {where}. Start it with: "
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "mysql": "MariaDB is not reachable at {where}. Start it with: "
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Never skip a database test silently: stop the run with the command that fixes it."""
    import django
    from django.conf import settings

    django.setup()
    # A tox environment tests the Django it is named after (a dependency once upgraded it silently).
    wanted = {"dj42": (4, 2), "dj52": (5, 2), "dj61": (6, 1)}
    for factor, version in wanted.items():
        if factor in os.environ.get("TOX_ENV_NAME", "").split("-") and django.VERSION[:2] != version:
            pytest.exit(f"{os.environ['TOX_ENV_NAME']} runs Django {django.__version__}, not {version}", returncode=3)
    db = settings.DATABASES["default"]
    vendor = "postgresql" if "postgresql" in db["ENGINE"] else "mysql" if "mysql" in db["ENGINE"] else "sqlite"
    if vendor == "sqlite":
        return
    from django.db import connections

    probe = connections.create_connection("default")
    probe.settings_dict = {**probe.settings_dict, "NAME": db["NAME"]}
    try:
        # The raw driver connection: pytest-django blocks the ORM at this point.
        probe.get_new_connection(probe.get_connection_params()).close()
    except Exception as error:
        where = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 'default port'}"
        pytest.exit(f"{HOW_TO_START[vendor].format(where=where)}\n({error})", returncode=3)


def vendor() -> str:
    """The database of this run: sqlite, postgresql or mariadb."""
    return {"postgresql": "postgresql", "mysql": "mariadb"}.get(connection.vendor, "sqlite")


def report(test: str, figures: dict[str, Any]) -> None:
    """Add a test's figures to test-artifacts/faults-<database>.json (for docs/reliability.md) and print them."""
    path = ROOT / "test-artifacts" / f"faults-{vendor()}.json"
    path.parent.mkdir(exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[test] = {**figures, "database": vendor(), "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    print(f"\n{test} [{vendor()}]: {json.dumps(figures, sort_keys=True)}")


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


@pytest.fixture
def sched() -> Iterator[Any]:
    """A scheduler of its own for the test (not the default one), stopped at the end."""
    from django_anarchon import Scheduler

    scheduler = Scheduler()
    yield scheduler
    scheduler.stop(timeout=2)


def start(scheduler: Any, instance_id: str = "engine-test") -> None:
    """Start an embedded scheduler and wait until its start-up (catch-up included) is done."""
    scheduler.start(instance_id=instance_id)
    assert scheduler.wait_started(10)


def running_engine(scheduler: Any) -> Any:
    """The engine of a started scheduler (the one place the tests look inside a Scheduler)."""
    engine = scheduler._engine
    assert engine is not None, "the scheduler is not running"
    return engine


def finished(job: str, n: int = 1, timeout: float = 8, status: str | None = None) -> list[Any]:
    """Wait for ``n`` runs of ``job`` that have ended (any status but running and pending), oldest first.

    With ``status``, only runs that ended so count. A test that looks at what the handler did
    should name it: a short job's first slot at start-up can be legitimately ``skipped`` (two slots
    decided in one turn, the later one finding the earlier just won).
    """
    from django_anarchon.models import Run

    def runs() -> Any:
        rows = Run.objects.filter(job=job).exclude(status__in=["running", "pending"])
        return rows.filter(status=status) if status else rows

    return wait_for(
        lambda: (rows := list(runs().order_by("slot"))) and len(rows) >= n and rows,
        timeout,
        what=f"{n} {status or 'finished'} run(s) of {job}",
    )


def sqlite_write_lock_held() -> bool:
    """Whether some process holds the SQLite test database's write lock for longer than a write takes."""
    probe = sqlite3.connect(connection.settings_dict["NAME"], timeout=1.0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()


def server_session(conn: Any) -> int | None:
    """The server's id of a connection's session (PostgreSQL's backend pid, MySQL's thread id); None on SQLite."""
    conn.ensure_connection()
    if conn.vendor == "postgresql":
        return int(conn.connection.info.backend_pid)
    if conn.vendor == "mysql":
        return int(conn.connection.thread_id())
    return None


def end_server_sessions(sessions: Iterable[int | None]) -> None:
    """End the server's side of sessions whose client broke off a statement, rather than leave it to run."""
    with connection.cursor() as cursor:
        for session in sessions:
            if session is None:
                continue
            if vendor() == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
            else:
                with contextlib.suppress(OperationalError):  # it has ended already
                    cursor.execute(f"KILL {int(session)}")


class Instance:
    """One `manage.py anarchon` child process."""

    def __init__(self, instance_id: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.instance_id = instance_id
        self.process = process
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.process.pid, sig)

    def freeze(self, attempts: int = 40) -> None:
        """SIGSTOP the process, on SQLite at a moment it is not inside a write of its own.

        A stopped SQLite writer keeps the database file's write lock until it resumes, and no
        other process can write meanwhile (docs/guarantees.md says so): nothing could take over.
        That is SQLite's limit, not what a freeze test is about, so a freeze that lands inside a
        write (a renewal, a checkpoint, a heartbeat) is let go and tried again a moment later.
        """
        for _ in range(attempts):
            self.signal(signal.SIGSTOP)
            if connection.vendor != "sqlite" or not sqlite_write_lock_held():
                return
            self.signal(signal.SIGCONT)
            time.sleep(0.05)
        raise AssertionError(f"{self.instance_id} held SQLite's write lock at each of {attempts} freezes")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)


class Cluster:
    """Starts and stops real scheduler processes against the test database."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.instances: list[Instance] = []
        self.jobs: list[dict[str, Any]] = []
        self.settings: dict[str, Any] = {}

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["ANARCHON_TEST_JOBS"] = json.dumps(self.jobs)
        env["ANARCHON_TEST_DB_NAME"] = str(connection.settings_dict["NAME"])
        env["ANARCHON_TEST_CHILD"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in self.settings.items():
            env[f"ANARCHON_{key}"] = str(value)
        env.update(extra or {})
        return env

    def start(
        self,
        instance_id: str,
        extra_env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        args: list[str] | None = None,
    ) -> Instance:
        log = self.tmp_path / f"{instance_id}-{len(self.instances)}.log"
        handle = log.open("wb")
        process = subprocess.Popen(
            [*(prefix or []), sys.executable, str(MANAGE), "anarchon", "--instance-id", instance_id, *(args or [])],
            cwd=ROOT,
            env=self.env(extra_env),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        instance = Instance(instance_id, process, log)
        self.instances.append(instance)
        return instance

    def wait_ready(self, *instances: Instance, timeout: float = 30) -> None:
        for instance in instances:
            wait_for(
                lambda i=instance: "started with" in i.output() or not i.alive(),
                timeout,
                what=f"{instance.instance_id} to start",
            )
            assert instance.alive(), f"{instance.instance_id} died at start:\n{instance.output()}"

    def manage(
        self, *args: str, timeout: float = 60, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(MANAGE), *args],
            cwd=ROOT,
            env=self.env(extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def shutdown(self) -> None:
        for instance in self.instances:
            if instance.alive():
                instance.signal(signal.SIGCONT)
                instance.signal(signal.SIGKILL)
                try:
                    instance.wait(10)
                except subprocess.TimeoutExpired:
                    pass

    def logs(self) -> str:
        return "\n".join(f"===== {i.instance_id} (pid {i.pid}) =====\n{i.output()}" for i in self.instances)


@pytest.fixture
def cluster(transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    group = Cluster(tmp_path)
    yield group
    group.shutdown()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(group.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
