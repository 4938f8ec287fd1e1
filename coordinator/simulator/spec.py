"""Parse the CLI's barrier list: `bsp,asp,ssp:4,pbsp:10,pssp:4:10,dssp:2:6`.

Each item is METHOD[:ARGS]: ssp:S, pbsp:BETA, pssp:S:BETA, dssp:S_L:S_U.
A bare name takes its parameters from the command's --staleness, --sample and
--staleness-upper flags, so `--barrier pssp --staleness 4 --sample 10` works.
"""

from __future__ import annotations

from coordinator.barriers.policy import BarrierSpec, Method

_ARGS: dict[Method, tuple[str, ...]] = {
    Method.BSP: (),
    Method.ASP: (),
    Method.SSP: ("staleness",),
    Method.PBSP: ("sample",),
    Method.PSSP: ("staleness", "sample"),
    Method.DSSP: ("staleness", "staleness_upper"),
}


def parse_barriers(
    text: str, staleness: int | None = None, sample: int | None = None, upper: int | None = None
) -> list[BarrierSpec]:
    """The specs named by `text`; a ValueError names the item and the field that is wrong."""
    defaults = {"staleness": staleness, "sample": sample, "staleness_upper": upper}
    specs: list[BarrierSpec] = []
    items = [item.strip() for item in text.split(",")]
    for index, item in enumerate(items, start=1):
        where = f"barrier item {index} ({item!r})"
        name, *args = [part.strip() for part in item.split(":")]
        try:
            method = Method(name.lower())
        except ValueError:
            choices = ", ".join(m.value for m in Method)
            raise ValueError(f"{where}: method must be one of {choices}") from None
        fields = _ARGS[method]
        if args and len(args) != len(fields):
            shape = ":".join([method.value, *(f.upper() for f in fields)])
            raise ValueError(f"{where}: expected {shape}")
        values: dict[str, int] = {}
        for position, field in enumerate(fields):
            if args:
                try:
                    values[field] = int(args[position])
                except ValueError:
                    raise ValueError(
                        f"{where}: {field} must be an integer, got {args[position]!r}"
                    ) from None
            elif defaults[field] is not None:
                values[field] = defaults[field]  # type: ignore[assignment]
            else:
                flag = "--" + field.replace("_", "-")
                raise ValueError(f"{where}: {field} missing (give {method.value}:... or {flag})")
        try:
            specs.append(BarrierSpec(method, **values).validate())
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return specs
