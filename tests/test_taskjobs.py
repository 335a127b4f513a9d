"""Task jobs: a job declared with a django.tasks task enqueues it once per slot, recorded with the run.

In-process, on the suite's database: the database backend (django-tasks-db, or django-tasks
0.11's own on Django 4.2), the immediate backend and the dummy one (tests/settings.py TASKS).
Several real instances, a database worker and a SIGKILL are in test_process.py.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client, override_settings

from django_anarchon import JobDeclarationError, Scheduler, TaskFailed, run_now, signals, store, taskjobs
from django_anarchon.checks import check_task_jobs
from django_anarchon.models import JobState, Run
from django_anarchon.testing import run_job
from tests.conftest import ON_DEMAND, Cluster, finished, start, wait_for
from tests.testapp import tasks
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def task_results() -> Any:
    """The database backend's result model (django-tasks-db's, or django-tasks 0.11's)."""
    model = taskjobs.result_model(taskjobs.backend_of(tasks.record_slot))
    assert model is not None, "the default task backend of tests/settings.py is not the database backend"
    return model


def work_off_queue() -> None:
    """Run every queued task once, as `manage.py db_worker --batch` does, in this process."""
    call_command("db_worker", "--batch", "--no-startup-delay", "--interval", "0", verbosity=0)


# -- declarations ----------------------------------------------------------------------------------


@tasks.task()
def takes_no_slot() -> None:
    """A task function that cannot receive the slot."""


@tasks.task()
def takes_everything(**kwargs: Any) -> None:
    """A task function that takes any keyword."""


def test_cron_and_every_accept_a_task_and_return_it() -> None:
    sched = Scheduler()
    assert sched.cron("nightly", "0 3 * * *", task=tasks.record_slot, timezone="Europe/Paris") is tasks.record_slot
    assert sched.every("often", "10s", task=tasks.slot_only) is tasks.slot_only
    nightly = sched.job("nightly")
    assert nightly.task is tasks.record_slot and nightly.is_task_job and not nightly.is_async
    assert nightly.origin.startswith("tests.testapp.tasks.record_slot:")
    assert nightly.task_arguments is not None and nightly.task_arguments.data  # record_slot takes data
    often = sched.job("often")
    assert often.task_arguments is not None and not often.task_arguments.data


def test_the_decorator_stacks_on_task() -> None:
    sched = Scheduler()
    declared = sched.cron("stacked", "*/5 * * * *")(tasks.slot_only)
    assert declared is tasks.slot_only
    assert sched.job("stacked").task is tasks.slot_only


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda s: s.every("x", "1s", task=takes_no_slot), "cannot be called with slot=<ms since the epoch>"),
        (lambda s: s.every("x", "1s", task=tasks.slot_only, data={"a": 1}), "takes no 'data' argument"),
        (lambda s: s.every("x", "1s", task=tasks.slot_only, timeout="5s"), "timeout does not apply to a task job"),
        (lambda s: s.every("x", "1s", task=print), "task= must be a task"),
        (lambda s: s.every("x", "1s", lambda ctx: None, task=tasks.slot_only), "either a handler or task="),
    ],
)
def test_a_bad_task_declaration_names_the_job_and_says_what_is_valid(call: Any, words: str) -> None:
    with pytest.raises(JobDeclarationError) as raised:
        call(Scheduler())
    assert raised.value.job == "x" and words in str(raised.value)


def test_declared_data_goes_to_a_task_that_takes_kwargs() -> None:
    sched = Scheduler()
    sched.every("kw", "1s", task=takes_everything, data={"k": 1})
    sched.every("kw-no-data", "1s", task=takes_everything)
    assert sched.job("kw").task_arguments == taskjobs.TaskArguments(data=True)
    assert sched.job("kw-no-data").task_arguments == taskjobs.TaskArguments(data=False)


def test_without_a_task_framework_a_task_job_is_a_declaration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("django_anarchon.registry.task_classes", lambda: ())
    with pytest.raises(JobDeclarationError, match=r"pip install 'django-anarchon\[tasks\]'"):
        Scheduler().every("x", "1s", task=tasks.slot_only)


# -- system checks ---------------------------------------------------------------------------------


def check_messages(monkeypatch: pytest.MonkeyPatch, sched: Scheduler) -> list[Any]:
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", sched)
    return check_task_jobs()


def test_a_task_on_the_dummy_backend_is_a_check_error(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = Scheduler()
    sched.every("dummy", "1s", task=tasks.never_runs)
    [message] = check_messages(monkeypatch, sched)
    assert message.id == "anarchon.E006" and "'dummy'" in message.msg and "never runs them" in message.msg


def test_the_database_backend_on_the_schedulers_database_and_the_immediate_one_pass_the_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched = Scheduler()
    sched.every("db", "1s", task=tasks.record_slot)
    sched.every("now", "1s", task=tasks.record_now)
    assert check_messages(monkeypatch, sched) == []


def test_a_backend_outside_the_schedulers_database_gets_a_warning_that_says_what_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched = Scheduler()
    sched.every("db", "1s", task=tasks.record_slot)
    monkeypatch.setattr(taskjobs, "result_model", lambda backend: None)  # as a Redis or RQ backend
    [message] = check_messages(monkeypatch, sched)
    assert message.id == "anarchon.W003" and "enqueues the task again" in message.msg
    assert "slot=" in message.hint


def test_a_backend_that_refuses_the_task_is_a_check_error(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = Scheduler()
    sched.every("db", "1s", task=tasks.record_slot)
    backend_class = type(taskjobs.backend_of(tasks.record_slot))

    def refuse(self: Any, task: Any) -> None:
        raise ValueError("this backend does not support priorities")

    monkeypatch.setattr(backend_class, "validate_task", refuse)
    [message] = check_messages(monkeypatch, sched)
    assert message.id == "anarchon.E006" and "does not support priorities" in message.msg


# -- the transaction that enqueues and records ------------------------------------------------------


def held_run(owner: str) -> Run:
    return Run.objects.create(
        job="tx",
        slot=1_000,
        attempt=1,
        status="running",
        reason="scheduled",
        scheduled_at=store.slot_datetime(1_000),
        owner=owner,
        lease_expires_at=store.db_in(60),
    )


def enqueue_record_slot() -> taskjobs.Enqueued:
    return taskjobs.enqueue(tasks.record_slot, taskjobs.TaskArguments(data=True), 1_000, {"x": 1})


def test_the_enqueue_commits_with_the_runs_success() -> None:
    run = held_run(owner="me")
    enqueued = store.finish_enqueued(run.id, owner="me", enqueue=enqueue_record_slot)
    assert enqueued is not None
    run.refresh_from_db()
    assert run.status == "success" and run.task_result_id == enqueued.result_id
    row = task_results().objects.get(id=enqueued.result_id)
    assert row.args_kwargs["kwargs"] == {"slot": 1_000, "data": {"x": 1}}


def test_a_run_no_longer_ours_rolls_its_enqueue_back() -> None:
    run = held_run(owner="someone-else")  # taken over: another token holds the lease
    assert store.finish_enqueued(run.id, owner="me", enqueue=enqueue_record_slot) is None
    assert task_results().objects.count() == 0
    run.refresh_from_db()
    assert run.status == "running" and run.task_result_id is None


def test_a_run_taken_over_rolls_the_enqueue_back() -> None:
    run = held_run(owner="me")
    Run.objects.filter(id=run.id).update(lease_expires_at=store.db_in(-1))
    assert store.take_over(run, owner="b", instance_id="i-b", ttl=30.0, start=False) is not None
    assert store.finish_enqueued(run.id, owner="me", enqueue=enqueue_record_slot) is None
    assert task_results().objects.count() == 0


def test_an_expired_lease_nobody_took_over_still_enqueues_and_records_the_run() -> None:
    # The database was unreachable past the lease (helper 32): the run is still ours to end.
    run = held_run(owner="me")
    Run.objects.filter(id=run.id).update(lease_expires_at=store.db_in(-1))
    assert store.finish_enqueued(run.id, owner="me", enqueue=enqueue_record_slot) is not None
    assert task_results().objects.count() == 1
    assert Run.objects.get(id=run.id).status == "success"


def test_an_enqueue_that_raises_leaves_nothing_behind() -> None:
    run = held_run(owner="me")

    def enqueue() -> taskjobs.Enqueued:
        enqueue_record_slot()
        raise RuntimeError("the backend fell over after writing")

    with pytest.raises(RuntimeError):
        store.finish_enqueued(run.id, owner="me", enqueue=enqueue)
    assert task_results().objects.count() == 0
    run.refresh_from_db()
    assert run.status == "running"


# -- the engine ------------------------------------------------------------------------------------


def test_each_slot_enqueues_its_task_once_and_the_worker_runs_it_with_the_slot(sched: Scheduler) -> None:
    succeeded: list[Any] = []

    def note(sender: Any, run: Run, **kwargs: Any) -> None:
        succeeded.append(run)

    signals.run_succeeded.connect(note, weak=False)
    try:
        sched.every("report", "300ms", task=tasks.record_slot, data={"to": "ops"})
        start(sched)
        # Three enqueued slots. On a busy machine (CI runs two environments at once) an enqueue and
        # its record can take longer than the 300 ms interval: the next slot is then skipped, as
        # overlap="skip" says; that is not what this test is about.
        runs = wait_for(
            lambda: (
                (rows := list(Run.objects.filter(job="report", status="success").order_by("slot")))
                and len(rows) >= 3
                and rows
            ),
            10,
            what="three enqueued slots",
        )
        sched.stop()
    finally:
        signals.run_succeeded.disconnect(note)
    assert not Run.objects.filter(job="report", status="failed").exists()
    results = task_results()
    for run in runs:
        assert run.status == "success" and run.task_result_id, run
        row = results.objects.get(id=run.task_result_id)
        assert row.args_kwargs["kwargs"] == {"slot": run.slot, "data": {"to": "ops"}}
    done = list(Run.objects.filter(job="report", status="success"))
    assert results.objects.count() == len(done)  # one task per successful run, none for anything else
    assert {r.task_result_id for r in succeeded} >= {r.task_result_id for r in runs}
    # A queued task does not hold the job: later slots enqueued although no worker ran the first.
    assert results.objects.filter(status="READY").count() == len(done)
    work_off_queue()
    executed = Execution.objects.filter(job="task:record_slot")
    assert sorted(e.slot for e in executed) == sorted(r.slot for r in done)
    assert all(e.data == {"to": "ops"} for e in executed)


def test_the_immediate_backend_runs_the_task_in_the_schedulers_worker(sched: Scheduler) -> None:
    sched.every("now", "300ms", task=tasks.record_now, data=[1, 2])
    start(sched)
    [run, *_] = finished("now", status="success")
    assert run.status == "success" and run.task_result_id
    assert Execution.objects.filter(job="task:record_now", slot=run.slot, data=[1, 2]).count() == 1


def test_a_task_that_raises_on_the_immediate_backend_fails_the_run_and_its_writes_roll_back(
    sched: Scheduler,
) -> None:
    failures: list[BaseException] = []

    def note(sender: Any, run: Run, exception: BaseException, **kwargs: Any) -> None:
        failures.append(exception)

    signals.run_failed.connect(note, weak=False)
    try:
        sched.every("boom", "300ms", task=tasks.fail_now)
        start(sched)
        [run, *_] = finished("boom", status="failed")
        wait_for(lambda: failures, 5, what="run_failed")
    finally:
        signals.run_failed.disconnect(note)
    assert run.status == "failed" and run.error_type == "ValueError"
    assert f"task failed for slot {run.slot}" in run.error_message and "fail_now" in run.traceback
    assert isinstance(failures[0], TaskFailed)
    assert not Execution.objects.filter(job="task:fail_now").exists()  # written in the run's transaction
    assert not run.task_result_id


def test_an_enqueue_that_fails_records_the_run_failed_with_the_error(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend_class = type(taskjobs.backend_of(tasks.record_slot))

    def refuse(self: Any, task: Any, args: Any, kwargs: Any) -> Any:
        raise ConnectionError("the queue refused the task")

    monkeypatch.setattr(backend_class, "enqueue", refuse)
    sched.every("refused", "300ms", task=tasks.record_slot)
    start(sched)
    [run, *_] = finished("refused", status="failed")
    assert run.status == "failed" and run.error_type == "ConnectionError"
    assert "the queue refused the task" in run.error_message
    assert task_results().objects.count() == 0


def test_run_now_enqueues_a_manual_run_with_its_data(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    sched.every("on-demand", ON_DEMAND, task=tasks.record_slot)
    sched.every("slot-only", ON_DEMAND, task=tasks.slot_only)
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", sched)
    start(sched)
    pending = run_now("on-demand", {"why": "asked"})
    [run] = finished("on-demand")
    assert run.id == pending.id and run.manual and run.status == "success"
    row = task_results().objects.get(id=run.task_result_id)
    assert row.args_kwargs["kwargs"] == {"slot": run.slot, "data": {"why": "asked"}}
    with pytest.raises(JobDeclarationError, match="takes no 'data' argument"):
        run_now("slot-only", {"lost": True})


def test_a_paused_task_job_enqueues_nothing(sched: Scheduler) -> None:
    sched.every("paused", "200ms", task=tasks.record_slot)
    sched.every("witness", "200ms", lambda ctx: None)
    JobState.objects.create(name="paused", paused=True)
    start(sched)
    finished("witness", 4)  # four slots of the other job went by
    assert not Run.objects.filter(job="paused").exists()
    assert task_results().objects.count() == 0


def test_run_job_enqueues_a_task_jobs_task_in_the_tests_transaction() -> None:
    sched = Scheduler()
    sched.every("now", "1s", task=tasks.record_now)
    outcome = run_job("now", scheduler=sched, slot=5_000, data={"d": 1})
    assert outcome.status == "success" and isinstance(outcome.result, taskjobs.Enqueued)
    assert Execution.objects.filter(job="task:record_now", slot=5_000, data={"d": 1}).count() == 1
    sched.every("boom", "1s", task=tasks.fail_now)
    failed = run_job("boom", scheduler=sched, slot=6_000)
    assert failed.status == "failed" and isinstance(failed.error, TaskFailed)
    # As the scheduler records it: the task that raised leaves none of its writes.
    assert not Execution.objects.filter(job="task:fail_now").exists()
    # Data for a task that takes none is refused, as run_now() and --run refuse it, not dropped.
    sched.every("slot-only", "1s", task=tasks.slot_only)
    with pytest.raises(JobDeclarationError, match=r"takes no 'data' argument, so run_job\(\) cannot pass"):
        run_job("slot-only", scheduler=sched, data={"lost": True})
    assert run_job("slot-only", scheduler=sched).status == "success"


# -- admin -----------------------------------------------------------------------------------------


@override_settings(ROOT_URLCONF="tests.urls")
def test_the_admin_links_a_run_to_its_task_result(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = Scheduler()
    sched.every("linked", ON_DEMAND, task=tasks.record_slot)
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", sched)
    run = held_run(owner="me")
    Run.objects.filter(id=run.id).update(job="linked")
    enqueued = store.finish_enqueued(run.id, owner="me", enqueue=enqueue_record_slot)
    assert enqueued is not None
    model = task_results()
    assert apps.get_model(model._meta.app_label, model._meta.model_name) is model
    User.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.login(username="admin", password="pw")
    page = client.get(f"/admin/django_anarchon/run/{run.id}/change/").content.decode()
    link = f"/admin/{model._meta.app_label}/{model._meta.model_name}/{enqueued.result_id}/change/"
    assert link in page
    assert client.get(link).status_code == 200


def test_a_missed_slot_is_caught_up_by_enqueuing_its_task_once(sched: Scheduler) -> None:
    """The cluster was down over a slot of a 10 s task job: the catch-up run enqueues that slot's task."""
    sched.every("nightly", "10s", task=tasks.record_slot, catch_up="latest")
    base = (int(time.time()) // 10 - 4) * 10_000  # ran 40 s ago, then nobody ran it
    [old] = store.decide(
        [store.Claim(sched.job("nightly"), base)], owner="gone", instance_id="gone", ttl=30, capacity=1
    ).won
    store.finish(old.id, owner="gone", status="success")
    start(sched)
    caught = wait_for(
        lambda: Run.objects.filter(job="nightly", reason="catch-up", status="success").first(), 10, what="catch-up"
    )
    assert base < caught.slot <= time.time() * 1000
    row = task_results().objects.get(id=caught.task_result_id)
    assert row.args_kwargs["kwargs"]["slot"] == caught.slot
    # The latest missed slot only, once. A slot that came due since the start runs as scheduled
    # and enqueues its own task (the test may start within a slot's grace period).
    slots = [result.args_kwargs["kwargs"]["slot"] for result in task_results().objects.all()]
    assert slots.count(caught.slot) == 1 and not [s for s in slots if s < caught.slot], slots
    assert not Run.objects.filter(job="nightly", slot__gt=caught.slot).exclude(reason="scheduled").exists()


def test_the_command_refuses_to_start_a_task_job_on_the_dummy_backend(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "nowhere", "every": "1s", "kind": "task", "task": "never_runs"}]
    done = cluster.manage("anarchon", timeout=60)
    assert done.returncode != 0
    assert "anarchon.E006" in done.stderr and "'nowhere'" in done.stderr, done.stderr


def admin_with_task_jobs(monkeypatch: pytest.MonkeyPatch, jobs: dict[str, Any]) -> Client:
    """A superuser's admin client, with these task jobs (name: task) declared on the default scheduler."""
    sched = Scheduler()
    for name, task in jobs.items():
        sched.every(name, ON_DEMAND, task=task)
        JobState.objects.create(name=name)
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", sched)
    User.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.login(username="admin", password="pw")
    return client


@override_settings(ROOT_URLCONF="tests.urls")
def test_run_now_with_data_in_the_admin_says_why_a_task_that_takes_none_cannot_have_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = admin_with_task_jobs(monkeypatch, {"slot-only": tasks.slot_only})
    page = client.post("/admin/django_anarchon/jobstate/slot-only/run-now/", {"run_data": '{"a": 1}'})
    assert page.status_code == 200
    assert "takes no &#x27;data&#x27; argument" in page.content.decode()
    assert not Run.objects.exists()
    done = client.post("/admin/django_anarchon/jobstate/slot-only/run-now/", {"run_data": ""})
    assert done.status_code == 302 and Run.objects.filter(job="slot-only", manual=True).count() == 1


@override_settings(ROOT_URLCONF="tests.urls")
def test_the_run_now_with_data_action_refuses_data_a_selected_task_cannot_take_before_recording_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The changelist action, on two jobs at once: one task takes data, the other none. It answered
    # 500 after recording the first job's run; now the form says why, and nothing is recorded.
    client = admin_with_task_jobs(monkeypatch, {"takes-data": tasks.record_slot, "slot-only": tasks.slot_only})
    post = {"action": "run_now_with_data", "_selected_action": ["takes-data", "slot-only"], "run_data": '{"a": 1}'}
    page = client.post("/admin/django_anarchon/jobstate/", post)
    assert page.status_code == 200
    body = page.content.decode()
    assert "&#x27;slot-only&#x27;" in body and "takes no &#x27;data&#x27; argument" in body, body
    assert not Run.objects.exists()
    post["_selected_action"] = ["takes-data"]
    done = client.post("/admin/django_anarchon/jobstate/", post)
    assert done.status_code == 302
    assert list(Run.objects.values_list("job", "data")) == [("takes-data", {"a": 1})]
