"""The dashboard in a real headless chromium (Debian's), against a real service, etcd and jobs.

Every test opens the page through `pages`, which watches each page it opens:
every request must stay on loopback, and the console must show no error and no
uncaught exception (asserted at the end of each test, and again at teardown for
a page a test did not check). Nothing is reloaded: the page must follow the
jobs by itself. Waiting is Playwright's (`expect` with timeouts), never a sleep.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from coordinator.etcd.client import Etcd
from coordinator.jobs.kinds import KINDS
from coordinator.service.model import JobSpec, JobState
from coordinator.service.rest.routers.dashboard import WEB
from coordinator.service.states import advance
from coordinator.service.store import JobStore
from tests.support.dashboard import CHROMIUM, HISTORY, PHASES, VIEWPORT, Watched, launch
from tests.support.service import READ_TOKEN, SUBMIT_TOKEN, ServiceProc, wait_state
from tests.support.signing import session_signer

pytestmark = pytest.mark.one_etcd
SECONDS = 1000  # Playwright's timeouts are in milliseconds


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard tests must run in CI: no chromium at {CHROMIUM}")
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def pages(browser: Browser) -> Iterator[Callable[..., Watched]]:
    """Open a page in a browser context of its own (its own sessionStorage)."""
    contexts = []
    opened: list[Watched] = []

    def open_page(url: str, history: bool = False) -> Watched:
        context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        contexts.append(context)
        if history:
            context.add_init_script(HISTORY)
        watched = Watched(context.new_page())
        watched.page.set_default_timeout(30 * SECONDS)
        opened.append(watched)
        watched.page.goto(url)
        return watched

    yield open_page
    try:  # the pages a test did not check (unless it failed on another page's problems)
        if not any(watched.failed for watched in opened):
            for watched in opened:
                if not watched.checked:
                    watched.assert_clean()
    finally:
        for context in contexts:
            context.close()


def signed_in(
    pages: Callable[..., Watched], service: ServiceProc, route: str, **kw: Any
) -> Watched:
    """A page opened from the link serve printed (its token in the fragment), then taken
    to `route` within the page."""
    page = pages("about:blank", **kw)
    page.sign_in(service.dashboard_link(), route)
    expect(page.page.locator("body")).to_have_attribute("data-role", "exec")
    return page


def api_message(service: ServiceProc, spec: dict[str, Any], field: str) -> str:
    """What the API says of `field` when `spec` is submitted (it must refuse it)."""
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    details = [d for d in response.json()["detail"] if d["loc"][-1] == field]
    assert details, response.text
    return str(details[0]["msg"]).removeprefix("Value error, ")


def in_order(phases: list[str]) -> bool:
    known = [PHASES.index(p) for p in phases if p in PHASES]
    return known == sorted(known)


# -- a job from the form to SUCCEEDED ---------------------------------------------------


def test_a_job_submitted_through_the_form_is_followed_live_to_succeeded(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()
    job = "dash-xgb"
    table = signed_in(pages, service, "#/")
    expect(table.page.locator("#jobs-count")).to_have_text("0")
    table.mark()

    form = signed_in(pages, service, "#/submit", history=True)
    form.mark()
    fields = form.page.locator("form#submit-form")
    fields.locator("[name=kind]").select_option("xgboost")
    fields.locator("[name=workers]").fill("2")
    # 30 rounds on 200,000 synthetic rows: about 2 s of training, so the curve is seen growing.
    fields.locator("[name=params]").fill("rounds=30\ndata=synthetic:200000x20")
    fields.locator("[name=id]").fill(job)
    form.page.locator("button#submit-job").click()
    expect(form.page).to_have_url(re.compile(rf"#/jobs/{job}$"))

    # The table, open since before the submit, shows the job by itself.
    row = table.page.locator(f'table#jobs tr[data-job="{job}"]')
    expect(row).to_be_visible()
    expect(row.locator("td.kind")).to_contain_text("xgboost")
    expect(row.locator("td.workers")).to_contain_text("2")
    expect(table.page.locator("#jobs-count")).to_have_text("1")

    # The job page follows it live to the end.
    expect(form.page.locator("#job-state")).to_have_text("SUCCEEDED", timeout=120 * SECONDS)
    record = wait_state(service, job, {"SUCCEEDED"}, timeout=10)
    members = form.page.locator("table#members tr[data-index]")
    expect(members).to_have_count(2)
    expect(members.locator("td.phase")).to_have_text(["done", "done"])
    expect(members.locator("td.exit")).to_have_text(["0", "0"])
    expect(members.locator("td.role")).to_have_text(["worker", "worker"])  # the kind's roles
    ranks = sorted(members.locator("td.rank").all_inner_texts())
    assert ranks == ["0", "1"], ranks
    for address in members.locator("td.address").all_inner_texts():
        assert address.strip() not in ("", "-"), "a member without an address"
    expect(form.page.locator("ol#conditions li")).to_have_count(len(record["conditions"]))
    expect(form.page.locator("ol#events li").first).to_be_visible()
    expect(form.page.locator("button#cancel")).to_have_count(0)  # final: nothing to cancel
    form.page.locator("select#log-rank").select_option("1")
    expect(form.page.locator("pre#logs")).to_contain_text('"event"')  # rank 1's JSON events

    history = form.history()
    assert len(history["phases"]) == 2, history
    for index, seen in history["phases"].items():
        assert seen[-1] == "done" and len(set(seen)) >= 2, f"member {index}: {seen}"
        assert in_order(seen), f"member {index}'s phases went back: {seen}"
    states = history["state"]
    assert states[-1] == "SUCCEEDED" and "RUNNING" in states, states
    curve = history["curve"]
    assert curve and curve[-1] >= 30, f"the curve drew {curve} points for 30 rounds"
    grew = [n for n in curve if 0 < n < curve[-1]]
    assert grew, f"the curve never showed a partial state; data-points went {curve}"
    assert curve == sorted(curve), f"the curve shrank: {curve}"

    # The table followed the job to its end as well, and neither page was reloaded.
    expect(row.locator("td.state")).to_have_text("SUCCEEDED")
    expect(row.locator("td.progress")).to_contain_text("30")
    assert table.marked() and form.marked(), "a page was reloaded"
    table.assert_clean()
    form.assert_clean()


# -- the table's filters ------------------------------------------------------------------


def test_the_filters_narrow_the_table(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
    etcd: Etcd,
) -> None:
    store = JobStore(etcd, session_signer())  # finished records, written before the service runs
    for job_id, kind, final, team in [
        ("f-ok", "noop", JobState.SUCCEEDED, "a"),
        ("f-failed", "xgboost", JobState.FAILED, "b"),
        ("f-cancelled", "noop", JobState.CANCELLED, "a"),
    ]:
        spec = JobSpec(id=job_id, kind=kind, workers=1, labels={"team": team})
        store.submit(spec, time.time())

        def finish(record: Any, final: JobState = final) -> Any:
            if final != JobState.CANCELLED:
                record = advance(record, JobState.STARTING, "attempt 1", time.time())
            return advance(record, final, "written by the test", time.time())

        store.update(job_id, finish)
    service = serve()
    page = signed_in(pages, service, "#/")
    count = page.page.locator("#jobs-count")
    rows = page.page.locator("table#jobs tr[data-job]")
    expect(count).to_have_text("3")

    def shown() -> list[str]:
        return sorted(row.get_attribute("data-job") or "" for row in rows.all())

    page.page.locator("select#filter-state").select_option("FAILED")
    expect(count).to_have_text("1")
    assert shown() == ["f-failed"]
    page.page.locator("select#filter-state").select_option("")
    page.page.locator("select#filter-kind").select_option("noop")
    expect(count).to_have_text("2")
    assert shown() == ["f-cancelled", "f-ok"]
    page.page.locator("select#filter-kind").select_option("")
    label = page.page.locator("input#filter-label")
    label.fill("team=b")
    label.press("Tab")  # a change event too, for a page that filters on change
    expect(count).to_have_text("1")
    assert shown() == ["f-failed"]
    label.fill("")
    label.press("Tab")
    expect(count).to_have_text("3")
    page.assert_clean()


# -- cancel ---------------------------------------------------------------------------------


def test_cancel_from_the_page_cancels_the_job(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()
    spec = {"id": "dash-cancel", "kind": "noop", "workers": 1, "params": {"seconds": 120}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    page = signed_in(pages, service, "#/jobs/dash-cancel")
    page.mark()
    state = page.page.locator("#job-state")
    expect(state).to_have_text("RUNNING", timeout=60 * SECONDS)
    page.page.on("dialog", lambda dialog: dialog.accept())  # an "are you sure?" is fine
    page.page.locator("button#cancel").click()
    expect(state).to_have_text("CANCELLED", timeout=30 * SECONDS)
    expect(page.page.locator("button#cancel")).to_have_count(0)
    record = wait_state(service, "dash-cancel", {"CANCELLED"}, timeout=10)
    assert record["conditions"][-1]["reason"] == "cancelled by request"
    expect(page.page.locator("ol#conditions li")).to_have_count(len(record["conditions"]))
    assert page.marked(), "the page was reloaded"
    page.assert_clean()


# -- the form's errors --------------------------------------------------------------------


def test_the_apis_messages_are_shown_next_to_their_fields(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()  # --max-workers 4
    page = signed_in(pages, service, "#/submit")
    page.expect_status(422, "/v1/jobs")  # the refusals this test provokes
    fields = page.page.locator("form#submit-form")
    submit = page.page.locator("button#submit-job")

    too_many = api_message(service, {"kind": "noop", "workers": 5}, "workers")
    fields.locator("[name=kind]").select_option("noop")
    fields.locator("[name=workers]").fill("5")
    submit.click()
    expect(page.page.locator('.field-error[data-field="workers"]')).to_contain_text(too_many)

    colour = api_message(
        service, {"kind": "noop", "workers": 1, "params": {"colour": "red"}}, "params"
    )
    assert "colour" in colour
    fields.locator("[name=workers]").fill("1")
    fields.locator("[name=params]").fill("colour=red")
    submit.click()
    expect(page.page.locator('.field-error[data-field="params"]')).to_contain_text(colour)
    # The workers' message was answered: it is gone, not left beside a valid value.
    expect(page.page.locator('.field-error[data-field="workers"]')).not_to_contain_text(too_many)
    expect(page.page).to_have_url(re.compile(r"#/submit$"))
    assert service.http.get("/v1/jobs").json()["jobs"] == []  # nothing was submitted
    page.assert_clean()


# -- tokens and roles --------------------------------------------------------------------------


def test_a_reader_sees_no_controls_and_a_submitter_does(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read {READ_TOKEN}\nsubmit {SUBMIT_TOKEN}\n")
    tokens.chmod(0o600)
    service = serve("--token-file", str(tokens))
    service.http.headers["Authorization"] = f"Bearer {SUBMIT_TOKEN}"
    spec = {"id": "dash-auth", "kind": "noop", "workers": 1, "params": {"seconds": 120}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    wait_state(service, "dash-auth", {"RUNNING"}, timeout=60)

    def log_in(page: Watched, token: str, role: str) -> None:
        body = page.page.locator("body")
        expect(body).to_have_attribute("data-role", "none")
        login = page.page.locator("form#login")
        expect(login).to_be_visible()
        login.locator("input[name=token]").fill(token)
        login.locator("button").click()
        expect(body).to_have_attribute("data-role", role)
        expect(login).to_be_hidden()

    reader = pages(f"{service.url}/#/")
    log_in(reader, READ_TOKEN, "read")
    expect(reader.page.locator('table#jobs tr[data-job="dash-auth"]')).to_be_visible()
    expect(reader.page.locator('a[href="#/submit"]:visible')).to_have_count(0)
    reader.route("#/jobs/dash-auth")
    expect(reader.page.locator("#job-state")).to_have_text("RUNNING")
    expect(reader.page.locator("table#members tr[data-index]")).to_have_count(1)
    expect(reader.page.locator("button#cancel")).to_have_count(0)
    reader.route("#/submit")
    expect(reader.page.locator("button#submit-job:visible:enabled")).to_have_count(0)
    stored = reader.page.evaluate(
        "() => ({session: Object.values(sessionStorage), local: Object.values(localStorage),"
        " cookie: document.cookie})"
    )
    assert READ_TOKEN in stored["session"], stored  # kept for the session...
    assert READ_TOKEN not in " ".join(stored["local"]) + stored["cookie"], stored  # ...only

    # Another session (a new browser context) asks again; a submitter gets the controls.
    submitter = pages(f"{service.url}/#/jobs/dash-auth")
    log_in(submitter, SUBMIT_TOKEN, "submit")
    expect(submitter.page.locator("#job-state")).to_have_text("RUNNING")
    expect(submitter.page.locator("button#cancel")).to_be_visible()
    submitter.route("#/submit")
    expect(submitter.page.locator("button#submit-job")).to_be_enabled()
    expect(submitter.page.locator("form#submit-form [name=kind]")).to_be_visible()
    offered = submitter.page.locator("form#submit-form [name=kind] option")  # no exec: no
    expect(offered).to_have_text([k for k in KINDS if not KINDS[k].needs_exec])  # programs

    for page in (reader, submitter):  # a token in a URL ends up in logs and history
        leaked = [r for r in page.requests if READ_TOKEN in r or SUBMIT_TOKEN in r]
        assert not leaked, leaked
    service.http.post("/v1/jobs/dash-auth/cancel")
    reader.assert_clean()
    submitter.assert_clean()


# -- kinds come from /v1/kinds ----------------------------------------------------------------


def without_comments(source: str) -> str:
    """JavaScript without its // line comments and /* */ blocks (a "//" inside a string,
    as in a URL, is kept: only one that starts a line or follows whitespace is a comment)."""
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.DOTALL)
    return re.sub(r"(^|\s)//.*$", r"\1", source, flags=re.MULTILINE)


def test_the_page_names_no_kind() -> None:
    modules = {path.name: without_comments(path.read_text()) for path in WEB.glob("*.js")}
    code = "\n".join(modules.values())
    assert "fetch(path" in code and "/v1/kinds" in code  # the check reads the real code
    named = re.compile(rf"\b({'|'.join(map(re.escape, KINDS))})\b")
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, module in sorted(modules.items())
        for number, line in enumerate(module.splitlines(), 1)
        if named.search(line)
    ]
    assert not found, "kind names in the dashboard's code (they come from /v1/kinds):\n" + (
        "\n".join(found)
    )
    assert named.search("const kinds = ['noop']")  # the pattern does find a name


def test_the_forms_kinds_and_their_help_come_from_v1_kinds(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()
    served = service.http.get("/v1/kinds").json()["kinds"]
    page = signed_in(pages, service, "#/submit")
    form = page.page.locator("form#submit-form")
    expect(form.locator("[name=kind] option")).to_have_text([k["name"] for k in served])
    filters = signed_in(pages, service, "#/")
    expect(filters.page.locator("#filter-kind option")).to_have_text(
        ["any kind", *[k["name"] for k in served]]
    )
    for kind in served:
        form.locator("[name=kind]").select_option(kind["name"])
        expect(page.page.locator("#kind-description")).to_have_text(kind["description"])
        rows = page.page.locator("#param-help tbody tr")
        expect(rows).to_have_count(len(kind["params"]))
        assert rows.evaluate_all("rows => rows.map((row) => row.dataset.param)") == [
            p["name"] for p in kind["params"]
        ]
        example = "\n".join(f"{k}={v}" for k, v in kind["example"].items())
        expect(form.locator("[name=params]")).to_have_attribute("placeholder", example)
        program = form.locator("input[name=command]")
        expect(program).to_have_count(1 if kind["takes_command"] else 0)
    ps = page.page.locator('#param-help tr[data-param="grace_seconds"] td')
    expect(ps).to_have_text(["grace_seconds", "number", "10", re.compile("SIGKILL")])
    page.assert_clean()
    filters.assert_clean()


def test_a_command_job_shows_its_members_and_their_logs(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()  # its generated token (service.http's) has the exec role
    code = "import os; print('greetings from rank', os.environ['RANK'], flush=True)"
    spec = {"id": "dash-prog", "kind": "command", "workers": 2,
            "command": [sys.executable, "-c", code]}  # fmt: skip
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    page = signed_in(pages, service, "#/jobs/dash-prog")
    expect(page.page.locator("#job-state")).to_have_text("SUCCEEDED", timeout=90 * SECONDS)
    members = page.page.locator("table#members tr[data-index]")
    expect(members).to_have_count(2)
    expect(members.locator("td.rank")).to_have_text(["0", "1"])
    expect(members.locator("td.role")).to_have_text(["worker", "worker"])
    expect(members.locator("td.exit")).to_have_text(["0", "0"])
    logs = page.page.locator("pre#logs")
    expect(logs).to_contain_text("greetings from rank 0")
    expect(logs).to_contain_text("greetings from rank 1")
    page.page.locator("select#log-rank").select_option(label="rank 1")
    expect(logs).to_contain_text("greetings from rank 1")
    expect(logs).not_to_contain_text("greetings from rank 0")
    expect(page.page.locator("[data-shows]:visible")).to_have_count(0)  # no charts: no data

    # A 3-member job whose rank 1 raises (the others' programs fail after it, as a
    # collective's peers would) opens on rank 1's output, its reason naming it first.
    crash = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1': raise RuntimeError('boom on rank 1 at step 5')\n"
        "time.sleep(1); sys.exit('gloo: connection closed by peer')\n"
    )
    spec = {"id": "dash-crash", "kind": "command", "workers": 3,
            "command": [sys.executable, "-c", crash]}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    page.page.evaluate("location.hash = '#/jobs/dash-crash'")
    expect(page.page.locator("#job-state")).to_have_text("FAILED", timeout=90 * SECONDS)
    reason = page.page.locator("#job-reason")
    expect(reason).to_have_text(
        re.compile(r"^rank 1: the program exited with code 1 \(RuntimeError: boom on rank 1")
    )
    expect(reason).to_have_text(re.compile(r"its output: coordinator logs dash-crash --rank 1$"))
    expect(page.page.locator("select#log-rank option:checked")).to_have_text("rank 1")
    expect(logs).to_contain_text("[rank 1] RuntimeError: boom on rank 1 at step 5")
    page.assert_clean()


REPORTER = """
import coordinator
ctx = coordinator.context()
for step in range(1, 9):
    ctx.report(step=step, total=8, perplexity=40.0 / step, reward=step / 8)
    ctx.flush()  # every step its own point
"""


def test_a_command_jobs_reported_metrics_make_its_learning_curve(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    """Metrics a program reports (`ctx.report`, names of its own) are drawn as the job's
    curve, titled as reported metrics, by step."""
    service = serve()
    spec = {"id": "dash-report", "kind": "command", "workers": 2,
            "command": [sys.executable, "-c", REPORTER]}  # fmt: skip
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    page = signed_in(pages, service, "#/jobs/dash-report")
    expect(page.page.locator("#job-state")).to_have_text("SUCCEEDED", timeout=90 * SECONDS)
    card = page.page.locator('[data-shows="curve"]')
    expect(card).to_be_visible()
    expect(page.page.locator("#curve-title")).to_have_text("Reported metrics")
    chart = page.page.locator("svg#chart-curve")
    expect(chart).to_have_attribute("data-points", "16")  # 8 steps x 2 metrics
    expect(chart.locator("text.legend")).to_have_text(["perplexity", "reward"])
    expect(chart).to_contain_text("step")  # the x axis' label
    latest = page.page.locator("#curve-latest")
    expect(latest).to_have_text("latest: perplexity 5.000, reward 1.000")
    expect(page.page.locator("select#curve-axis option").first).to_have_text("by step")
    expect(page.page.locator('[data-shows="clocks"]:visible')).to_have_count(0)  # no clocks
    page.assert_clean()


# -- the simulator ------------------------------------------------------------------------------


def test_the_simulator_draws_the_step_distribution(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()
    page = signed_in(pages, service, "#/simulate")
    fields = page.page.locator("form#simulate-form")
    fields.locator("[name=barrier]").fill("bsp,ssp:2,asp")
    fields.locator("[name=workers]").fill("20")
    fields.locator("[name=seconds]").fill("20")
    page.page.locator("button#run-simulation").click()
    chart = page.page.locator("svg#chart-simulation")
    expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
    page.assert_clean()


# -- the link serve prints ----------------------------------------------------------------------


def test_the_printed_link_signs_in_and_the_token_leaves_the_address_bar(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    service = serve()
    token = service.generated_token()
    assert token is not None
    link = service.dashboard_link()
    assert link == f"{service.url}/#token={token}"  # in the fragment: never sent to a server
    page = pages(link)
    expect(page.page.locator("body")).to_have_attribute("data-role", "exec")
    expect(page.page.locator("table#jobs")).to_be_visible()
    # Every module of the page came, as JavaScript (a browser refuses a module script of
    # another type), and ran: importing it again gives its module, not its error.
    modules = sorted(f"/ui/{path.name}" for path in WEB.glob("*.js"))
    assert len(modules) > 2, modules
    answered = {urlsplit(url).path: answer for url, answer in page.answers.items()}
    for module in modules:
        status, kind = answered.get(module, (None, ""))
        assert status == 200, f"{module}: {status}"
        assert kind.split(";")[0] in ("text/javascript", "application/javascript"), (module, kind)
    page.page.evaluate("async (urls) => { for (const url of urls) await import(url); }", modules)
    assert page.page.url == f"{service.url}/#/"  # out of the address bar...
    stored = page.page.evaluate("() => Object.values(sessionStorage)")
    assert token in stored, stored
    leaked = [r for r in page.requests if token in r]
    assert not leaked, leaked
    page.page.go_back()  # ...and out of the history: the entry before is the blank tab's
    assert token not in page.page.url, page.page.url
    # A page opened without the link asks for a token: the service has auth on.
    bare = pages(f"{service.url}/#/")
    expect(bare.page.locator("form#login")).to_be_visible()
    page.assert_clean()
    bare.assert_clean()

    # A link to a job's page carries the token too, and lands on that page without it.
    job = service.http.post("/v1/jobs", json={"kind": "noop", "workers": 1}).json()["id"]
    to_job = pages(f"{link}&/jobs/{job}")
    expect(to_job.page.locator("#job-state")).to_have_text(re.compile("[A-Z]+"))
    assert to_job.page.url == f"{service.url}/#/jobs/{job}"
    to_job.assert_clean()


def test_the_jobs_count_says_loading_until_the_jobs_come(
    serve: Callable[..., ServiceProc],
    pages: Callable[..., Watched],
) -> None:
    """Not "Jobs 0" before the first answer: a list that never comes shows no count."""
    service = serve()
    service.http.post("/v1/jobs", json={"kind": "noop", "workers": 1})
    page = pages("about:blank")
    page.page.route(re.compile(r".*/v1/jobs(\?.*)?$"), lambda route: route.abort())
    page.page.goto(service.dashboard_link())
    expect(page.page.locator("body")).to_have_attribute("data-role", "exec")
    expect(page.page.locator("#jobs-count")).to_have_text("…")
    page.page.unroute(re.compile(r".*/v1/jobs(\?.*)?$"))
    page.page.reload()
    expect(page.page.locator("#jobs-count")).to_have_text("1")
    page.checked = True  # (the aborted requests are this test's own doing)
