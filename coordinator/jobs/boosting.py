"""The `xgboost` job: distributed XGBoost with the tracker on the leader.

- Before joining, every member checks the parameters (a one-round local fit
  on two rows lets XGBoost itself refuse bad values) and counts the data's
  rows, so a bad path, an empty shard or a refused option fails every member
  at once, before anything is written to etcd.
- After `ip_exchange` the leader starts XGBoost's tracker on its roster
  address and publishes it at `<job>/xgboost/<round>/tracker` (leased). Every
  member loads only its own row shard and records what it read at
  `<job>/xgboost/shards/<rank>` (pieces, rows, digest).
- After `connect` everyone joins the collective with task id = its rank
  (zero-padded, and the tracker sorts by task), so the collective's rank is the
  rendezvous rank (checked), and trains with `tree_method=hist`.
- Rank 0 writes each round's evaluation metrics to
  `<job>/xgboost/metrics/<round>`, saves the model under
  `<artifacts>/<job>/model.<json|ubj>` and a summary at `<job>/xgboost/summary`.
- A member that dies makes the collective fail on the others (its sockets
  close, or `collective_timeout` passes); they then wait up to a lease TTL for
  etcd to name the lost member and fail with `MemberLost`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xgboost
from xgboost import collective
from xgboost.callback import TrainingCallback
from xgboost.tracker import RabitTracker

from coordinator.datasets import DataSource, Layout, Shard, check_shards, load_shard, parse_source
from coordinator.events import Round, emit
from coordinator.files import replacing
from coordinator.jobs import catalog
from coordinator.jobs.params import artifacts_dir, check_known, float_param, int_at_least, int_param
from coordinator.rendezvous.errors import MemberLost

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member

JOB = "xgboost"
DEFAULT_DATA = catalog.XGBOOST_DEFAULT_DATA
OWN = catalog.names(catalog.XGBOOST)  # where the data is and how the job runs
BOOSTER = catalog.names(catalog.XGBOOST_BOOSTER)  # passed through to XGBoost as given

#: Options distributed training refuses, or this CPU-only build cannot honour.
REFUSED = {
    "updater": "a custom updater bypasses the distributed hist method",
    "process_type": "updating an existing model is not supported by this job",
    "device": "this build of XGBoost (xgboost-cpu) runs on the CPU only",
}


@dataclass(frozen=True)
class BoostingOptions:
    data: DataSource
    eval_data: DataSource | None
    rounds: int
    early_stopping_rounds: int | None
    nthread: int
    artifacts: Path
    model_format: str
    collective_timeout: int
    booster: dict[str, str]


def parse(params: dict[str, str]) -> BoostingOptions:
    """Check every parameter; a ValueError names the field and the cause."""
    check_known(JOB, params, [*OWN, *BOOSTER, *REFUSED])
    for name, why in REFUSED.items():
        if name in params:
            raise ValueError(f"{JOB} job: parameter {name} is not supported: {why}")
    tree_method = params.get("tree_method", "hist")
    if tree_method != "hist":
        raise ValueError(
            f"{JOB} job: parameter tree_method={tree_method!r} is not supported: distributed "
            "training here uses hist only"
        )
    label_column = params.get("label_column")
    num_features = int_param(JOB, params, "num_features")
    data = parse_source(
        params.get("data", DEFAULT_DATA),
        field="data",
        label_column=label_column,
        num_features=num_features,
    )
    eval_data = None
    if "eval_data" in params:
        eval_data = parse_source(
            params["eval_data"],
            field="eval_data",
            label_column=label_column,
            num_features=num_features,
        )
    rounds = int_at_least(
        JOB, params, "rounds", 10, minimum=1, maximum=catalog.maximum(catalog.XGBOOST, "rounds")
    )
    early = int_param(JOB, params, "early_stopping_rounds")
    if early is not None and (early < 1 or eval_data is None):
        raise ValueError(
            f"{JOB} job: parameter early_stopping_rounds needs eval_data and a value >= 1"
        )
    model_format = params.get("model_format", "json")
    if model_format not in ("json", "ubj"):
        raise ValueError(f"{JOB} job: parameter model_format={model_format!r} is not json or ubj")
    booster = {name: params[name] for name in BOOSTER if name in params}
    booster.setdefault("objective", "binary:logistic")
    booster["tree_method"] = "hist"
    _let_xgboost_check(booster)
    return BoostingOptions(
        data=data,
        eval_data=eval_data,
        rounds=rounds,
        early_stopping_rounds=early,
        nthread=int_at_least(JOB, params, "nthread", 1, minimum=1),
        artifacts=artifacts_dir(JOB, params),
        model_format=model_format,
        collective_timeout=int(float_param(JOB, params, "collective_timeout", 300.0)) or 1,
        booster=booster,
    )


def _let_xgboost_check(booster: dict[str, str]) -> None:
    """XGBoost checks its parameters only when it trains: train one round on two rows."""
    tiny = xgboost.DMatrix(np.zeros((2, 1), np.float32), label=np.ones(2, np.float32))
    try:
        xgboost.train({**booster, "nthread": 1, "verbosity": 0}, tiny, num_boost_round=1)
    except xgboost.core.XGBoostError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise ValueError(f"{JOB} job: XGBoost refuses the parameters: {first_line}") from None


class XGBoostJob:
    """One member's side of the job (see the module docstring)."""

    def __init__(self, params: dict[str, str], world_size: int) -> None:
        self.options = parse(params)
        self.world_size = world_size
        self.layouts: dict[str, Layout] = {"data": check_shards(self.options.data, world_size)}
        if self.options.eval_data is not None:
            self.layouts["eval_data"] = check_shards(self.options.eval_data, world_size)
        self.tracker: Any = None
        self.shards: dict[str, Shard] = {}

    # -- before connect ---------------------------------------------------

    def on_roster(self, member: Member) -> None:
        rank = _rank(member)
        if rank == 0:
            self._start_tracker(member)
        for name, source in (("data", self.options.data), ("eval_data", self.options.eval_data)):
            if source is not None:
                self.shards[name] = load_shard(source, rank, self.world_size, self.layouts[name])
        record = {name: shard.describe() for name, shard in self.shards.items()}
        member.etcd.put(member.keys.xgboost_shard(rank), json.dumps(record))

    def _start_tracker(self, member: Member) -> None:
        assert member.roster is not None
        # Bound to the leader's roster address only (never all interfaces). The tracker
        # and the collective's own worker links are XGBoost's protocol, to which we cannot
        # add the members' handshake: anyone who reaches the tracker's port during the
        # rendezvous can still claim a task or disturb the collective. Keep those ports
        # reachable only from the job's members (network policy, a private network).
        host = member.roster.leader.host
        self.tracker = RabitTracker(
            n_workers=self.world_size,
            host_ip=host,
            port=0,
            sortby="task",
            timeout=int(member.timeout),
        )
        self.tracker.start()
        args = self.tracker.worker_args()
        endpoint = {"host": args["dmlc_tracker_uri"], "port": args["dmlc_tracker_port"]}
        member.etcd.put(
            member.keys.xgboost_tracker(member.round), json.dumps(endpoint), member.lease_id
        )

    # -- training ---------------------------------------------------------

    def run(self, member: Member) -> dict[str, object]:
        rank = _rank(member)
        kv = member.etcd.get(member.keys.xgboost_tracker(member.round))
        if kv is None:
            raise RuntimeError("the leader published no XGBoost tracker before connect")
        tracker = json.loads(kv.value)
        options = self.options
        args = {
            "dmlc_tracker_uri": tracker["host"],
            "dmlc_tracker_port": tracker["port"],
            "dmlc_task_id": f"{rank:06d}",  # compared as strings: pad so rank order holds
            "dmlc_timeout": options.collective_timeout,
            "dmlc_retry": 3,
        }
        began = time.time()
        try:
            with collective.CommunicatorContext(**args):
                if (collective.get_rank(), collective.get_world_size()) != (
                    rank,
                    self.world_size,
                ):
                    raise RuntimeError(
                        f"XGBoost gave rank {collective.get_rank()} of "
                        f"{collective.get_world_size()} to rendezvous rank {rank} of "
                        f"{self.world_size}"
                    )
                booster, history = self._train(member)
                model = booster.save_raw("ubj")
        except xgboost.core.XGBoostError as exc:
            self._explain_collective_failure(member, exc)
        trained = time.time() - began
        summary: dict[str, Any] = {
            "rank": rank,
            "rounds": booster.num_boosted_rounds(),
            "best_iteration": _best_iteration(booster),
            "metrics": {name: values[-1] for name, values in history.items()},
            "model_sha256": hashlib.sha256(model).hexdigest(),
            "train_seconds": round(trained, 3),
            "shards": {name: shard.describe() for name, shard in self.shards.items()},
        }
        if rank == 0:
            summary["model_path"] = str(self._save(member, booster))
            member.etcd.put(member.keys.xgboost_summary, json.dumps(summary))
        if self.tracker is not None:
            self.tracker.wait_for(options.collective_timeout)
        return summary

    def _train(self, member: Member) -> tuple[xgboost.Booster, dict[str, list[float]]]:
        options = self.options
        train = self.shards["data"]
        dtrain = xgboost.DMatrix(train.X, label=train.y, nthread=options.nthread)
        evals = [(dtrain, "train")]
        if "eval_data" in self.shards:
            test = self.shards["eval_data"]
            evals.append((xgboost.DMatrix(test.X, label=test.y, nthread=options.nthread), "eval"))
        history: dict[str, list[float]] = {}
        booster = xgboost.train(
            {**options.booster, "nthread": options.nthread},
            dtrain,
            num_boost_round=options.rounds,
            evals=evals,
            early_stopping_rounds=options.early_stopping_rounds,
            callbacks=[_RoundReport(member, options.rounds, history)],
            verbose_eval=False,
        )
        return booster, history

    def _explain_collective_failure(self, member: Member, error: Exception) -> None:
        """Name the member whose loss broke the collective, if etcd can tell within a TTL."""
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        lost = member.wait_for_loss(member.ttl + 2.0)
        if lost is not None:
            raise MemberLost(lost.rank, "training", f"{lost.reason}; XGBoost: {message}")
        raise RuntimeError(f"XGBoost's collective failed: {message}") from error

    def _save(self, member: Member, booster: xgboost.Booster) -> Path:
        folder = self.options.artifacts / member.job_id
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"model.{self.options.model_format}"
        with replacing(path, suffix=f".{self.options.model_format}") as partial:
            booster.save_model(partial)  # (XGBoost picks the format from the suffix)
        return path

    def close(self) -> None:
        if self.tracker is not None:
            # A tracker whose workers failed reports that again here: already said.
            with contextlib.suppress(xgboost.core.XGBoostError):
                self.tracker.free()
            self.tracker = None


class _RoundReport(TrainingCallback):
    """After each round: a progress line on every member; the metrics in etcd from rank 0."""

    def __init__(self, member: Member, rounds: int, history: dict[str, list[float]]) -> None:
        super().__init__()
        self.member, self.rounds, self.history = member, rounds, history

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        latest = {
            f"{data}-{metric}": float(values[-1])
            for data, metrics in evals_log.items()
            for metric, values in metrics.items()
        }
        for name, value in latest.items():
            self.history.setdefault(name, []).append(value)
        rank = self.member.rank
        emit(Round(rank=rank, round=epoch + 1, rounds=self.rounds, metrics=latest))
        if rank == 0:
            self.member.etcd.put(self.member.keys.xgboost_metrics(epoch + 1), json.dumps(latest))
        return False  # never stop training on our account


def _rank(member: Member) -> int:
    if member.rank is None:
        raise RuntimeError("the member has not joined the job")
    return member.rank


def _best_iteration(booster: Any) -> int | None:
    try:
        return int(booster.best_iteration)
    except AttributeError:
        return None
