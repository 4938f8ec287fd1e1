"""Every kind's parameters as data: name, type, default and what it does.

Kept apart from the jobs themselves so the service, the dashboard and the CLI
learn a kind's parameters without importing PyTorch or XGBoost; each job's own
check reads its list of known names from here, so the two cannot drift.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

ParamType = Literal["integer", "number", "boolean", "text", "choice", "path"]
METHODS = ("bsp", "ssp", "asp", "pbsp", "pssp", "dssp")


class Param(BaseModel):
    """One KEY=VALUE parameter of a kind (values travel as text: `default` too)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    type: ParamType
    description: str
    default: str | None = None  # None: none, or one the description explains
    choices: tuple[str, ...] = ()


def names(params: tuple[Param, ...]) -> list[str]:
    return [param.name for param in params]


def barrier_params(method_default: str | None) -> tuple[Param, ...]:
    """The step barrier's parameters, shared by every kind whose steps it paces."""
    return (
        Param(
            name="method",
            type="choice",
            choices=METHODS,
            default=method_default,
            description="the step barrier's method" + ("" if method_default else " (required)"),
        ),
        Param(name="staleness", type="integer", default="0", description="SSP/pSSP s, DSSP S_L"),
        Param(name="staleness_upper", type="integer", default="0", description="DSSP S_U"),
        Param(name="sample", type="integer", default="0", description="pBSP/pSSP beta"),
        _on_loss("what the others do when a member is lost"),
    )


def _on_loss(description: str) -> Param:
    """What the others do when a member is lost: the barrier kinds' and `command`'s."""
    return Param(
        name="on_loss",
        type="choice",
        choices=("fail", "continue"),
        default="fail",
        description=description,
    )


def _stop(unit: str, required: bool) -> tuple[Param, ...]:
    which = "give exactly one of" if required else "or"
    return (
        Param(
            name="num_steps", type="integer", description=f"steps per {unit} ({which} last_step)"
        ),
        Param(name="last_step", type="integer", description="absolute final clock"),
    )


def _straggler(who: str) -> tuple[Param, ...]:
    return (
        Param(name="straggler_rank", type="integer", description=f"{who} rank slowed down"),
        Param(
            name="straggler_factor",
            type="number",
            default="1",
            description="its step time is multiplied by this (needs straggler_rank)",
        ),
    )


ARTIFACTS = Param(
    name="artifacts",
    type="path",
    description="model directory (default $COORDINATOR_ARTIFACTS, else ./artifacts)",
)

NOOP = (
    Param(
        name="seconds",
        type="number",
        default="0",
        description="seconds to hold between connect and training (a stand-in for training)",
    ),
)

STEPS = (
    *barrier_params(None),
    *_stop("worker", required=True),
    Param(name="step_seconds", type="number", default="0", description="seconds per step"),
    *_straggler("the"),
    Param(name="seed", type="integer", description="sample seed"),
)

MNIST = (
    Param(
        name="data",
        type="text",
        default="digits",
        description="digits (builtin, 4,000 + 1,000 real digits) or a directory of MNIST IDX files",
    ),
    Param(name="ps", type="integer", default="1", description="number of parameter servers"),
    *barrier_params("bsp"),
    Param(
        name="epochs",
        type="integer",
        default="5",
        description="passes over each trainer's shard (unless num_steps or last_step)",
    ),
    *_stop("trainer", required=False),
    Param(name="batch_size", type="integer", default="32", description="samples per trainer step"),
    Param(
        name="optimizer",
        type="choice",
        choices=("sgd", "adam"),
        default="sgd",
        description="sgd (with momentum) or adam",
    ),
    Param(name="lr", type="number", description="learning rate (0.02 for sgd, 0.001 for adam)"),
    Param(name="momentum", type="number", default="0.9", description="sgd momentum"),
    Param(
        name="lr_decay",
        type="number",
        default="0.7",
        description="the learning rate is multiplied by this after each epoch's updates",
    ),
    Param(
        name="aggregate",
        type="boolean",
        default="false",
        description="bsp only: average each step's gradients into one update",
    ),
    *_straggler("trainer"),
    Param(
        name="eval_seconds",
        type="number",
        default="2",
        description="seconds between test-set evaluations",
    ),
    Param(
        name="checkpoint_every",
        type="integer",
        default="500",
        description="server updates between checkpoints (0: none)",
    ),
    Param(
        name="resume",
        type="boolean",
        default="false",
        description="true: continue from the servers' last checkpoints (set on a retry)",
    ),
    Param(name="seed", type="integer", default="0", description="model init and data order"),
    Param(name="threads", type="integer", default="1", description="PyTorch threads per member"),
    ARTIFACTS,
)

XGBOOST_DEFAULT_DATA = "breast_cancer"
XGBOOST = (
    Param(
        name="data",
        type="text",
        default=XGBOOST_DEFAULT_DATA,
        description="training data: .csv/.parquet/.libsvm path or glob, "
        "synthetic:ROWSxFEATURES[:SEED], or a builtin",
    ),
    Param(
        name="eval_data",
        type="text",
        description="evaluation data, in the same forms (each member evaluates its shard)",
    ),
    Param(
        name="label_column",
        type="text",
        description="the label: CSV column index (default 0), Parquet column (default label)",
    ),
    Param(
        name="num_features",
        type="integer",
        description="LibSVM matrix width (default: scan for the largest index)",
    ),
    Param(name="rounds", type="integer", default="10", description="boosting rounds"),
    Param(
        name="early_stopping_rounds",
        type="integer",
        description="stop when the eval metric has not improved for this many rounds",
    ),
    Param(name="nthread", type="integer", default="1", description="threads per member"),
    ARTIFACTS,
    Param(
        name="model_format",
        type="choice",
        choices=("json", "ubj"),
        default="json",
        description="the saved model's format",
    ),
    Param(
        name="collective_timeout",
        type="number",
        default="300",
        description="seconds one collective operation may take",
    ),
)

#: Booster parameters passed through to XGBoost as given.
XGBOOST_BOOSTER = tuple(
    Param(name=name, type="text", default=default, description="passed to XGBoost as given")
    for name, default in (
        ("objective", "binary:logistic"), ("eval_metric", None), ("max_depth", None),
        ("eta", None), ("learning_rate", None), ("min_child_weight", None), ("subsample", None),
        ("colsample_bytree", None), ("colsample_bylevel", None), ("colsample_bynode", None),
        ("lambda", None), ("reg_lambda", None), ("alpha", None), ("reg_alpha", None),
        ("gamma", None), ("min_split_loss", None), ("max_bin", None), ("max_leaves", None),
        ("grow_policy", None), ("scale_pos_weight", None), ("max_delta_step", None),
        ("num_class", None), ("base_score", None), ("seed", None), ("num_parallel_tree", None),
        ("tree_method", "hist"), ("verbosity", None), ("max_cat_to_onehot", None),
        ("multi_strategy", None),
    )
)  # fmt: skip

COMMAND_GRACE = 10.0
COMMAND = (
    Param(
        name="grace_seconds",
        type="number",
        default=f"{COMMAND_GRACE:g}",
        description="seconds from SIGTERM to SIGKILL of the program",
    ),
    Param(
        name="artifacts",
        type="path",
        description="artifacts root; the program gets <root>/<job> as $COORDINATOR_ARTIFACTS",
    ),
    _on_loss("continue: a lost member leaves the job and the other programs run on"),
)
