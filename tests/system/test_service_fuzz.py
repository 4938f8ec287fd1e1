"""The REST service fuzzed against its own OpenAPI schema (schemathesis), end to end.

A real `coordinator serve` on loopback (the `serve` fixture of tests/system/conftest.py,
with `--max-workers 1`; every request carries the token it made) against the test
etcd: schemathesis reads `/openapi.json` from it, generates requests for every
operation, in both of its modes (positive: data the schema allows; negative: data it
forbids), and each response must pass all four response checks: no 5xx
(`not_a_server_error`), a documented status code (`status_code_conformance`), a
documented content type (`content_type_conformance`) and a body that matches the
documented schema (`response_schema_conformance`). No check is dropped. Every
failure found is collected (the first request of each kind, with its curl line) and
the test fails listing them all; it does not stop at the first.

Random data alone would only meet 404s and 422s, so besides it:

- valid `noop` submits (one worker, no wait: each starts one real member) with ids
  from a small pool, so submits are created (201), repeated (200) and conflict (409);
- the path's `job_id` drawn from jobs that exist: finished ones made before the fuzzing
  (succeeded, failed by its deadline, cancelled while queued) and the fuzzed submits;
- explicit cases: every hostile value of tests/support/hostile.py (1e999, lone
  surrogates, NULs, parameters a member would choke on), each of which must get a 422.

The streaming endpoints (`/events`, `/logs?follow=true`) stream until their job ends,
so they get only job ids whose streams end at once: unknown ones (404) and the
finished jobs made before (an event stream of a final job ends after one event, or at
once with a `Last-Event-ID` at or past it; a followed log ends when its job has).
They are never given a fuzzed submit's id, which may still be queued or running. The
test asserts that both answered 200 with a body, so they are never skipped silently.
`DELETE` runs last: it forgets the jobs the others read.

At the end every job still live is cancelled and the test waits until all are final
and no member runs (the `serve` fixture kills whatever is left, also on failure).
FUZZ_SEED=<int> repeats a run's data (the seed is printed with the failures).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import checks
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.modes import GenerationMode

from tests.support.hostile import PARAM_CASES, job_cases
from tests.support.service import ServiceProc, no_member_runs, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]
MIN_CASES = 500
FUZZ_IDS = [f"fuzz-{n}" for n in range(6)]  # the pool the valid submits take ids from
REQUEST_TIMEOUT = 30.0  # a safety net only: no request here is expected to wait
LABEL_KEYS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,12}", fullmatch=True)


@dataclass
class Fuzzing:
    """What the fuzzing sent and found, over all operations."""

    session: requests.Session
    seed: int
    cases: int = 0
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    stream_bodies: Counter[str] = field(default_factory=Counter)  # 200s with a body
    failures: dict[tuple[str, str], str] = field(default_factory=dict)  # first of each kind

    def run(self, label: str, strategy: st.SearchStrategy[Any], examples: int) -> None:
        @hypothesis_seed(self.seed)
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def one(case: Any) -> None:
            self.call(label, case)

        one()

    def call(self, label: str, case: Any) -> int | None:
        """Send one case and check its response, recording what came back; its status
        (None when a check failed)."""
        self.cases += 1
        operation = case.operation.label
        try:
            response = case.call_and_validate(
                session=self.session, checks=CHECKS, timeout=REQUEST_TIMEOUT
            )
        except FailureGroup as group:
            for failure in group.exceptions:
                key = (operation, failure.title)
                self.failures.setdefault(key, f"[{label}] {group.message}")
            return None
        self.statuses[(operation, response.status_code)] += 1
        if response.status_code == 200 and response.content:
            self.stream_bodies[operation] += 1
        return int(response.status_code)

    def report(self) -> str:
        lines = [f"{len(self.failures)} distinct failures in {self.cases} cases "]
        lines[0] += f"(FUZZ_SEED={self.seed}):"
        for (operation, title), text in self.failures.items():
            lines += [f"--- {operation}: {title}", text]
        return "\n".join(lines)


def seed_finished_jobs(service: ServiceProc) -> list[str]:
    """Finished jobs for the fuzzing to read: succeeded, failed, cancelled while queued."""
    http = service.http

    def submit(spec: dict[str, Any]) -> None:
        response = http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text

    submit({"id": "seed-done", "kind": "noop", "workers": 1, "labels": {"team": "a"}})
    # Waits behind seed-done for the one slot; cancelled before it ever starts.
    submit({"id": "seed-cancelled", "kind": "noop", "workers": 1, "priority": -5})
    assert http.post("/v1/jobs/seed-cancelled/cancel").status_code == 202
    wait_state(service, "seed-done", {"SUCCEEDED"}, timeout=60)
    submit({"id": "seed-failed", "kind": "noop", "workers": 1, "params": {"seconds": 60},
            "deadline_seconds": 0.5})  # fmt: skip
    wait_state(service, "seed-failed", {"FAILED"}, timeout=60)
    wait_state(service, "seed-cancelled", {"CANCELLED"}, timeout=30)
    return ["seed-done", "seed-failed", "seed-cancelled"]


def valid_submits() -> st.SearchStrategy[dict[str, Any]]:
    """Specs the service accepts: `noop`, one worker, ids from FUZZ_IDS, the rest varied."""
    return st.fixed_dictionaries(
        {"id": st.sampled_from(FUZZ_IDS), "kind": st.just("noop"), "workers": st.just(1)},
        optional={
            "params": st.sampled_from([{}, {"seconds": 0}, {"seconds": "0.2"}]),
            "launcher": st.just("local"),
            "max_restarts": st.integers(0, 2),
            "deadline_seconds": st.floats(1e-3, 30 * 86400),
            "priority": st.integers(-1000, 1000),
            "labels": st.dictionaries(LABEL_KEYS, st.text(max_size=8), max_size=2),
        },
    )


def finish_every_job(service: ServiceProc) -> list[dict[str, Any]]:
    """Cancel whatever is still live; wait until every job is final and no member runs."""
    http = service.http

    def jobs() -> list[dict[str, Any]]:
        found, token = [], None
        while True:
            params: dict[str, Any] = {"limit": 500} | ({"page_token": token} if token else {})
            page = http.get("/v1/jobs", params=params).json()
            found += page["jobs"]
            token = page["next_page_token"]
            if token is None:
                return found

    for job in jobs():
        if job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            http.post(f"/v1/jobs/{job['id']}/cancel")

    def all_final() -> tuple[list[dict[str, Any]]] | None:
        current = jobs()  # maybe none: DELETE may have forgotten every one
        final = all(j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for j in current)
        return (current,) if final else None

    try:
        return wait_until(all_final, 60, "every fuzzed job to be final")[0]
    except AssertionError as exc:
        live = [(j["id"], j["state"], j["conditions"][-1:]) for j in jobs() if j["state"]
                not in ("SUCCEEDED", "FAILED", "CANCELLED")]  # fmt: skip
        raise AssertionError(f"{exc}; still live: {live}") from None


def test_the_service_answers_every_generated_request_as_its_schema_says(
    serve: Callable[..., ServiceProc],
) -> None:
    began = time.monotonic()
    service = serve("--max-workers", "1")  # the last --max-workers counts: 1 member at a time
    finished = seed_finished_jobs(service)
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    seed = int(os.environ.get("FUZZ_SEED") or random.getrandbits(64))
    fuzz = Fuzzing(requests.Session(), seed)
    # The token the service made (auth is on): every generated request carries it, so the
    # fuzzing reaches the handlers, not only the 401 in front of them.
    fuzz.session.headers["Authorization"] = service.http.headers["Authorization"]
    ops = {f"{o.method.upper()} {o.path}": o for o in (r.ok() for r in schema.get_all_operations())}
    positive, negative = GenerationMode.POSITIVE, GenerationMode.NEGATIVE

    def random_data(name: str, positives: int, negatives: int) -> None:
        fuzz.run(f"{name} positive", ops[name].as_strategy(positive), positives)
        if negatives:
            fuzz.run(f"{name} negative", ops[name].as_strategy(negative), negatives)

    def with_ids(name: str, ids: list[str], examples: int) -> None:
        operation = ops[name]
        strategy = st.sampled_from(ids).flatmap(
            lambda job_id: operation.as_strategy(positive, path_parameters={"job_id": job_id})
        )
        fuzz.run(f"{name} known ids", strategy, examples)

    known = finished + FUZZ_IDS
    hostile_answers: list[int | None] = []
    try:
        for name in ["GET /healthz", "GET /readyz"]:
            random_data(name, 20, 0)
        # No negative data where every parameter is text of any kind (the path's job_id, the
        # Authorization header): the schema forbids nothing there (hypothesis: Unsatisfiable).
        random_data("GET /metrics", 15, 0)
        random_data("POST /v1/jobs", 100, 75)
        submit = ops["POST /v1/jobs"]
        fuzz.run(
            "POST /v1/jobs valid",
            valid_submits().flatmap(lambda body: submit.as_strategy(positive, body=body)),
            40,
        )
        random_data("GET /v1/jobs", 100, 50)
        random_data("GET /v1/jobs/{job_id}", 50, 0)
        with_ids("GET /v1/jobs/{job_id}", known, 30)
        # The streams: unknown ids (404) and finished jobs only (see the module's docstring).
        random_data("GET /v1/jobs/{job_id}/events", 30, 20)
        with_ids("GET /v1/jobs/{job_id}/events", finished, 40)
        random_data("GET /v1/jobs/{job_id}/logs", 30, 20)
        with_ids("GET /v1/jobs/{job_id}/logs", finished, 40)
        # The dashboard's own endpoints (`/live` streams end at once for a final job).
        random_data("GET /v1/whoami", 10, 0)
        random_data("GET /v1/kinds", 5, 0)
        random_data("GET /v1/jobs/{job_id}/series", 15, 0)
        with_ids("GET /v1/jobs/{job_id}/series", finished, 15)
        random_data("GET /v1/jobs/{job_id}/live", 15, 0)
        with_ids("GET /v1/jobs/{job_id}/live", finished, 15)
        random_data("POST /v1/simulate", 7, 15)
        # Explicit cases: the hostile values of tests/support/hostile.py, as raw JSON text
        # (1e999 and a lone `\ud800` have no Python value that serializes back to them).
        for hostile in job_cases():
            case = ops[f"POST {hostile.path}"].Case(
                body=hostile.body.encode(), media_type="application/json"
            )
            hostile_answers.append(fuzz.call("hostile values", case))
        for kind, params, _ in PARAM_CASES:
            body: dict[str, Any] = {"kind": kind, "workers": 1, "params": params}
            if kind == "command":
                body["command"] = ["/bin/true"]
            case = submit.Case(body=body, media_type="application/json")
            hostile_answers.append(fuzz.call("hostile params", case))
        random_data("POST /v1/jobs/{job_id}/cancel", 40, 0)
        with_ids("POST /v1/jobs/{job_id}/cancel", known, 25)
        random_data("DELETE /v1/jobs/{job_id}", 40, 0)
        with_ids("DELETE /v1/jobs/{job_id}", known, 20)
    finally:
        fuzz.session.close()
        records = finish_every_job(service)
    elapsed = time.monotonic() - began
    print(f"\n{fuzz.cases} cases in {elapsed:.0f}s (FUZZ_SEED={seed}); responses:")
    for (operation, status), count in sorted(fuzz.statuses.items()):
        print(f"  {operation} -> {status}: {count}")

    if fuzz.failures:
        pytest.fail(fuzz.report(), pytrace=False)
    assert hostile_answers == [422] * len(hostile_answers), hostile_answers
    assert fuzz.cases >= MIN_CASES, f"only {fuzz.cases} cases"
    missing = set(ops) - {operation for operation, _ in fuzz.statuses}
    assert not missing, f"never answered: {missing}"
    for stream in ["GET /v1/jobs/{job_id}/events", "GET /v1/jobs/{job_id}/logs"]:
        assert fuzz.stream_bodies[stream] > 0, f"{stream} never streamed anything"
    wanted = [
        ("POST /v1/jobs", 201),
        ("POST /v1/jobs", 200),
        ("POST /v1/jobs", 409),
        ("POST /v1/jobs/{job_id}/cancel", 202),
        ("DELETE /v1/jobs/{job_id}", 204),
    ]
    assert all(fuzz.statuses[w] for w in wanted), f"never reached some of {wanted}"
    assert no_member_runs({"attempts": [a for r in records for a in r["attempts"]]})
