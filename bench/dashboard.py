"""The dashboard in headless chromium: the jobs table with 1,000 jobs, and live step clocks.

    python bench/dashboard.py                         # both parts
    python bench/dashboard.py --jobs 1000 --loads 5 --ranks 20 --rate 10 --seconds 30
    python bench/dashboard.py --screenshots docs/     # only the screenshots (issue 12)

Everything is real and on this machine's loopback: an embedded etcd, `coordinator
serve` as a subprocess, Debian's chromium driven by Playwright (tests/support/dashboard.py:
every request must stay on loopback, the console must stay free of errors).

1. **The jobs table.** N finished jobs are written to etcd through the service's
   `JobStore` before the service starts. Each load opens `/#/` in a new browser
   context (a cold cache) and times, in the page, from navigation start
   (`performance.now()`'s origin) to the first frame after the table holds all N
   rows (`tr[data-job]`) and `#jobs-count` says N; median of `--loads`. Baselines
   in the same browser and run: `/healthz` to its load event (the floor of a
   navigation here), and the API alone: every record over REST with httpx. Target:
   under 1 s.
2. **Live step clocks.** A running noop job (one member, `seconds` 600) is opened
   at `#/jobs/<id>`; this process then writes R trainers' clock keys
   (`<ns>/jobs/<id>/steps/<round>/clocks/<rank:06d>`, zero-padded decimal) at U
   updates per second each, evenly spread, for S seconds. Every 0.5 s it compares
   what was written with `window.dashboard.clocks` (rank -> the latest clock the
   page drew): steps behind, and seconds behind (since the first write the page
   does not show yet; 0 when it is up to date). The baseline is the same SSE
   stream (`/v1/jobs/<id>/live`) read by httpx in this process, sampled at the same
   moments: what the service delivers, before any drawing. It keeps up when the
   lag stays bounded (p99 under 1 s) and does not grow (the mean of the last third
   of the run within 0.25 s of the first third's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from playwright.sync_api import Browser, sync_playwright
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.service.model import Attempt, JobSpec, JobState, Member
from coordinator.service.states import advance
from coordinator.service.store import JobStore
from tests.support.dashboard import VIEWPORT, Watched, launch
from tests.support.service import ServiceProc, kill_members
from tests.support.signing import session_signer
from tests.support.wait import wait_until

console = Console(width=130)
NAMESPACE = "/bench-dashboard"
TARGET_LOAD_S = 1.0
KEEPS_UP_P99_S = 1.0
KEEPS_UP_GROWTH_S = 0.25
SAMPLE_EVERY_S = 0.5


def wait_state(service: ServiceProc, job_id: str, states: set[str], timeout: float = 120) -> Any:
    def reached() -> Any:
        record = service.http.get(f"/v1/jobs/{job_id}").json()
        return record if record["state"] in states else None

    return wait_until(reached, timeout, f"{job_id} in {states}")


def quantiles(values: list[float]) -> tuple[float, float, float, float]:
    """p50, p90, p99 and max."""
    ordered = sorted(values) or [0.0]

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    return at(0.5), at(0.9), at(0.99), ordered[-1]


def report_page(name: str, page: Watched) -> None:
    problems = page.problems()
    if problems:
        console.print(f"[red]{name}: the page misbehaved[/red]")
        for problem in problems[:20]:
            console.print(f"  {problem}")


# -- 1. the jobs table with N jobs ---------------------------------------------------------


def fill(etcd: Etcd, count: int) -> None:
    """`count` finished jobs, written as the service writes them (JobStore, state by state)."""
    store = JobStore(etcd, session_signer())  # the key ServiceProc's service verifies with
    began = time.time() - 86_400
    finals = [JobState.SUCCEEDED] * 8 + [JobState.FAILED, JobState.CANCELLED]
    for n in range(count):
        workers = 1 + n % 4
        spec = JobSpec(
            id=f"job-{n:04d}", kind="noop", workers=workers, params={"seconds": "1"},
            labels={"team": f"t{n % 3}"},
        )  # fmt: skip
        at = began + 60 * n
        store.submit(spec, at)
        final = finals[n % len(finals)]

        def finish(record: Any, at: float = at, final: JobState = final, workers: int = workers):
            members = [
                Member(index=i, rank=i, address=f"127.0.0.1:{30000 + i}", phase="done",
                       exit_code=0 if final == JobState.SUCCEEDED else 1)
                for i in range(workers)
            ]  # fmt: skip
            record = advance(record, JobState.STARTING, "attempt 1", at + 1)
            record = advance(record, JobState.RUNNING, "every member passed connect", at + 2)
            record = advance(record, final, f"{final.value.lower()} (bench)", at + 4)
            attempt = Attempt(number=1, started_at=at + 1, ended_at=at + 4, members=members)
            return record.model_copy(update={"attempts": [attempt]})

        store.update(spec.id, finish)


TABLE_SHOWN = """
(() => {
  const want = %d;
  const check = () => {
    if (window.__tableAt !== undefined) return;
    const count = document.querySelector('#jobs-count');
    if (!count || count.textContent.trim() !== String(want)) return;
    if (document.querySelectorAll('table#jobs tr[data-job]').length !== want) return;
    window.__tableAt = performance.now();
    requestAnimationFrame(() => { window.__shownAt = performance.now(); });
  };
  new MutationObserver(check).observe(document, {
    subtree: true, childList: true, characterData: true, attributes: true,
  });
})();
"""


def table_loads(browser: Browser, service: ServiceProc, jobs: int, loads: int) -> Table:
    shown: list[float] = []
    dom: list[float] = []
    walls: list[float] = []
    floor: list[float] = []
    api: list[float] = []
    for n in range(loads):
        context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        context.add_init_script(TABLE_SHOWN % jobs)
        page = Watched(context.new_page())
        began = time.perf_counter()
        page.page.goto(service.dashboard_link(), wait_until="commit")  # lands on #/
        page.page.wait_for_function("() => window.__shownAt !== undefined", timeout=60_000)
        walls.append(time.perf_counter() - began)
        dom.append(page.page.evaluate("() => window.__tableAt") / 1000)
        shown.append(page.page.evaluate("() => window.__shownAt") / 1000)
        report_page(f"jobs table, load {n + 1}", page)
        context.close()

        context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        page = Watched(context.new_page())
        page.page.goto(f"{service.url}/healthz", wait_until="load")
        floor.append(
            page.page.evaluate(
                "() => performance.getEntriesByType('navigation')[0].loadEventEnd"
            ) / 1000
        )  # fmt: skip
        context.close()

        began = time.perf_counter()
        token, listed = None, 0
        while True:
            params: dict[str, Any] = {"limit": 500} | ({"page_token": token} if token else {})
            page_of = service.http.get("/v1/jobs", params=params).json()
            listed += len(page_of["jobs"])
            if not (token := page_of["next_page_token"]):
                break
        api.append(time.perf_counter() - began)
        assert listed == jobs, f"the API lists {listed} jobs, not {jobs}"
        console.print(
            f"load {n + 1}: table shown {shown[-1]:.3f}s (rows in the DOM {dom[-1]:.3f}s, "
            f"wall {walls[-1]:.3f}s); /healthz {floor[-1]:.3f}s; API alone {api[-1]:.3f}s"
        )
    table = Table(title=f"jobs table with {jobs} jobs: seconds from navigation (median of {loads})")
    for name in ["what", "median s", "min s", "max s", f"< {TARGET_LOAD_S:g} s", "/ floor"]:
        table.add_column(name, justify="left" if name == "what" else "right")
    base = statistics.median(floor)
    rows = [
        ("#/ : all rows shown (next frame)", shown, True),
        ("#/ : all rows in the DOM", dom, False),
        ("#/ : wall time, goto to shown (Playwright)", walls, False),
        ("floor: /healthz to its load event", floor, False),
        ("the API alone: every record over REST", api, False),
    ]
    for name, values, target in rows:
        median = statistics.median(values)
        ok = ("yes" if median < TARGET_LOAD_S else "[red]no[/red]") if target else ""
        table.add_row(
            name, f"{median:.3f}", f"{min(values):.3f}", f"{max(values):.3f}", ok,
            f"{median / base:.1f}x",
        )  # fmt: skip
    return table


# -- 2. live step clocks --------------------------------------------------------------------


class ClockWriter(threading.Thread):
    """Writes `ranks` clocks, `rate` updates per second each, evenly spread, for `seconds`."""

    def __init__(
        self, etcd: Etcd, job: str, ranks: int, rate: float, seconds: float, round_: int, fmt: str
    ) -> None:
        super().__init__(daemon=True)
        self.etcd, self.ranks, self.rate, self.seconds, self.fmt = etcd, ranks, rate, seconds, fmt
        self.prefix = etcd.key("jobs", job, "steps", round_, "clocks")
        self.lock = threading.Lock()
        self.written: dict[int, list[float]] = {r: [] for r in range(ranks)}  # clock c at [c-1]
        self.started = self.ended = 0.0
        self.late: list[float] = []  # how far each write was behind its schedule

    def value(self, clock: int) -> str:
        if self.fmt == "json":  # as the barriers write them (coordinator.barriers.live.Clock)
            return json.dumps({"clock": clock, "t": time.time(), "interval": 0.1, "done": False})
        return f"{clock:012d}"

    def latest(self) -> dict[int, tuple[int, list[float]]]:
        with self.lock:
            return {r: (len(times), times) for r, times in self.written.items()}

    def run(self) -> None:
        interval = 1.0 / (self.rate * self.ranks)
        self.started = time.monotonic()
        n = 0
        while (due := self.started + n * interval) < self.started + self.seconds:
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)  # pacing the writes, not waiting for anything
            self.late.append(time.monotonic() - due)
            rank, clock = n % self.ranks, n // self.ranks + 1
            self.etcd.put(f"{self.prefix}/{rank:06d}", self.value(clock))
            with self.lock:
                self.written[rank].append(time.monotonic())
            n += 1
        self.ended = time.monotonic()


class StreamReader(threading.Thread):
    """The baseline: the job's live SSE stream read by httpx, the latest clock per rank."""

    def __init__(self, service: ServiceProc, job: str) -> None:
        super().__init__(daemon=True)
        self.url = f"{service.url}/v1/jobs/{job}/live"
        self.headers = dict(service.http.headers)  # its token
        self.clocks: dict[int, int] = {}
        self.updates = 0
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(headers=self.headers, timeout=httpx.Timeout(5, read=None)) as client,
                client.stream("GET", self.url) as response,
            ):
                event = ""
                for line in response.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event == "clocks":
                        for rank, clock in json.loads(line[5:])["clocks"].items():
                            self.clocks[int(rank)] = max(int(clock), self.clocks.get(int(rank), -1))
                        self.updates += 1
        except Exception as exc:  # reported with the figures
            self.error = repr(exc)


def lags(
    seen: dict[int, int], written: dict[int, tuple[int, list[float]]], now: float
) -> tuple[list[int], list[float]]:
    """Per rank: steps behind, and seconds since the first write `seen` does not show."""
    steps, seconds = [], []
    for rank, (latest, times) in written.items():
        shown = seen.get(rank, 0)
        steps.append(max(0, latest - shown))
        seconds.append(now - times[shown] if shown < latest else 0.0)  # clock shown+1's write
    return steps, seconds


PAGE_CLOCKS = """() => {
  const d = window.dashboard || {};
  return {clocks: d.clocks || {}, updates: d.clockUpdates || 0};
}"""


def clocks(
    browser: Browser, service: ServiceProc, etcd: Etcd, ranks: int, rate: float, seconds: float,
    round_: int, fmt: str,
) -> list[Table]:  # fmt: skip
    job = "live-clocks"
    spec = {"id": job, "kind": "noop", "workers": 1, "params": {"seconds": 600}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    wait_state(service, job, {"RUNNING"})
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    context.add_init_script(
        "window.__longTasks = [];"
        "new PerformanceObserver((list) => { for (const e of list.getEntries())"
        " window.__longTasks.push(e.duration); }).observe({type: 'longtask', buffered: true});"
    )
    page = Watched(context.new_page())
    page.sign_in(service.dashboard_link(), f"#/jobs/{job}")
    page.page.wait_for_selector("svg#chart-clocks", state="attached", timeout=30_000)
    page.page.wait_for_function(
        "() => window.dashboard && typeof window.dashboard.clockUpdates === 'number'",
        timeout=30_000,
    )
    stream = StreamReader(service, job)
    stream.start()
    writer = ClockWriter(etcd, job, ranks, rate, seconds, round_, fmt)
    samples: dict[str, list[tuple[float, list[int], list[float]]]] = {"page": [], "stream": []}
    writer.start()
    tail = 3.0  # keep sampling after the writes: does the page catch up?
    caught_up: float | None = None
    while True:
        page.page.wait_for_timeout(SAMPLE_EVERY_S * 1000)  # the sampling period
        shown = page.page.evaluate(PAGE_CLOCKS)
        now = time.monotonic()
        written = writer.latest()
        at = now - writer.started
        for who, seen in (("page", shown["clocks"]), ("stream", dict(stream.clocks))):
            steps, behind = lags({int(r): int(c) for r, c in seen.items()}, written, now)
            samples[who].append((at, steps, behind))
        if not writer.is_alive():
            if caught_up is None and max(samples["page"][-1][1]) == 0:
                caught_up = now - writer.ended
            if now - writer.ended > tail:
                break
    updates = page.page.evaluate(PAGE_CLOCKS)["updates"]
    long_tasks = page.page.evaluate("() => window.__longTasks")
    points = page.page.get_attribute("svg#chart-clocks", "data-points")
    stream.stop.set()
    report_page("job page (clocks)", page)
    context.close()
    service.http.post(f"/v1/jobs/{job}/cancel")
    total = sum(len(t) for _, t in writer.latest().values())
    wrote = writer.ended - writer.started

    table = Table(
        title=f"{ranks} trainers' clocks at {rate:g} updates/s each for {seconds:g} s "
        f"(sampled every {SAMPLE_EVERY_S:g} s while writing)"
    )
    columns = ["who", "steps behind p50/p90/p99/max", "seconds behind p50/p90/p99/max",
               "mean s, first third", "mean s, last third", "keeps up"]  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name == "who" else "right")
    for who, label in (("page", "page: window.dashboard"),
                       ("stream", "baseline: SSE, httpx")):  # fmt: skip
        during = [s for s in samples[who] if s[0] <= wrote]
        steps = [float(v) for _, s, _ in during for v in s]
        behind = [v for _, _, b in during for v in b]
        third = max(1, len(during) // 3)
        first = statistics.mean(max(b) for _, _, b in during[:third]) if during else 0.0
        last = statistics.mean(max(b) for _, _, b in during[-third:]) if during else 0.0
        p99 = quantiles(behind)[2]
        keeps = p99 < KEEPS_UP_P99_S and last - first < KEEPS_UP_GROWTH_S
        table.add_row(
            label,
            "/".join(f"{v:.0f}" for v in quantiles(steps)),
            "/".join(f"{v:.2f}" for v in quantiles(behind)),
            f"{first:.2f}", f"{last:.2f}",
            "yes" if keeps else "[red]no[/red]",
        )  # fmt: skip
    facts = Table(title="the clocks run")
    facts.add_column("what")
    facts.add_column("figure", justify="right")
    facts.add_row("writes (one etcd put each)", f"{total} in {wrote:.1f} s = {total / wrote:.0f}/s")
    late = quantiles(writer.late)
    facts.add_row(
        "writes behind their schedule p50/p99/max",
        "/".join(f"{v * 1000:.0f}" for v in (late[0], late[2], late[3])) + " ms",
    )
    facts.add_row("clock updates the page applied", f"{updates} ({updates / wrote:.1f}/s)")
    facts.add_row("clock events the stream delivered", f"{stream.updates}")
    facts.add_row("svg#chart-clocks data-points at the end", f"{points}")
    facts.add_row(
        "long tasks (> 50 ms) on the page's main thread",
        f"{len(long_tasks)}, {sum(long_tasks):.0f} ms in all, longest "
        f"{max(long_tasks, default=0):.0f} ms",
    )
    facts.add_row(
        "page fully caught up after the writes stopped",
        "never (within 3 s)" if caught_up is None else f"after {caught_up:.2f} s",
    )
    if stream.error:
        facts.add_row("the baseline stream failed", stream.error)
    for who in ("page", "stream"):
        every = max(1, len(samples[who]) // 15)
        trend = " ".join(f"{max(b):.2f}" for _, _, b in samples[who][::every])
        console.print(f"{who}: seconds behind (the worst rank) over the run: {trend}")
    return [table, facts]


# -- 3. screenshots ---------------------------------------------------------------------------


def screenshots(browser: Browser, service: ServiceProc, folder: Path) -> None:
    """The jobs table and the job page of an MNIST run under SSP with a straggler."""
    folder.mkdir(parents=True, exist_ok=True)
    http = service.http

    def submit(spec: dict[str, Any]) -> None:
        response = http.post("/v1/jobs", json=spec)
        if response.status_code != 201:
            raise RuntimeError(f"submit {spec['id']}: {response.status_code} {response.text}")

    console.print("screenshots: running a few jobs for the table")
    submit({"id": "xgb-breast-cancer", "kind": "xgboost", "workers": 2,
            "params": {"rounds": 30}, "labels": {"team": "tabular"}})  # fmt: skip
    submit({"id": "steps-dssp", "kind": "steps", "workers": 2, "labels": {"team": "research"},
            "params": {"method": "dssp", "staleness": 1, "staleness_upper": 3,
                       "num_steps": 40, "step_seconds": 0.05, "straggler_rank": 1,
                       "straggler_factor": 2}})  # fmt: skip
    wait_state(service, "xgb-breast-cancer", {"SUCCEEDED", "FAILED"})
    wait_state(service, "steps-dssp", {"SUCCEEDED", "FAILED"})
    submit({"id": "noop-deadline", "kind": "noop", "workers": 1, "params": {"seconds": 60},
            "deadline_seconds": 1})  # fmt: skip
    submit({"id": "noop-cancelled", "kind": "noop", "workers": 1, "params": {"seconds": 60}})
    wait_state(service, "noop-cancelled", {"RUNNING"})
    http.post("/v1/jobs/noop-cancelled/cancel")
    wait_state(service, "noop-deadline", {"FAILED"})
    wait_state(service, "noop-cancelled", {"CANCELLED"})

    job = "mnist-ssp-straggler"
    submit({"id": job, "kind": "mnist", "workers": 3, "labels": {"team": "vision"},
            "params": {"method": "ssp", "staleness": 2, "straggler_rank": 1,
                       "straggler_factor": 3, "epochs": 2, "eval_seconds": 1}})  # fmt: skip
    # Queued behind it (4 slots, 3 taken): the table shows a PENDING job too.
    submit({"id": "noop-queued", "kind": "noop", "workers": 2, "params": {"seconds": 1}})
    # The job page watches the run from its start: what the page draws only while it
    # watches (the trainers' gap to the slowest, against the bound) is then all there.
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    watching = Watched(context.new_page())
    watching.sign_in(service.dashboard_link(), f"#/jobs/{job}")
    wait_until(
        lambda: (http.get(f"/v1/jobs/{job}").json()["progress"].get("step") or 0) > 20,
        240, "the MNIST run under way",
    )  # fmt: skip

    table = Watched(context.new_page())
    table.sign_in(service.dashboard_link())
    table.page.wait_for_function(
        "() => document.querySelectorAll('table#jobs tr[data-job]').length === 6"
    )
    table.page.wait_for_timeout(500)  # let the progress cells draw (a picture, no assertion)
    table.page.screenshot(path=str(folder / "dashboard-jobs.png"))
    console.print(f"wrote {folder / 'dashboard-jobs.png'}")

    record = wait_state(service, job, {"SUCCEEDED", "FAILED"}, timeout=600)
    console.print(f"{job}: {record['state']} ({record['conditions'][-1]['reason']})")
    watching.page.wait_for_function(
        "(state) => document.querySelector('#job-state')?.textContent.trim() === state",
        arg=record["state"],
    )
    watching.page.wait_for_function(
        "() => ['#chart-curve', '#chart-clocks', '#chart-staleness'].every((id) =>"
        " Number(document.querySelector('svg' + id)?.getAttribute('data-points')) > 0)",
        timeout=60_000,
    )
    watching.page.wait_for_timeout(500)
    watching.page.screenshot(path=str(folder / "dashboard-job.png"), full_page=True)
    console.print(f"wrote {folder / 'dashboard-job.png'}")
    report_page("screenshots: the jobs table", table)
    report_page("screenshots: the job page", watching)
    context.close()


def main(
    jobs: int = typer.Option(1000, min=1, help="finished jobs in etcd for the table"),
    loads: int = typer.Option(5, min=1, help="loads of the jobs table to time"),
    ranks: int = typer.Option(20, min=1, help="trainers whose clocks are written"),
    rate: float = typer.Option(10.0, min=0.1, help="clock updates per second per trainer"),
    seconds: float = typer.Option(30.0, min=1, help="how long the clocks are written"),
    round_: int = typer.Option(1, "--round", help="the rendezvous round in the clock keys"),
    value_format: str = typer.Option(
        "decimal", help="clock values: decimal (zero-padded) or json (as the barriers write)"
    ),
    part: str = typer.Option("all", help="all, table or clocks"),
    screenshots_to: Path | None = typer.Option(  # noqa: B008 (typer's way)
        None, "--screenshots", help="only take the screenshots, into this folder"
    ),
) -> None:
    console.print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    tables: list[Table] = []
    with (
        EmbeddedEtcd() as server,
        tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp,
        sync_playwright() as playwright,
    ):
        data = Path(tmp) / "service"
        data.mkdir()
        server.security.export()  # its root's settings (auth is on): serve inherits them
        etcd = Etcd(server.endpoint, namespace=NAMESPACE)
        browser = launch(playwright)
        console.print(f"chromium {browser.version}")
        service: ServiceProc | None = None
        try:
            if screenshots_to is None and part in ("all", "table"):
                began = time.perf_counter()
                fill(etcd, jobs)
                console.print(f"wrote {jobs} jobs in {time.perf_counter() - began:.1f}s")
            service = ServiceProc(server.endpoint, NAMESPACE, data).ready()
            if screenshots_to is not None:
                screenshots(browser, service, screenshots_to)
                return
            if part in ("all", "table"):
                tables.append(table_loads(browser, service, jobs, loads))
            if part in ("all", "clocks"):
                tables += clocks(browser, service, etcd, ranks, rate, seconds, round_, value_format)
        finally:
            browser.close()
            if service is not None:
                service.stop()
            kill_members(data)
            etcd.close()
    for table in tables:
        console.print(table)


if __name__ == "__main__":
    typer.run(main)
