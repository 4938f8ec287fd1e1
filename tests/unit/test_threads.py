"""Thread counts a job may ask are capped (issue 28, item 4): the catalog marks them, and
`check_thread_caps` refuses a value above the cap, naming the field and the cap."""

from __future__ import annotations

import pytest

from coordinator.field_error import FieldError
from coordinator.jobs import catalog, make_job
from coordinator.jobs.catalog import load
from coordinator.jobs.kinds import KINDS
from coordinator.jobs.threads import MAX_THREADS_ENV, check_thread_caps, host_cores, thread_cap


def test_the_catalog_marks_every_thread_count_it_has() -> None:
    marked = {
        (kind, param.name) for kind, spec in KINDS.items() for param in spec.params if param.cap
    }
    assert marked == {("mnist", "threads"), ("xgboost", "nthread")}
    assert all(param.cap is None for param in catalog.COMMAND + catalog.NOOP + catalog.STEPS)


def test_the_loader_refuses_a_cap_it_does_not_know_naming_it() -> None:
    text = '[[demo]]\nname = "n"\ntype = "integer"\ndescription = "d"\ncap = "cores"\n'
    with pytest.raises(ValueError, match=r"demo parameter n: cap"):
        load(text)


@pytest.mark.parametrize(("kind", "name"), [("mnist", "threads"), ("xgboost", "nthread")])
def test_a_thread_count_above_the_cap_is_refused_naming_field_and_cap(kind: str, name: str) -> None:
    with pytest.raises(FieldError) as refused:
        check_thread_caps(kind, KINDS[kind].params, {name: "1000000"}, cap=4)
    assert refused.value.field == f"params.{name}"
    assert f"{name}=1000000" in str(refused.value) and "cap of 4" in str(refused.value)


def test_counts_at_the_cap_pass_and_what_is_no_number_is_left_to_the_kind() -> None:
    params = KINDS["mnist"].params
    check_thread_caps("mnist", params, {"threads": "4"}, cap=4)
    check_thread_caps("mnist", params, {"threads": "many"}, cap=4)  # the kind names it
    check_thread_caps("mnist", params, {}, cap=1)  # the default, 1


def test_the_cap_is_the_environment_s_else_the_host_s_cores() -> None:
    assert thread_cap({}) == host_cores() >= 1
    assert thread_cap({MAX_THREADS_ENV: "64"}) == 64
    for bad in ("0", "-3", "lots", "1e3"):
        with pytest.raises(ValueError, match=MAX_THREADS_ENV):
            thread_cap({MAX_THREADS_ENV: bad})


def test_a_member_refuses_a_record_above_its_host_s_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The member checks again: a record may reach etcd by another path than a submit."""
    monkeypatch.setenv(MAX_THREADS_ENV, "2")
    with pytest.raises(FieldError, match="nthread=3 is above the cap of 2"):
        make_job("xgboost", {"nthread": "3"}, 1)
