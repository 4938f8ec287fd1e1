"""A step barrier's arguments, checked in one place for every caller: a job's text
parameters (`steps`, `mnist`), a program's `ctx.steps(...)` and the simulator's
`--barrier` list. Each error names the argument and what it takes; callers add only
where it came from ("mnist job: ", "barrier item 2 ('ssp:x'): ")."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.barriers.policy import BarrierSpec, Method, OnLoss

METHODS = ", ".join(m.value for m in Method)
#: The arguments each method takes, in the order a `--barrier` item gives them.
ARGS: dict[Method, tuple[str, ...]] = {
    Method.BSP: (),
    Method.ASP: (),
    Method.SSP: ("staleness",),
    Method.PBSP: ("sample",),
    Method.PSSP: ("staleness", "sample"),
    Method.DSSP: ("staleness", "staleness_upper"),
}


def method_of(value: object) -> Method:
    try:
        return Method(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"method={value!r} is not one of {METHODS}") from None


def count_of(name: str, value: object) -> int:
    """`staleness`, `sample` or `staleness_upper`: an integer >= 0 (text is read as one)."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}") from None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def on_loss_of(value: object) -> OnLoss:
    try:
        return OnLoss(value)
    except ValueError:
        raise ValueError(f"on_loss={value!r} is not fail or continue") from None


def barrier_spec(
    method: object,
    staleness: object = 0,
    sample: object = 0,
    staleness_upper: object = 0,
    *,
    stepping: int | None = None,
) -> BarrierSpec:
    """The method with its arguments, checked (`stepping`: how many ranks step, so a
    sample can be no larger than the others)."""
    spec = BarrierSpec(
        method_of(method),
        count_of("staleness", staleness),
        count_of("sample", sample),
        count_of("staleness_upper", staleness_upper),
    ).validate()
    if stepping is not None and spec.sample > stepping - 1:
        raise ValueError(
            f"sample={spec.sample} is larger than the {stepping - 1} other stepping members"
        )
    return spec


def barrier_from_params(params: Mapping[str, str]) -> tuple[BarrierSpec, OnLoss]:
    """A job's barrier parameters (text): `method` (required), its counts, `on_loss`."""
    if "method" not in params:
        raise ValueError(f"parameter method is required ({METHODS})")
    spec = barrier_spec(
        params["method"],
        *(params.get(name, 0) for name in ("staleness", "sample", "staleness_upper")),
    )
    return spec, on_loss_of(params.get("on_loss", "fail"))


def barrier_list(
    text: str, staleness: int | None = None, sample: int | None = None, upper: int | None = None
) -> list[BarrierSpec]:
    """The simulator's list, `bsp,asp,ssp:4,pbsp:10,pssp:4:10,dssp:2:6`: each item is
    METHOD[:ARGS] (ssp:S, pbsp:BETA, pssp:S:BETA, dssp:S_L:S_U); a bare name takes its
    arguments from `staleness`, `sample` and `upper` (the --staleness, --sample and
    --staleness-upper flags)."""
    given = {"staleness": staleness, "sample": sample, "staleness_upper": upper}
    specs: list[BarrierSpec] = []
    for index, item in enumerate((item.strip() for item in text.split(",")), start=1):
        where = f"barrier item {index} ({item!r})"
        name, *args = [part.strip() for part in item.split(":")]
        try:
            method = method_of(name)
            fields = ARGS[method]
            if args and len(args) != len(fields):
                raise ValueError("expected " + ":".join([method.value, *map(str.upper, fields)]))
            if not args:
                missing = [field for field in fields if given[field] is None]
                if missing:
                    flag = "--" + missing[0].replace("_", "-")
                    raise ValueError(f"{missing[0]} missing (give {method.value}:... or {flag})")
            values = dict(zip(fields, args, strict=True)) if args else {f: given[f] for f in fields}
            specs.append(barrier_spec(method, **values))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return specs
