"""The kinds' parameter catalog (`coordinator/jobs/catalog.toml`, read by `catalog.load`):
the loader refuses what is not a parameter, naming it, and the parameters the data file
writes out in several kinds agree where the code relies on them being one, and a group of
them is written once and used where a kind names it."""

from __future__ import annotations

import pytest

from coordinator.barriers.policy import Method
from coordinator.jobs import catalog
from coordinator.jobs.catalog import Param, load, names
from coordinator.jobs.kinds import KINDS

BARRIER_PARAMS = ("method", "staleness", "staleness_upper", "sample", "on_loss")


def by_name(params: tuple[Param, ...]) -> dict[str, Param]:
    return {param.name: param for param in params}


def test_the_loader_reads_blocks_of_parameters_and_a_pass_through_table() -> None:
    loaded = load(
        """
        [[demo]]
        name = "mode"
        type = "choice"
        choices = ["fast", "slow"]
        default = "fast"
        description = "how it runs"

        [[demo]]
        name = "seed"
        type = "integer"
        description = "where randomness starts"

        [passed]
        description = "handed on as given"
        names = ["depth", "objective"]
        defaults = { objective = "binary" }
        """
    )
    assert loaded == {
        "demo": (
            Param(
                name="mode",
                type="choice",
                choices=("fast", "slow"),
                default="fast",
                description="how it runs",
            ),
            Param(name="seed", type="integer", description="where randomness starts"),
        ),
        "passed": (
            Param(name="depth", type="text", description="handed on as given"),
            Param(
                name="objective", type="text", default="binary", description="handed on as given"
            ),
        ),
    }


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (  # a field Param does not have
            '[[demo]]\nname = "seed"\ntype = "integer"\ndescription = "d"\ncolour = "red"',
            r"catalog\.toml: demo parameter seed: colour: Extra inputs are not permitted",
        ),
        (  # a type that is not one of ParamType's
            '[[demo]]\nname = "seed"\ntype = "float"\ndescription = "d"',
            r"demo parameter seed: type: Input should be .*'float'",
        ),
        (  # a required field left out: the entry is named by its place
            '[[demo]]\ntype = "integer"\ndescription = "d"',
            r"demo parameter 1: name: Field required",
        ),
        (  # a default (as text) given as a number
            '[[demo]]\nname = "seed"\ntype = "integer"\ndefault = 0\ndescription = "d"',
            r"demo parameter seed: default: Input should be a valid string",
        ),
        (
            '[[demo]]\nname = "a"\ntype = "text"\ndescription = "d"\n'
            '[[demo]]\nname = "a"\ntype = "text"\ndescription = "e"',
            r"demo: listed twice: a",
        ),
        (
            '[passed]\ndescription = "d"\nnames = ["a"]\ndefaults = { b = "1" }',
            r"passed: defaults for names it does not list: b",
        ),
        (
            '[passed]\ndescription = "d"\nnames = ["a"]\nextra = 1',
            r"passed: extra: Extra inputs are not permitted",
        ),
        ("demo = 3", r"demo: neither \[\[blocks\]\] of parameters nor a pass-through table"),
        ("[[demo]\n", r"catalog\.toml: .*line 1"),  # not TOML
    ],
)
def test_the_loader_refuses_what_is_not_a_parameter_naming_it(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        load(text)


def test_a_group_is_written_once_and_used_where_a_kind_names_it() -> None:
    loaded = load(
        """
        [[groups.pace]]
        name = "mode"
        type = "choice"
        choices = ["fast", "slow"]
        description = "how it runs"

        [[groups.pace]]
        name = "seed"
        type = "integer"
        default = "0"
        description = "the seed"

        [[first]]
        name = "data"
        type = "path"
        description = "where"

        [[first]]
        use = "pace"
        defaults = { mode = "fast" }

        [[second]]
        use = "pace"
        descriptions = { mode = "how it runs (required)" }
        """
    )
    assert set(loaded) == {"first", "second"}  # a group is no kind
    assert names(loaded["first"]) == ["data", "mode", "seed"]  # where the kind uses it
    first, second = by_name(loaded["first"]), by_name(loaded["second"])
    assert (first["mode"].default, second["mode"].default) == ("fast", None)
    assert second["mode"].description == "how it runs (required)"
    assert first["seed"] == second["seed"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[[demo]]\nuse = "pace"', r"demo block 1: no group 'pace' \(known: none\)"),
        (
            '[[groups.pace]]\nname = "a"\ntype = "text"\ndescription = "d"\n'
            '[[demo]]\nuse = "pace"\ndefaults = { b = "1" }',
            r"demo: group pace has no parameter b",
        ),
        (
            '[[groups.pace]]\nname = "a"\ntype = "text"\ndescription = "d"\n'
            '[[demo]]\nuse = "pace"\ncolour = "red"',
            r"demo block 1: colour: Extra inputs are not permitted",
        ),
        (
            '[[groups.pace]]\nname = "a"\ntype = "text"\ndescription = "d"\n'
            '[[demo]]\nname = "a"\ntype = "text"\ndescription = "e"\n[[demo]]\nuse = "pace"',
            r"demo: listed twice: a",
        ),
    ],
)
def test_a_use_of_a_group_that_cannot_be_is_refused_naming_it(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        load(text)


def test_every_barrier_kind_uses_the_barrier_group() -> None:
    """The kinds the barrier paces have its parameters, each with the method's default
    that is the kind's own (`Barrier.default_method`)."""
    barrier_kinds = [kind for kind in KINDS.values() if kind.barrier is not None]
    assert [kind.name for kind in barrier_kinds] == ["steps", "mnist"]
    for kind in barrier_kinds:
        assert kind.barrier is not None
        params = by_name(kind.params)
        assert set(BARRIER_PARAMS) <= set(params)
        assert params["method"].default == kind.barrier.default_method


def test_the_method_choices_are_the_barriers_methods() -> None:
    assert tuple(Method) == catalog.METHODS


def test_the_parameters_several_kinds_share_agree() -> None:
    """What the kinds wrote out apart but the code reads as one."""
    steps, mnist = by_name(catalog.STEPS), by_name(catalog.MNIST)
    xgboost, command = by_name(catalog.XGBOOST), by_name(catalog.COMMAND)
    assert mnist["artifacts"] == xgboost["artifacts"]
    assert command["artifacts"].type == "path"
    for name in ("last_step", "straggler_factor"):
        assert steps[name] == mnist[name]
    for name in ("num_steps", "straggler_rank"):
        assert steps[name].type == mnist[name].type == "integer"
    on_loss = command["on_loss"].model_dump(exclude={"description"})
    assert on_loss == steps["on_loss"].model_dump(exclude={"description"})
