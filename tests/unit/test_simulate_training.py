"""The simulator trains the real model in virtual time: determinism, exactness, the
methods' known behaviour (from training, nothing planted), the CLI's refusals."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mlxtend")

from torch.nn import functional  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from coordinator.barriers.policy import BarrierSpec, Method  # noqa: E402
from coordinator.cli import app  # noqa: E402
from coordinator.datasets.mnist import parse_mnist  # noqa: E402
from coordinator.jobs.mnist.batches import batch_rows, steps_per_epoch  # noqa: E402
from coordinator.ps.model import FlatModel  # noqa: E402
from coordinator.ps.optim import OptimizerSpec  # noqa: E402
from coordinator.ps.rules import UpdateRule  # noqa: E402
from coordinator.simulator import train_report  # noqa: E402
from coordinator.simulator.delays import Stragglers, Trace, parse_delay  # noqa: E402
from coordinator.simulator.engine import Hooks, simulate  # noqa: E402
from coordinator.simulator.training import Transfer, initial_weights, train  # noqa: E402
from coordinator.simulator.training_data import TrainingData  # noqa: E402

runner = CliRunner()
SEEDS = (0, 1)


def data(workers: int, test_rows: int | None = 500) -> TrainingData:
    return TrainingData.load(parse_mnist("digits"), workers, test_rows=test_rows)


def cli(*args: str):
    return runner.invoke(app, ["simulate", *args], env={"COLUMNS": "200"})


def test_engine_hooks_change_no_decision_and_stop_ends_the_run() -> None:
    spec = BarrierSpec(Method.SSP, staleness=2)
    plain = simulate(spec, 5, 30.0, seed=4)
    seen: list[tuple[str, int, float]] = []
    hooks = Hooks(
        started=lambda w, t: seen.append(("start", w, t)),
        completed=lambda w, t: seen.append(("done", w, t)),
    )
    hooked = simulate(spec, 5, 30.0, seed=4, hooks=hooks)
    assert (hooked.final_step, hooked.wait_seconds, hooked.events) == (
        plain.final_step, plain.wait_seconds, plain.events,
    )  # fmt: skip
    done = [t for kind, _, t in seen if kind == "done"]
    assert len(done) == plain.events and done == sorted(done)
    assert [w for kind, w, t in seen if kind == "start" and t == 0] == list(range(5))
    never = simulate(spec, 5, 30.0, seed=4, hooks=Hooks(stop=lambda: False))
    assert never.events == plain.events and never.seconds == 30.0
    count: list[float] = []
    stop_at: list[int] = []

    def completed(w: int, t: float) -> None:
        count.append(t)
        if len(count) == 10:
            stop_at.append(w)

    early = simulate(
        spec, 5, 30.0, seed=4, hooks=Hooks(completed=completed, stop=lambda: bool(stop_at))
    )
    assert early.events == 10 and early.seconds == count[9] == done[9]


def test_the_same_command_twice_writes_the_same_accuracy_csv(tmp_path: Path) -> None:
    args = ["--train", "mnist", "--workers", "2", "--barrier", "asp,bsp-agg", "--seeds", "1",
            "--epochs", "0.1", "--eval-seconds", "10", "--test-rows", "300",
            "--delay", "straggler:0.5,3"]  # fmt: skip
    outputs = []
    for name in ("a", "b"):
        done = cli(*args, "--out", str(tmp_path / name))
        assert done.exit_code == 0, done.output
        outputs.append((tmp_path / name / "accuracy.csv").read_bytes())
    assert outputs[0] == outputs[1]
    rows = outputs[0].decode().splitlines()
    assert rows[0] == ",".join(train_report.ACCURACY_COLUMNS)
    assert {row.split(",")[0] for row in rows[1:]} == {"asp", "bsp-agg"}
    for name in ("time_to_accuracy.csv", "staleness.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def plain_sgd(shards: TrainingData, steps: int, seed: int, opt: OptimizerSpec) -> torch.Tensor:
    """torch.optim.SGD over the model: each step the trainers' batches in trainer order,
    their gradients averaged."""
    model = initial_weights(seed)
    sgd = torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=opt.momentum)
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=opt.decay_every, gamma=opt.decay)
    for step in range(steps):
        sgd.zero_grad()
        for trainer, (x, y) in enumerate(shards.shards):
            batch = batch_rows(seed, trainer, len(y), 32, step)
            functional.cross_entropy(model(x[batch]), y[batch]).backward()
        for p in model.parameters():
            p.grad /= shards.workers
        sgd.step()
        schedule.step()
    return FlatModel.build(model, 1).params


@pytest.mark.parametrize(
    ("workers", "method", "aggregate", "rule"),
    [
        (1, Method.ASP, False, None),
        (1, Method.SSP, False, "async"),
        (2, Method.BSP, True, "plain"),
        (2, Method.BSP, True, None),
    ],
)
def test_exactly_plain_synchronous_sgd(
    workers: int, method: Method, aggregate: bool, rule: str | None
) -> None:
    """One trainer (any method, any rule), or BSP-aggregate with equal delays at P=2:
    under `plain` at the given lr and momentum, under the default `scaled` at sqrt(2)
    times the lr with momentum 1 - sqrt(2) (1 - 0.9)."""
    shards = data(workers, test_rows=50)
    opt, steps, seed = OptimizerSpec("sgd", 0.02, 0.9, decay=0.7, decay_every=5), 12, 3
    spec = BarrierSpec(method, staleness=2 if method == Method.SSP else 0)
    run = train(
        spec, shards, batch_size=32, epochs=steps * 32 * workers / shards.train_count,
        delay=parse_delay("exp:1,0"), seed=seed, optimizer=opt, aggregate=aggregate,
        eval_updates=100, rule=None if rule is None else UpdateRule(rule),
    )  # fmt: skip
    if workers == 2 and rule is None:
        opt = OptimizerSpec("sgd", 0.02 * 2**0.5, 1 - 2**0.5 * 0.1, decay=0.7, decay_every=5)
    assert run.updates == steps
    assert set(run.staleness) == {0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulator: two threads on a busy machine are much slower
    try:
        expected = plain_sgd(shards, steps, seed, opt)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(run.weights, expected, rtol=1e-6, atol=1e-7)


def test_with_own_shards_each_trainer_makes_its_epochs_and_a_straggler_ends_the_run(
    tmp_path: Path,
) -> None:
    """As live: each trainer stops after its own shard's epochs, so under ASP the 3x
    straggler's last step ends the run (the fast trainers idle meanwhile, doing nothing);
    counted globally, the fast trainers would make up the straggler's share."""
    trace = tmp_path / "trace.csv"
    trace.write_text("worker,step,seconds\n0,1,1.0\n1,1,1.0\n2,1,3.0\n")
    shards = data(3, test_rows=50)
    steps = [steps_per_epoch(len(y), 32) for _, y in shards.shards]
    common = dict(batch_size=32, epochs=1, delay=Trace(trace), eval_updates=1000,
                  transfer=Transfer(latency=0.0, bandwidth=1e18))  # fmt: skip
    own = train(BarrierSpec(Method.ASP), shards, own_shards=True, **common)
    assert own.updates == sum(steps)
    assert own.virtual_seconds == pytest.approx(3.0 * steps[2])
    shared = train(BarrierSpec(Method.ASP), shards, **common)
    assert shared.virtual_seconds < 0.5 * own.virtual_seconds


@pytest.mark.slow  # ~25 s: two seeds of two methods to 0.9
def test_asp_beats_bsp_aggregate_to_90_percent_with_a_3x_straggler_at_the_defaults() -> None:
    """P=4, one trainer 3x slower, the default optimizer and update rules: BSP-aggregate
    waits for the straggler every step, ASP does not, and its stale gradients, sized by
    the `async` rule, still learn (under `plain` ASP diverges here)."""
    shards = data(4)
    delay = Stragglers(0.25, 3)
    times: dict[bool, list[float]] = {False: [], True: []}  # aggregate?
    for seed in SEEDS:
        for aggregate in times:
            method = Method.BSP if aggregate else Method.ASP
            run = train(
                BarrierSpec(method), shards, batch_size=32, epochs=3, delay=delay, seed=seed,
                aggregate=aggregate, eval_seconds=10, stop_accuracy=0.9,
            )  # fmt: skip
            reached = run.time_to(0.9)
            assert reached is not None, (method, seed, run.evaluations[-1])
            times[aggregate].append(reached)
    assert all(a < b for a, b in zip(times[False], times[True], strict=True)), times


def test_bsp_aggregate_learns_more_per_sample_than_asp_with_equal_trainers() -> None:
    """P=4, equal trainers: ASP's gradients are about 3 updates stale (momentum 0.9),
    BSP-aggregate's are fresh. Compared at equal samples (every 8 x 32), over seeds, with
    gradients applied as given (`plain`)."""
    shards = data(4, test_rows=300)
    per_method: dict[str, list[float]] = {"asp": [], "bsp-agg": []}
    for seed in SEEDS:
        for name, method, every in (("asp", Method.ASP, 8), ("bsp-agg", Method.BSP, 2)):
            run = train(
                BarrierSpec(method), shards, batch_size=32, epochs=0.5, seed=seed,
                aggregate=method == Method.BSP, eval_updates=every, rule=UpdateRule("plain"),
            )  # fmt: skip
            at = {e.samples: e.accuracy for e in run.evaluations}
            per_method[name].append(
                statistics.fmean(at[s] for s in range(1024, 2049, 256) if s in at)
            )
    assert statistics.fmean(per_method["bsp-agg"]) >= statistics.fmean(per_method["asp"]), (
        per_method
    )


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--barrier", "asp,nope"], "--barrier"),
        (["--targets", "0.8,1.5"], "--targets"),
        (["--targets", "0"], "--targets"),
        (["--workers", "0"], "--workers"),
        (["--delay", "straggler:1.5,3"], "--delay"),
        (["--train", "cifar"], "--train"),
        (["--epochs", "0"], "--epochs"),
        (["--lr", "-0.1"], "--lr"),
        (["--lr-decay", "0"], "--lr-decay"),
        (["--update-rule", "bogus"], "--update-rule"),
        (["--compensation", "11"], "--compensation"),
    ],
)
def test_bad_options_exit_2_naming_the_option(args: list[str], option: str) -> None:
    base = {"--train": "mnist", "--workers": "2", "--barrier": "asp", "--epochs": "0.05"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    done = cli(*[part for pair in base.items() for part in pair])
    assert done.exit_code == 2, done.output
    assert option in done.output, done.output


def test_a_trace_with_wrong_columns_exits_2_naming_the_delay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("rank,step,duration\n0,1,1.0\n")
    done = cli(
        "--train", "mnist", "--workers", "2", "--barrier", "bsp", "--delay", f"trace:{trace}"
    )
    assert done.exit_code == 2, done.output
    assert "--delay" in done.output and "missing column" in done.output, done.output


def small_mlp() -> torch.nn.Module:
    """A user's own model: not the builtin MnistNet."""
    nn = torch.nn
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Linear(32, 10))


def test_a_users_own_model_and_data_train_in_virtual_time() -> None:
    """Any classifier and tensors: the same run twice gives the same weights, and it
    learns the digits (an untrained model scores about 0.1)."""
    digits = data(1, test_rows=300)
    (x, y), (test_x, test_y) = digits.shards[0], digits.test
    mine = TrainingData.from_tensors(x, y, test_x, test_y, workers=2)
    assert [len(s[1]) for s in mine.shards] == [2000, 2000]
    common = dict(batch_size=32, epochs=2, model=small_mlp, eval_updates=50, seed=4,
                  optimizer=OptimizerSpec("sgd", 0.05, 0.5))  # fmt: skip
    first = train(BarrierSpec(Method.ASP), mine, **common)
    again = train(BarrierSpec(Method.ASP), mine, **common)
    assert torch.equal(first.weights, again.weights)
    assert first.weights.numel() == sum(p.numel() for p in small_mlp().parameters())
    assert first.evaluations[0].accuracy < 0.3 < 0.85 < first.evaluations[-1].accuracy


@pytest.mark.parametrize(
    ("rows", "labels", "workers", "message"),
    [(10, 9, 2, "as many rows"), (1, 1, 2, "cannot make 2 shards"), (10, 10, 0, "workers")],
)
def test_bad_user_data_is_refused_naming_the_cause(
    rows: int, labels: int, workers: int, message: str
) -> None:
    x, test = torch.zeros(rows, 4), torch.zeros(3, 4)
    y, test_y = torch.zeros(labels, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        TrainingData.from_tensors(x, y, test, test_y, workers)


def test_float_labels_are_refused() -> None:
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="integer class labels"):
        TrainingData.from_tensors(x, torch.zeros(4), x, torch.zeros(4), 2)
