"""End to end in a real browser: the example project's admin asks for a run and a scheduler runs it.

Starts, on a fresh SQLite file, the example project's ``runserver`` and one
``manage.py anarchon``; Debian's Chromium (driven by Playwright) logs into the
admin, runs "Run now" on ``heartbeat`` and watches the run history until the
manual run succeeded. The screenshot lands in ``test-artifacts/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "example_project"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "browser-test-password"  # a throwaway database, deleted with tmp_path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def example_env(database: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANARCHON_", "DJANGO_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="example_project.settings",
        DATABASE_URL=f"sqlite:///{database}",
        ANARCHON_POLL_INTERVAL="0.2",
        ANARCHON_LEASE_TTL="2",
        ANARCHON_SHUTDOWN_GRACE="2",
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        PYTHONUNBUFFERED="1",
    )
    return env


def manage(env: dict[str, str], *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=EXAMPLE,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not exited within 10 s."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until_serving(base: str, server: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"runserver exited:\n{log.read_text(errors='replace')}"
        try:
            with urllib.request.urlopen(f"{base}/admin/login/", timeout=2) as answer:  # noqa: S310 - our own server
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"runserver did not answer within {timeout}s:\n{log.read_text(errors='replace')}")


def test_run_now_from_the_admin_is_run_by_a_scheduler_instance(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing; install Debian's Chromium with: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is missing; install the test extra: pip install -e '.[test]'")

    env = example_env(tmp_path / "example.sqlite3")
    manage(env, "migrate", "--noinput")
    manage(env, "createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log, scheduler_log = tmp_path / "runserver.log", tmp_path / "anarchon.log"
    children: list[subprocess.Popen[bytes]] = []
    try:
        children.append(start(env, server_log, "runserver", "--noreload", f"127.0.0.1:{port}"))
        children.append(start(env, scheduler_log, "anarchon", "--instance-id", "browser-node"))
        wait_until_serving(base, children[0], server_log)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                drive_admin(page, base, children[1], scheduler_log)
            finally:
                browser.close()
    finally:
        for child in reversed(children):
            stop(child)


def drive_admin(page: Any, base: str, scheduler: subprocess.Popen[bytes], scheduler_log: Path) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")

    page.goto(f"{base}/admin/django_anarchon/jobstate/")
    page.check("input[name=_selected_action][value=heartbeat]")
    page.select_option("select[name=action]", "run_now")
    page.click("button[name=index]")
    message = page.locator("ul.messagelist li.success")
    assert "Requested a run of heartbeat" in message.first.inner_text()

    history = f"{base}/admin/django_anarchon/run/?job=heartbeat&reason=manual"
    deadline = time.monotonic() + 60
    while True:
        assert scheduler.poll() is None, f"manage.py anarchon exited:\n{scheduler_log.read_text(errors='replace')}"
        page.goto(history)
        if page.locator("#result_list .anarchon-status-success").count():
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no successful manual run of heartbeat after 60 s; the page shows:\n{page.inner_text('#content')}\n"
                f"scheduler log:\n{scheduler_log.read_text(errors='replace')}"
            )
        time.sleep(0.5)
    row = page.locator("#result_list tbody tr").first.inner_text()
    assert "heartbeat" in row and "manual" in row and "success" in row and "browser-node" in row
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "run-history.png"), full_page=True)


def test_admin_run_data_job_buttons_run_again_and_a_readable_history_at_1366px(tmp_path: Path) -> None:
    """The admin's newer actions in a real browser, on a laptop-sized window, with screenshots."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing; install Debian's Chromium with: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    env = example_env(tmp_path / "example.sqlite3")
    manage(env, "migrate", "--noinput")
    manage(env, "createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log, scheduler_log = tmp_path / "runserver.log", tmp_path / "anarchon.log"
    children: list[subprocess.Popen[bytes]] = []
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        children.append(start(env, server_log, "runserver", "--noreload", f"127.0.0.1:{port}"))
        children.append(start(env, scheduler_log, "anarchon", "--instance-id", "browser-node"))
        wait_until_serving(base, children[0], server_log)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                drive_new_actions(page, base, children[1], scheduler_log)
            finally:
                browser.close()
    finally:
        for child in reversed(children):
            stop(child)


def drive_new_actions(page: Any, base: str, scheduler: subprocess.Popen[bytes], scheduler_log: Path) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")

    # "Run now with data…" from the jobs list: the form checks the JSON, then the run fails as asked.
    page.goto(f"{base}/admin/django_anarchon/jobstate/")
    page.check("input[name=_selected_action][value=sync-customers]")
    page.select_option("select[name=action]", "run_now_with_data")
    page.click("button[name=index]")
    page.fill("textarea[name=run_data]", "{not json")
    page.click("input[type=submit].default")
    assert "This is not JSON" in page.inner_text("#content")
    page.fill("textarea[name=run_data]", '{"fail": true}')
    page.screenshot(path=str(ARTIFACTS / "admin-run-now-with-data.png"), full_page=True)
    page.click("input[type=submit].default")
    assert "Requested a run of sync-customers" in page.locator("ul.messagelist li.success").first.inner_text()
    history = f"{base}/admin/django_anarchon/run/?job=sync-customers&reason=manual"
    deadline = time.monotonic() + 60
    while not page.locator("#result_list .anarchon-status-failed").count():
        assert scheduler.poll() is None, scheduler_log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no failed manual run after 60 s:\n{page.inner_text('#content')}"
        time.sleep(0.5)
        page.goto(history)

    # The run history fits a 1366 px window, error column included.
    fits = page.evaluate(
        "document.documentElement.scrollWidth <= window.innerWidth && "
        "[...document.querySelectorAll('#changelist .results')].every(r => r.scrollWidth <= r.clientWidth)"
    )
    error_cell = page.locator("#result_list td.field-short_error").first.bounding_box()
    results = page.locator("#changelist .results").first.bounding_box()
    page.screenshot(path=str(ARTIFACTS / "admin-run-history-1366.png"), full_page=True)
    overflow = page.evaluate("(r => r.scrollWidth - r.clientWidth)(document.querySelector('#changelist .results'))")
    assert fits, f"the run history scrolls sideways in a 1366 px window ({overflow} px too wide)"
    assert error_cell is not None and results is not None
    assert error_cell["x"] + error_cell["width"] <= results["x"] + results["width"] + 1, "the error column is cut"
    assert "RuntimeError" in page.locator("#result_list td.field-short_error").first.inner_text()

    # "Run again with the same data" on that run: a new pending manual run, with the same data.
    page.locator("#result_list tbody tr th a").first.click()
    page.click("button.anarchon-run-again")
    assert "again with the data of run" in page.locator("ul.messagelist li.success").first.inner_text()
    assert '"fail": true' in page.inner_text("#content")
    page.screenshot(path=str(ARTIFACTS / "admin-run-again.png"), full_page=True)

    # A job's own page: Pause… (asks why), then Resume; both in the job's history.
    page.goto(f"{base}/admin/django_anarchon/jobstate/heartbeat/change/")
    page.click("button.anarchon-pause")
    page.fill("textarea[name=reason]", "browser test: the supplier's API is down until the maintenance window ends")
    page.click("input[type=submit].default")
    assert "Paused heartbeat" in page.locator("ul.messagelist li.success").first.inner_text()
    assert page.locator("button.anarchon-resume").count() == 1
    page.goto(f"{base}/admin/django_anarchon/jobstate/")
    assert "paused" in page.locator("#result_list tr", has_text="heartbeat").first.inner_text()
    # The jobs list fits a 1366 px window too, the pause note (its last but one column) included (helper 38).
    overflow = page.evaluate("(r => r.scrollWidth - r.clientWidth)(document.querySelector('#changelist .results'))")
    note_cell = page.locator("#result_list td.field-pause_note_shown", has_text="browser test").first.bounding_box()
    results = page.locator("#changelist .results").first.bounding_box()
    page.screenshot(path=str(ARTIFACTS / "admin-jobs-1366.png"), full_page=True)
    assert overflow <= 0, f"the jobs list scrolls sideways in a 1366 px window ({overflow} px too wide)"
    assert note_cell is not None and results is not None
    assert note_cell["x"] + note_cell["width"] <= results["x"] + results["width"] + 1, "the pause note is cut"
    page.goto(f"{base}/admin/django_anarchon/jobstate/heartbeat/change/")
    page.click("button.anarchon-resume")
    assert "Resumed heartbeat" in page.locator("ul.messagelist li.success").first.inner_text()
    page.goto(f"{base}/admin/django_anarchon/jobstate/heartbeat/history/")
    entries = page.inner_text("#change-history")
    page.screenshot(path=str(ARTIFACTS / "admin-job-history.png"), full_page=True)
    assert "Paused by admin: browser test" in entries and "Resumed by admin" in entries
