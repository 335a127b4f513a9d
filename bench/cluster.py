"""Start, watch and stop real ``manage.py anarchon`` processes of the benchmark project."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MANAGE = ROOT / "bench" / "manage.py"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class Instance:
    """One scheduler process and its probe file."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], folder: Path, log: Path, spawned: float) -> None:
        self.name = name
        self.process = process
        self.folder = folder
        self.log = log
        self.spawned = spawned  # time.time() just before the process was started

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def probe(self) -> dict[str, Any] | None:
        path = self.folder / f"probe-{self.pid}.json"
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def ready(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"instance {self.name} exited at start:\n{self.output()[-3000:]}")
        data = self.probe()
        return bool(data and data.get("ready_at"))

    def fresh_probe(self, after: float) -> dict[str, Any]:
        """The first probe snapshot written after ``after`` (time.time())."""
        return wait_for(  # type: ignore[no-any-return]
            lambda: (p := self.probe()) is not None and p["time"] > after and p, 5, f"a probe of {self.name}"
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)


class Cluster:
    """Scheduler processes sharing one job set, settings and output folder."""

    def __init__(self, db: str, folder: Path, jobs: list[dict[str, Any]], settings: dict[str, Any] | None = None):
        self.db = db
        self.folder = folder
        self.jobs = jobs
        self.settings = settings or {}
        self.instances: list[Instance] = []
        folder.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": "bench.settings",
                "ANARCHON_BENCH_DB": self.db,
                "ANARCHON_BENCH_JOBS": json.dumps(self.jobs),
                "ANARCHON_BENCH_OUT": str(self.folder),
                "ANARCHON_BENCH_PROBE": str(self.folder),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update({f"ANARCHON_{key}": str(value) for key, value in self.settings.items()})
        return env

    def start(self, count: int = 1) -> list[Instance]:
        started = []
        for _ in range(count):
            name = f"{self.db}-{len(self.instances) + 1}"
            log = self.folder / f"{name}.log"
            spawned = time.time()
            process = subprocess.Popen(
                [sys.executable, str(MANAGE), "anarchon", "--instance-id", name],
                cwd=ROOT,
                env=self.env(),
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            instance = Instance(name, process, self.folder, log, spawned)
            self.instances.append(instance)
            started.append(instance)
        return started

    def wait_ready(self, instances: list[Instance], timeout: float = 120) -> None:
        for instance in instances:
            wait_for(instance.ready, timeout, f"{instance.name} to start")

    def alive(self) -> list[Instance]:
        return [i for i in self.instances if i.alive()]

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM everyone, wait, SIGKILL whoever is left."""
        for instance in self.alive():
            instance.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for instance in self.instances:
            try:
                instance.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                instance.signal(signal.SIGKILL)
                instance.process.wait(5)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def manage(db: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run a benchmark-project management command; return its standard output."""
    full = dict(os.environ)
    full.update({"DJANGO_SETTINGS_MODULE": "bench.settings", "ANARCHON_BENCH_DB": db})
    full.update(env or {})
    done = subprocess.run(
        [sys.executable, str(MANAGE), *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout
