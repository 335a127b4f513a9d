"""The admin pages, actions and permissions, through Django's test client."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone as django_timezone

from django_anarchon import scheduler, store
from django_anarchon.admin import describe_schedule, format_seconds
from django_anarchon.models import Instance, JobState, Reason, Run, Status
from django_anarchon.registry import Job

pytestmark = pytest.mark.django_db

UTC = timezone.utc
PAYLOAD = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
EVERY = "admin-test-every"
CRON = "admin-test-cron"


def _noop(ctx: Any) -> None:
    """A handler the admin never runs."""


@pytest.fixture
def jobs() -> Iterator[dict[str, Job]]:
    """Two jobs declared on the default scheduler for the duration of a test."""
    scheduler.every(EVERY, "10s", _noop)
    scheduler.cron(CRON, "0 6 1 * *", _noop, timezone="Europe/Paris")
    try:
        yield {EVERY: scheduler.job(EVERY), CRON: scheduler.job(CRON)}
    finally:
        scheduler.registry.remove(EVERY)
        scheduler.registry.remove(CRON)


def url(name: str, *args: Any) -> str:
    """The URL of one of django_anarchon's admin views, e.g. ``url("run_change", 1)``."""
    return reverse(f"admin:django_anarchon_{name}", args=args)


def make_run(job: str = EVERY, at: datetime | None = None, **fields: Any) -> Run:
    """A finished run record (1.5 s long, successful unless ``fields`` say otherwise)."""
    at = at or datetime(2024, 3, 5, 12, 0, tzinfo=UTC)
    values: dict[str, Any] = {
        "job": job,
        "slot": int(at.timestamp() * 1000),
        "attempt": 1,
        "status": Status.SUCCESS,
        "reason": Reason.SCHEDULED,
        "scheduled_at": at,
        "instance_id": "node-1",
        "started_at": at + timedelta(milliseconds=20),
        "finished_at": at + timedelta(seconds=1, milliseconds=520),
    }
    values.update(fields)
    return Run.objects.create(**values)


def staff_client(django_user_model: Any, *codenames: str, username: str = "operator") -> Client:
    """A logged-in staff user holding only the given django_anarchon permissions."""
    user = django_user_model.objects.create_user(username, password="not-used", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="django_anarchon", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def act(client: Client, action: str, *names: str, **extra: str) -> Any:
    """POST an action from the jobs list (``index`` present: the first step of every action)."""
    data = {"action": action, "_selected_action": list(names), "index": "0", **extra}
    return client.post(url("jobstate_changelist"), data, follow=True)


def confirm_pause(client: Client, *names: str, reason: str = "") -> Any:
    """POST the pause confirmation page's form (no ``index``, like the delete confirmation)."""
    data = {"action": "pause", "_selected_action": list(names), "post": "yes", "reason": reason}
    return client.post(url("jobstate_changelist"), data, follow=True)


def shown(response: Any) -> list[Any]:
    """The rows a changelist response shows, in order."""
    return list(response.context["cl"].result_list)


def text(response: Any) -> str:
    """The response's HTML."""
    return response.content.decode()


# -- run history -------------------------------------------------------------------


def test_run_history_pages_filters_search_and_date_hierarchy_render(admin_client: Client) -> None:
    ok = make_run(job="alpha", instance_id="node-1")
    failed = make_run(
        job="beta",
        at=datetime(2024, 3, 6, 8, 0, tzinfo=UTC),
        status=Status.FAILED,
        error_type="ValueError",
        error_message="boom in beta",
        traceback="Traceback (most recent call last):\nValueError: boom in beta",
        instance_id="node-2",
    )
    manual = make_run(job="alpha", at=datetime(2024, 4, 1, tzinfo=UTC), reason=Reason.MANUAL, manual=True)
    changelist = url("run_changelist")
    assert admin_client.get(reverse("admin:index")).status_code == 200
    assert admin_client.get(reverse("admin:app_list", args=["django_anarchon"])).status_code == 200

    response = admin_client.get(changelist)
    assert response.status_code == 200
    assert shown(response) == [manual, failed, ok], "newest first"
    page = text(response)
    assert "boom in beta" in page and "1.50 s" in page and "anarchon-status-failed" in page

    cases = {
        "status=failed": [failed],
        "job=alpha": [manual, ok],
        "reason=manual": [manual],
        "q=boom": [failed],
        "q=ValueError": [failed],  # the error column shows the type too
        "q=node-2": [failed],
        "q=beta": [failed],
        "scheduled_at__year=2024": [manual, failed, ok],
        "scheduled_at__year=2024&scheduled_at__month=3": [failed, ok],
        "scheduled_at__year=2024&scheduled_at__month=3&scheduled_at__day=6": [failed],
    }
    for query, expected in cases.items():
        response = admin_client.get(f"{changelist}?{query}")
        assert response.status_code == 200, query
        assert shown(response) == expected, query

    response = admin_client.get(url("run_change", failed.pk))
    assert response.status_code == 200
    page = text(response)
    assert "<pre>Traceback (most recent call last):\nValueError: boom in beta</pre>" in page
    for value in ("beta", "node-2", "ValueError", str(failed.slot)):
        assert value in page


def test_run_history_leaves_its_date_bar_out_where_the_database_cannot_convert_times(
    admin_client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Helper 38: on MariaDB without the server's time zone tables and a TIME_ZONE other than UTC, the
    date bar's query raised (CONVERT_TZ answers NULL), and every page of the run history answered 500."""
    from django.db import connection

    from django_anarchon.admin import runs as run_admin
    from django_anarchon.dbtime import converts_to

    settings.TIME_ZONE = "Europe/Berlin"
    run = make_run(at=datetime(2026, 12, 6, 20, 33, 20, tzinfo=UTC))
    changelist = url("run_changelist")
    converts = converts_to(connection, "Europe/Berlin")  # False on this machine's MariaDB, True elsewhere
    for query in ("", f"?job={run.job}"):
        response = admin_client.get(changelist + query)
        assert response.status_code == 200, query
        assert shown(response) == [run]
        assert (response.context["cl"].date_hierarchy == "scheduled_at") is converts
        assert ("The date bar is left out" in text(response)) is not converts

    # Wherever the database cannot convert (as this machine's MariaDB cannot): the list, without the bar.
    monkeypatch.setattr(run_admin, "converts_to", lambda connection, zone: False)
    response = admin_client.get(changelist)
    assert response.status_code == 200
    assert shown(response) == [run]
    assert response.context["cl"].date_hierarchy is None
    assert "The date bar is left out" in text(response) and "Europe/Berlin" in text(response)


def test_run_history_is_read_only_even_for_a_superuser(admin_client: Client) -> None:
    run = make_run(status=Status.FAILED, error_message="original")
    assert admin_client.get(url("run_add")).status_code == 403
    assert admin_client.get(url("run_delete", run.pk)).status_code == 403
    assert admin_client.post(url("run_delete", run.pk), {"post": "yes"}).status_code == 403
    assert admin_client.post(url("run_change", run.pk), {"error_message": "changed"}).status_code == 403
    response = admin_client.get(url("run_changelist"))
    assert 'value="delete_selected"' not in text(response)
    assert 'value="cancel"' in text(response), "the only action is cancelling pending runs"
    admin_client.post(url("run_changelist"), {"action": "delete_selected", "_selected_action": [run.pk], "index": "0"})
    run.refresh_from_db()
    assert run.error_message == "original"


def test_run_detail_shows_data_and_progress_as_pretty_json(admin_client: Client) -> None:
    run = make_run(data={"bucket": "exports", "n": 1}, progress=[1, 2])
    page = text(admin_client.get(url("run_change", run.pk)))
    assert "<pre>{\n  &quot;bucket&quot;: &quot;exports&quot;,\n  &quot;n&quot;: 1\n}</pre>" in page
    assert "<pre>[\n  1,\n  2\n]</pre>" in page


def test_a_runs_title_is_in_the_admins_time_zone_and_names_it(admin_client: Client, settings: Any) -> None:
    """Helper 38: the heading, breadcrumb and history of a run showed its slot in UTC wall time,
    beside fields shown in the admin's time zone, neither named."""
    settings.TIME_ZONE = "Europe/Berlin"
    run = make_run(at=datetime(2026, 12, 6, 20, 33, 20, tzinfo=timezone.utc))
    assert str(run) == f"{run.job} @ 2026-12-06 21:33:20 CET #1 ({run.status})"
    page = text(admin_client.get(url("run_change", run.pk)))
    assert f"{run.job} @ 2026-12-06 21:33:20 CET" in page
    assert "20:33:20" not in page
    with django_timezone.override("UTC"):
        assert str(run).startswith(f"{run.job} @ 2026-12-06 20:33:20 UTC #1")


def test_user_with_view_permission_sees_runs_and_others_do_not(django_user_model: Any) -> None:
    make_run()
    viewer = staff_client(django_user_model, "view_run")
    assert viewer.get(url("run_changelist")).status_code == 200
    assert viewer.get(url("run_change", Run.objects.get().pk)).status_code == 200
    nobody = Client()
    nobody.force_login(django_user_model.objects.create_user("clerk", password="not-used", is_staff=True))
    assert nobody.get(url("run_changelist")).status_code == 403
    assert nobody.get(url("jobstate_changelist")).status_code == 403
    assert nobody.get(url("instance_changelist")).status_code == 403


# -- escaping ----------------------------------------------------------------------


def test_html_from_runs_jobs_and_instances_is_shown_escaped(admin_client: Client) -> None:
    run = make_run(
        job=PAYLOAD,
        status=Status.FAILED,
        error_type=PAYLOAD,
        error_message=PAYLOAD,
        traceback=f"Traceback (most recent call last):\n{PAYLOAD}",
        data={"html": PAYLOAD},
        progress=PAYLOAD,
        detail=PAYLOAD,
        instance_id=PAYLOAD,
    )
    JobState.objects.create(name=PAYLOAD, schedule=PAYLOAD, paused=True, pause_note=PAYLOAD)
    instance = Instance.objects.create(
        token="t" * 32,
        instance_id=PAYLOAD,
        host=PAYLOAD,
        pid=1,
        started_at=django_timezone.now(),
        last_heartbeat=django_timezone.now(),
    )
    make_run(job=PAYLOAD, at=datetime(2024, 3, 6, tzinfo=UTC), status=Status.RUNNING, owner=instance.token)
    state = JobState.objects.get(name=PAYLOAD)
    pages = [
        url("run_changelist"),
        url("run_change", run.pk),
        url("jobstate_changelist"),
        url("jobstate_change", quote(state.pk)),
        url("instance_changelist"),
        url("instance_change", instance.pk),
    ]
    for page in pages:
        response = admin_client.get(page)
        assert response.status_code == 200, page
        assert PAYLOAD not in text(response), page
        assert ESCAPED in text(response), page
    detail = text(admin_client.get(url("run_change", run.pk)))
    assert f"<pre>Traceback (most recent call last):\n{ESCAPED}</pre>" in detail
    assert f"&quot;html&quot;: &quot;{ESCAPED}&quot;" in detail


# -- jobs --------------------------------------------------------------------------


def test_jobs_list_creates_missing_rows_and_shows_schedules_due_times_and_last_runs(
    admin_client: Client, jobs: dict[str, Job]
) -> None:
    assert not JobState.objects.filter(name__in=jobs).exists()
    last = make_run(job=EVERY, status=Status.FAILED, error_message="boom")
    make_run(job=EVERY, at=datetime(2024, 3, 1, tzinfo=UTC))  # older: not the last run

    response = admin_client.get(url("jobstate_changelist"))
    assert response.status_code == 200
    assert set(JobState.objects.filter(name__in=jobs).values_list("name", flat=True)) == set(jobs)
    page = text(response)
    assert "every 10s" in page
    assert "At 06:00, on day 1 of the month (Europe/Paris; cron 0 6 1 * *)" in page
    due = datetime.fromtimestamp(jobs[CRON].schedule.next_after(int(datetime.now(UTC).timestamp() * 1000)) / 1000, UTC)
    local = django_timezone.template_localtime(due)
    assert local.strftime("<span>%Y-%m-%d</span> <span>%H:%M:%S</span>") in page  # each kept whole
    assert f'href="{url("run_change", last.pk)}"' in page
    row = next(s for s in shown(response) if s.name == EVERY)
    assert row.last_run_pk == last.pk and row.last_run_status == Status.FAILED
    assert "anarchon-status-failed" in page

    # A second visit writes nothing new and still lists each job once.
    response = admin_client.get(url("jobstate_changelist"))
    assert [s.name for s in shown(response)].count(EVERY) == 1
    for name in jobs:
        assert admin_client.get(url("jobstate_change", name)).status_code == 200
    detail = text(admin_client.get(url("jobstate_change", EVERY)))
    assert "overlap=skip, catch_up=latest" in detail and "tests.test_admin._noop" in detail
    assert f"{url('run_changelist')}?job={EVERY}" in detail


def test_undeclared_jobs_are_shown_as_such_and_never_deleted(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name="retired-job", schedule="every 5m", missed_count=3)
    changelist = url("jobstate_changelist")
    response = admin_client.get(changelist)
    assert response.status_code == 200
    assert "not declared in code" in text(response) and "every 5m" in text(response)
    assert [s.name for s in shown(admin_client.get(f"{changelist}?declared=no"))] == ["retired-job"]
    assert "retired-job" not in [s.name for s in shown(admin_client.get(f"{changelist}?declared=yes"))]
    assert admin_client.get(url("jobstate_change", "retired-job")).status_code == 200
    assert admin_client.get(url("jobstate_delete", "retired-job")).status_code == 403
    assert admin_client.get(url("jobstate_add")).status_code == 403
    assert 'value="delete_selected"' not in text(response)
    admin_client.post(changelist, {"action": "delete_selected", "_selected_action": ["retired-job"], "index": "0"})
    admin_client.get(changelist)
    assert JobState.objects.filter(name="retired-job", missed_count=3).exists()


def test_jobs_cannot_be_edited_directly(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name=EVERY)
    response = admin_client.post(url("jobstate_change", EVERY), {"paused": "on", "pause_note": "sneaky"})
    assert response.status_code == 403
    assert not JobState.objects.get(name=EVERY).paused


def test_schedules_in_words() -> None:
    scheduler.cron("admin-test-seconds", "*/15 * * * * 30", _noop, timezone="UTC")
    scheduler.every("admin-test-interval", "1h30m", _noop)
    try:
        seconds = describe_schedule(scheduler.job("admin-test-seconds").schedule)
        interval = describe_schedule(scheduler.job("admin-test-interval").schedule)
    finally:
        scheduler.registry.remove("admin-test-seconds")
        scheduler.registry.remove("admin-test-interval")
    # croniter's sixth field (seconds, last) is what cron-descriptor reads first.
    assert seconds == "At 30 seconds past the minute, every 15 minutes (UTC; cron */15 * * * * 30)"
    assert interval == "every 1h30m"
    assert format_seconds(0.25) == "0.25 s"
    assert format_seconds(185) == "3 min 5 s"
    assert format_seconds(7_200) == "2 h"
    assert format_seconds(86_400 + 60) == "24 h 1 min"
    assert format_seconds(3 * 86_400 + 3_600) == "3 d 1 h"


def test_run_now_records_a_pending_manual_run(admin_client: Client, jobs: dict[str, Job]) -> None:
    response = act(admin_client, "run_now", EVERY)
    assert response.status_code == 200
    run = Run.objects.get(job=EVERY)
    assert (run.status, run.reason, run.manual, run.attempt) == (Status.PENDING, Reason.MANUAL, True, 1)
    assert run.instance_id == "" and run.started_at is None, "the admin only records the request"
    page = text(response)
    assert f"Requested a run of {EVERY}, but no scheduler instance has sent a heartbeat lately" in page
    assert "starts it within one poll interval" not in page, "no promise that nobody can keep"

    Instance.objects.create(
        token="a" * 32,
        instance_id="node-1",
        host="h",
        pid=1,
        started_at=store.database_time(),
        last_heartbeat=store.database_time(),
    )
    response = act(admin_client, "run_now", EVERY, CRON)
    assert Run.objects.filter(reason=Reason.MANUAL, status=Status.PENDING).count() == 3
    assert "Requested runs of 2 jobs" in text(response)
    assert "no scheduler instance" not in text(response)


def test_run_now_on_an_undeclared_job_is_a_clear_error(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name="retired-job")
    response = act(admin_client, "run_now", "retired-job", EVERY)
    assert response.status_code == 200
    page = text(response)
    assert "Cannot run retired-job: it is not declared in code" in page
    assert f"Requested a run of {EVERY}" in page
    assert list(Run.objects.values_list("job", flat=True)) == [EVERY]
    assert JobState.objects.filter(name="retired-job").exists()


def test_pause_asks_for_a_note_then_pauses_and_shows_it(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name=EVERY)
    response = act(admin_client, "pause", EVERY)
    assert response.status_code == 200
    assert "admin/django_anarchon/jobstate/pause_confirmation.html" in [t.name for t in response.templates]
    page = text(response)
    assert 'name="reason"' in page and 'name="post"' in page and f'value="{EVERY}"' in page
    assert not JobState.objects.get(name=EVERY).paused, "nothing changes before the confirmation"

    before = store.database_time()
    response = confirm_pause(admin_client, EVERY, reason="database migration until 14:00")
    assert response.status_code == 200
    state = JobState.objects.get(name=EVERY)
    assert state.paused
    assert state.pause_note == "Paused by admin: database migration until 14:00"
    assert state.paused_at is not None and before - timedelta(seconds=1) <= state.paused_at <= store.database_time()
    assert f"Paused {EVERY}." in text(response)
    assert "Paused by admin: database migration until 14:00" in text(response), "note shown in the list"
    detail = text(admin_client.get(url("jobstate_change", EVERY)))
    assert "Paused by admin: database migration until 14:00" in detail

    # Pausing again keeps the first pause's note and time.
    response = confirm_pause(admin_client, EVERY, reason="second")
    assert "1 job was already paused." in text(response)
    # The job page's own buttons name the job as written: the admin capitalises a message's first
    # letter, and names differ by case (it said "Admin-test-every was already paused.").
    response = admin_client.post(url("jobstate_pause", EVERY), {"post": "yes", "reason": ""}, follow=True)
    assert f"Job {EVERY} was already paused." in text(response)
    again = JobState.objects.get(name=EVERY)
    assert (again.pause_note, again.paused_at) == (state.pause_note, state.paused_at)


def test_pause_without_a_reason_still_records_who(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name=CRON)
    confirm_pause(admin_client, CRON)
    assert JobState.objects.get(name=CRON).pause_note == "Paused by admin"


def test_resume_clears_paused_and_stamps_resumed_at(admin_client: Client, jobs: dict[str, Job]) -> None:
    JobState.objects.create(
        name=EVERY, paused=True, pause_note="Paused by ops: upgrade", paused_at=django_timezone.now()
    )
    JobState.objects.create(name=CRON)
    before = store.database_time()
    response = act(admin_client, "resume", EVERY, CRON)
    state = JobState.objects.get(name=EVERY)
    assert not state.paused
    assert state.resumed_at is not None and state.resumed_at >= before - timedelta(seconds=1)
    assert state.pause_note == "Paused by ops: upgrade", "the last pause stays on record"
    assert JobState.objects.get(name=CRON).resumed_at is None
    page = text(response)
    assert f"Resumed {EVERY}." in page and "1 job was not paused." in page
    assert "Paused by ops: upgrade" not in page, "the list shows the note only while paused"


def test_pause_and_resume_are_conditional_updates_of_only_their_fields() -> None:
    JobState.objects.create(name="m", missed_count=1)
    stale = JobState.objects.get(name="m")
    JobState.objects.filter(name="m").update(missed_count=7, schedule="every 1m")  # a scheduler wrote meanwhile

    assert stale.pause("first") is True
    assert stale.paused and stale.pause_note == "first" and stale.paused_at is not None
    assert abs((stale.paused_at - store.database_time()).total_seconds()) < 5, "the database clock"
    row = JobState.objects.get(name="m")
    assert (row.paused, row.pause_note, row.missed_count, row.schedule) == (True, "first", 7, "every 1m")

    other = JobState.objects.get(name="m")
    other.paused = False  # a stale copy that believes the job is running
    assert other.pause("second") is False
    assert other.pause_note == "first", "the loser sees the winner's values"

    assert stale.resume() is True
    assert stale.resume() is False
    row = JobState.objects.get(name="m")
    assert (row.paused, row.missed_count) == (False, 7) and row.resumed_at is not None


# -- permissions -------------------------------------------------------------------


def test_staff_without_action_permissions_can_neither_run_pause_nor_resume(
    django_user_model: Any, jobs: dict[str, Job]
) -> None:
    JobState.objects.create(name=EVERY)
    JobState.objects.create(name=CRON, paused=True, pause_note="kept")
    client = staff_client(django_user_model, "view_jobstate")
    response = client.get(url("jobstate_changelist"))
    assert response.status_code == 200
    for action in ("run_now", "pause", "resume"):
        assert f'value="{action}"' not in text(response)

    act(client, "run_now", EVERY)
    act(client, "pause", EVERY)
    confirm_pause(client, EVERY, reason="should not happen")
    act(client, "resume", CRON)

    assert not Run.objects.exists()
    assert not JobState.objects.get(name=EVERY).paused
    assert JobState.objects.get(name=CRON).paused


def test_each_action_needs_its_own_permission(django_user_model: Any, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name=EVERY)
    JobState.objects.create(name=CRON, paused=True)
    client = staff_client(django_user_model, "run_job")
    response = client.get(url("jobstate_changelist"))
    assert response.status_code == 200, "an action permission lets a user see the jobs"
    page = text(response)
    assert 'value="run_now"' in page and 'value="pause"' not in page and 'value="resume"' not in page

    confirm_pause(client, EVERY, reason="no")
    act(client, "resume", CRON)
    assert not JobState.objects.get(name=EVERY).paused and JobState.objects.get(name=CRON).paused
    act(client, "run_now", EVERY)
    assert Run.objects.filter(job=EVERY, reason=Reason.MANUAL).count() == 1

    pauser = staff_client(django_user_model, "pause_job", "resume_job", username="pauser")
    page = text(pauser.get(url("jobstate_changelist")))
    assert 'value="run_now"' not in page and 'value="pause"' in page and 'value="resume"' in page
    act(pauser, "run_now", EVERY)
    assert Run.objects.count() == 1
    confirm_pause(pauser, EVERY, reason="maintenance")
    act(pauser, "resume", CRON)
    assert JobState.objects.get(name=EVERY).pause_note == "Paused by pauser: maintenance"
    assert not JobState.objects.get(name=CRON).paused


# -- instances ---------------------------------------------------------------------


def test_instances_show_heartbeat_age_stale_marker_and_running_runs(admin_client: Client) -> None:
    now = store.database_time()
    live = Instance.objects.create(
        token="l" * 32,
        instance_id="node-live",
        host="web-1",
        pid=4242,
        started_at=now - timedelta(hours=1),
        last_heartbeat=now,
    )
    Instance.objects.create(
        token="s" * 32,
        instance_id="node-gone",
        host="web-2",
        pid=99,
        started_at=now - timedelta(days=1),
        last_heartbeat=now - timedelta(hours=2),
    )
    mine = make_run(job="long-job", status=Status.RUNNING, instance_id="node-live", owner=live.token)
    make_run(job="other-job", status=Status.RUNNING, instance_id="node-gone", owner="s" * 32)
    make_run(job="done-job", status=Status.SUCCESS, instance_id="node-live", owner=live.token)

    response = admin_client.get(url("instance_changelist"))
    assert response.status_code == 200
    page = text(response)
    assert page.count('class="anarchon-stale"') == 1
    assert "web-1" in page and "4242" in page and "(2 h ago)" in page
    assert f'<a href="{url("run_change", mine.pk)}">{mine}</a>' in page
    assert "done-job" not in page
    assert admin_client.get(url("instance_add")).status_code == 403
    assert admin_client.get(url("instance_delete", live.pk)).status_code == 403
    detail = admin_client.get(url("instance_change", live.pk))
    assert detail.status_code == 200 and "long-job" in text(detail) and "other-job" not in text(detail)


def test_cancel_pending_runs_needs_its_permission_skips_them_and_logs_who(django_user_model: Any) -> None:
    from django.contrib.admin.models import LogEntry

    waiting = make_run(status=Status.PENDING, reason=Reason.MANUAL, manual=True, started_at=None, finished_at=None)
    running = make_run(status=Status.RUNNING, slot=1, finished_at=None)
    viewer = staff_client(django_user_model, "view_run", username="viewer")
    assert 'value="cancel"' not in text(viewer.get(url("run_changelist")))
    viewer.post(url("run_changelist"), {"action": "cancel", "_selected_action": [waiting.pk], "index": "0"})
    assert Run.objects.get(pk=waiting.pk).status == Status.PENDING, "no permission, no change"

    from django_anarchon import metrics

    counted = metrics.SKIPPED.labels(waiting.job, "cancelled").get()
    canceller = staff_client(django_user_model, "cancel_run", username="oncall")
    page = canceller.get(url("run_changelist"))
    assert page.status_code == 200 and 'value="cancel"' in text(page), "the cancel permission shows the history"
    response = canceller.post(
        url("run_changelist"),
        {"action": "cancel", "_selected_action": [waiting.pk, running.pk], "index": "0"},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    assert "Cancelled 1 pending run." in messages
    assert any("1 selected run was not pending" in m for m in messages)
    cancelled = Run.objects.get(pk=waiting.pk)
    assert (cancelled.status, cancelled.detail) == (Status.SKIPPED, "cancelled by oncall in the admin")
    assert Run.objects.get(pk=running.pk).status == Status.RUNNING
    [entry] = LogEntry.objects.filter(object_id=str(waiting.pk))
    assert entry.user.get_username() == "oncall" and "cancelled by oncall" in entry.get_change_message()
    # anarchon_slots_skipped_total{reason="cancelled"}, in the process that cancelled (helper 29)
    assert metrics.SKIPPED.labels(waiting.job, "cancelled").get() == counted + 1


def test_cancel_with_select_all_reads_only_the_pending_runs(admin_client: Client, monkeypatch: Any) -> None:
    """ "Select all" on the history selects every run ever kept: only the pending ones are loaded."""
    at = datetime(2024, 3, 5, 12, 0, tzinfo=UTC)
    Run.objects.bulk_create(
        Run(job=EVERY, slot=n, status=Status.SUCCESS, reason=Reason.SCHEDULED, scheduled_at=at, finished_at=at)
        for n in range(1, 1500)
    )
    waiting = make_run(status=Status.PENDING, reason=Reason.MANUAL, manual=True, started_at=None, finished_at=None)
    loaded = []
    real = Run.from_db.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Run, "from_db", classmethod(lambda cls, *a: loaded.append(1) or real(cls, *a)))
    response = admin_client.post(
        url("run_changelist"),
        {"action": "cancel", "select_across": "1", "_selected_action": [waiting.pk], "index": "0"},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    assert "Cancelled 1 pending run." in messages and any("1499 selected runs were not pending" in m for m in messages)
    assert Run.objects.get(pk=waiting.pk).status == Status.SKIPPED
    assert len(loaded) < 200, f"{len(loaded)} runs loaded to cancel one"


# -- run data, job page buttons, run again, history -------------------------------------------


def history(obj: Any) -> list[str]:
    from django.contrib.admin.models import LogEntry

    return [entry.get_change_message() for entry in LogEntry.objects.filter(object_id=str(obj.pk)).order_by("id")]


def test_run_now_with_data_asks_for_json_checks_it_and_logs_who_asked(
    admin_client: Client, jobs: dict[str, Job]
) -> None:
    JobState.objects.create(name=EVERY)
    page = act(admin_client, "run_now_with_data", EVERY)
    assert "Data (JSON)" in text(page) and not Run.objects.exists(), "first the form"
    post = {"action": "run_now_with_data", "_selected_action": [EVERY], "with_data": "1"}
    bad = admin_client.post(url("jobstate_changelist"), {**post, "run_data": "{not json"}, follow=True)
    assert "This is not JSON" in text(bad) and not Run.objects.exists()
    tuple_data = admin_client.post(
        url("jobstate_changelist"), {**post, "run_data": '{"k": [1, {"2": 3}]}'}, follow=True
    )
    assert "Requested a run of" in text(tuple_data)
    [run] = Run.objects.filter(job=EVERY)
    assert (run.reason, run.manual, run.data) == ("manual", True, {"k": [1, {"2": 3}]})
    assert history(JobState.objects.get(name=EVERY)) == ['Requested a run now with data {"k": [1, {"2": 3}]}.']


def test_list_actions_leave_an_entry_in_the_jobs_history(admin_client: Client, jobs: dict[str, Job]) -> None:
    state = JobState.objects.create(name=EVERY)
    act(admin_client, "run_now", EVERY)
    confirm_pause(admin_client, EVERY, reason="deploy")
    act(admin_client, "resume", EVERY)
    assert history(state) == ["Requested a run now.", "Paused by admin: deploy", "Resumed by admin"]


def test_a_jobs_page_has_run_now_pause_and_resume_buttons(admin_client: Client, jobs: dict[str, Job]) -> None:
    state = JobState.objects.create(name=EVERY)
    page = text(admin_client.get(url("jobstate_change", EVERY)))
    assert 'class="anarchon-run-now"' in page and 'class="anarchon-pause"' in page and "anarchon-resume" not in page
    response = admin_client.post(url("jobstate_run_now", EVERY), follow=True)
    assert "Requested a run of" in text(response) and Run.objects.filter(job=EVERY, data__isnull=True).count() == 1
    assert "no scheduler instance has sent a heartbeat lately" in text(response), "none runs in this test"
    form = admin_client.post(url("jobstate_run_now", EVERY), {"with_data": "1"})
    assert "Data (JSON)" in text(form)
    admin_client.post(url("jobstate_run_now", EVERY), {"with_data": "1", "run_data": '"eu"'})
    assert Run.objects.filter(job=EVERY, data="eu").count() == 1
    assert "Why" in text(admin_client.post(url("jobstate_pause", EVERY))), "pausing asks why first"
    admin_client.post(url("jobstate_pause", EVERY), {"post": "yes", "reason": "migration"})
    state.refresh_from_db()
    assert state.paused and state.pause_note == "Paused by admin: migration"
    page = text(admin_client.get(url("jobstate_change", EVERY)))
    assert 'class="anarchon-resume"' in page and 'class="anarchon-pause"' not in page
    listing = text(admin_client.get(url("jobstate_changelist")))
    assert 'class="anarchon-paused">paused' in listing, "next due says the job is paused"
    admin_client.post(url("jobstate_resume", EVERY))
    state.refresh_from_db()
    assert not state.paused
    assert history(state)[-2:] == ["Paused by admin: migration", "Resumed by admin"]


def test_the_job_page_buttons_need_their_permissions(django_user_model: Any, jobs: dict[str, Job]) -> None:
    JobState.objects.create(name=EVERY)
    viewer = staff_client(django_user_model, "view_jobstate")
    page = text(viewer.get(url("jobstate_change", EVERY)))
    assert "anarchon-run-now" not in page and "anarchon-pause" not in page
    assert viewer.post(url("jobstate_run_now", EVERY)).status_code == 403
    assert viewer.post(url("jobstate_pause", EVERY), {"post": "yes"}).status_code == 403
    assert viewer.post(url("jobstate_resume", EVERY)).status_code == 403
    assert not Run.objects.exists() and not JobState.objects.get(name=EVERY).paused


def test_the_last_run_is_a_link_only_for_users_who_may_view_runs(
    django_user_model: Any, admin_client: Client, jobs: dict[str, Job]
) -> None:
    """A user with the jobs' permissions but not view_run got links that answered 403."""
    JobState.objects.create(name=EVERY)
    run = Run.objects.create(job=EVERY, slot=1_700_000_000_000, attempt=1, status="success", reason="scheduled",
                             scheduled_at=django_timezone.now())  # fmt: skip
    link = f'href="{url("run_change", run.pk)}"'
    assert link in text(admin_client.get(url("jobstate_changelist")))
    runner = staff_client(django_user_model, "view_jobstate")
    listing = text(runner.get(url("jobstate_changelist")))
    assert EVERY in listing and link not in listing


def test_a_run_can_be_run_again_with_the_same_data(admin_client: Client, django_user_model: Any,
                                                   jobs: dict[str, Job]) -> None:  # fmt: skip
    old = make_run(status=Status.FAILED, data={"customer": 42})
    page = text(admin_client.get(url("run_change", old.pk)))
    assert "Run again with the same data" in page
    response = admin_client.post(url("run_run_again", old.pk))
    again = Run.objects.exclude(pk=old.pk).get()
    assert response.status_code == 302 and response["Location"] == url("run_change", again.pk)
    assert (again.job, again.data, again.status, again.manual) == (EVERY, {"customer": 42}, "pending", True)
    assert history(old) == [f"Requested a run of {EVERY} again with the data of run {old.pk}."]
    viewer = staff_client(django_user_model, "view_run")
    assert "Run again with the same data" not in text(viewer.get(url("run_change", old.pk)))
    assert viewer.post(url("run_run_again", old.pk)).status_code == 403
    gone = make_run(job="not-declared", slot=5)
    assert "Run again with the same data" not in text(admin_client.get(url("run_change", gone.pk)))
