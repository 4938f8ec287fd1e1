"""`coordinator.context()`: the job, seen from inside a member's program.

A `command` job's program gets its place in the job from its environment (the
contract in `coordinator.jobs.environment`). `context()` reads and checks it,
and offers what the built-in jobs use:

- `barrier(name)`: the members' named barrier (`Member.barrier`), failing with
  `MemberLost` / `RendezvousTimeout`;
- `steps(method, ...)`: a step barrier (BSP, SSP, ASP, pBSP, pSSP, DSSP) with
  the built-in jobs' decision code (`program_steps.Steps` over `LiveBarrier`);
- `report(step=..., **metrics)`: progress for the service and the dashboard;
- `checkpoint_dir()` and `attempt`, for a restarted attempt to resume;
- `xgboost()`: XGBoost's collective, the tracker on rank 0 (`xgboost_collective`).

It connects to etcd only when a call needs it, so a program that only reports
needs no etcd; in a `command` job it connects through its member's proxy
(COORDINATOR_ETCD=`unix:<socket>`, coordinator.etcd.proxy), holding no etcd
credentials of its own.
See docs/api.md for the guarantees of each call.
"""

from __future__ import annotations

import atexit
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.barriers.arguments import barrier_spec, on_loss_of
from coordinator.etcd.client import Etcd
from coordinator.etcd.connection import UNIX
from coordinator.etcd.names import check_name
from coordinator.etcd.security import EtcdSecurity
from coordinator.events import REPORTS_FD_ENV, Report, write_line
from coordinator.keys import job_path
from coordinator.program_steps import Steps, check_ranks, check_stop
from coordinator.rendezvous.attached import AttachedMember
from coordinator.rendezvous.roster import RosterFile

#: How often at most a `report` line is printed (the last one always is).
REPORT_SECONDS = 0.2
#: The variables `context()` needs; the member sets them all (environment.py).
REQUIRED = (
    "COORDINATOR_JOB", "COORDINATOR_RANK", "COORDINATOR_WORLD_SIZE", "COORDINATOR_ROSTER",
    "COORDINATOR_ARTIFACTS", "COORDINATOR_ETCD", "COORDINATOR_NAMESPACE",
    "COORDINATOR_ROUND", "COORDINATOR_LEASE",
)  # fmt: skip
HOW_TO_RUN = "coordinator run --workers N -- python prog.py"


class NotInJob(RuntimeError):
    """`context()` was called in a process that no member started."""


def _read_environment(env: Mapping[str, str]) -> dict[str, Any]:
    missing = [name for name in REQUIRED if not env.get(name)]
    if missing:
        raise NotInJob(
            f"coordinator.context() works only in a program a job member started ("
            f"{', '.join(missing)} not set); run it as `{HOW_TO_RUN}`"
        )
    try:
        values = {
            "job": check_name("job id", env["COORDINATOR_JOB"]),
            "rank": int(env["COORDINATOR_RANK"]),
            "world_size": int(env["COORDINATOR_WORLD_SIZE"]),
            "round": int(env["COORDINATOR_ROUND"]),
            "lease": int(env["COORDINATOR_LEASE"], 16),
        }
    except ValueError as exc:
        raise NotInJob(
            f"the job's environment is malformed ({exc}); run as `{HOW_TO_RUN}`"
        ) from None
    if not 0 <= values["rank"] < values["world_size"]:
        raise NotInJob(f"COORDINATOR_RANK={values['rank']} is not below COORDINATOR_WORLD_SIZE")
    return values


def etcd_wait_from(env: Mapping[str, str]) -> float | None:
    """How long a request waits for etcd: the member's own wait (COORDINATOR_ETCD_WAIT),
    if it is a number of seconds within reason; None: the client's default."""
    try:
        seconds = float(env.get("COORDINATOR_ETCD_WAIT", ""))
    except ValueError:
        return None
    return seconds if 1 <= seconds <= 3600 else None


def _read_roster(path: Path, job: str, world_size: int) -> RosterFile:
    try:
        roster = RosterFile.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise NotInJob(f"cannot read the roster file $COORDINATOR_ROSTER ({exc})") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise NotInJob(f"the roster file {path} is malformed: {problems}") from None
    if (roster.job_id, roster.world_size) != (job, world_size):
        raise NotInJob(f"the roster file {path} is of another job or size")
    return roster


class Context:
    """One program's place in its job; get it with `coordinator.context()`."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        values = _read_environment(env)
        self.job: str = values["job"]
        self.rank: int = values["rank"]
        self.world_size: int = values["world_size"]
        self.round: int = values["round"]
        self._lease: int = values["lease"]
        self._etcd_wait = etcd_wait_from(env)
        self.roster = _read_roster(Path(env["COORDINATOR_ROSTER"]), self.job, self.world_size)
        self.artifacts = Path(env["COORDINATOR_ARTIFACTS"])
        self._endpoints = env["COORDINATOR_ETCD"]
        self._namespace = env["COORDINATOR_NAMESPACE"]
        self._member: AttachedMember | None = None
        self._etcd: Etcd | None = None
        self._attempt: int | None = None
        self._steps_made = 0
        self._lock = threading.Lock()
        self._reporter = _Reporter(_reports_fd(env))

    # -- etcd, when needed --------------------------------------------------

    @property
    def member(self) -> AttachedMember:
        """The program's view of its member (internal: the barriers use it)."""
        with self._lock:
            if self._member is None:
                self._etcd = Etcd(
                    self._endpoints,
                    namespace=self._namespace,
                    probe=self._probe,
                    retry_window=self._etcd_wait,
                    # (through the member's proxy no credentials are sent: it has them)
                    security=EtcdSecurity() if self._endpoints.startswith(UNIX) else None,
                )
                self._member = AttachedMember(
                    self._etcd,
                    self.job,
                    self.world_size,
                    rank=self.rank,
                    round_=self.round,
                    lease_id=self._lease,
                ).attach()
            return self._member

    @property
    def _probe(self) -> str:
        return job_path(self.job)

    @property
    def attempt(self) -> int:
        """1 for the job's first rendezvous round, 2 after one restart, ... (from etcd:
        every program of a round records the round, unleased, and counts those before)."""
        if self._attempt is None:
            etcd = self.member.etcd
            keys = self.member.keys
            # Created once, by whichever rank comes first; the others read it back.
            _, kv, _ = etcd.create(keys.program_round(self.round), "")
            self._attempt = etcd.count_prefix(
                keys.program_rounds, max_create_revision=kv.create_revision
            )
        return self._attempt

    def checkpoint_dir(self) -> Path:
        """`<artifacts>/checkpoints` (0700): the job's folder that survives restarts."""
        folder = self.artifacts / "checkpoints"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        return folder

    # -- barriers -----------------------------------------------------------

    def barrier(self, name: str, timeout: float | None = None) -> None:
        """Wait until every member's program called `barrier(name)` as often as this one.

        Raises `MemberLost` naming a peer lost meanwhile, `RendezvousTimeout` after
        `timeout` seconds (default 300; `float("inf")`: none)."""
        check_name("barrier name", name)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.member.barrier(name, timeout=timeout)

    def steps(
        self,
        method: str,
        *,
        staleness: int = 0,
        sample: int = 0,
        staleness_upper: int = 0,
        on_loss: str = "fail",
        num_steps: int | None = None,
        last_step: int | None = None,
        start: int = 0,
        seed: int | None = None,
        timeout: float | None = None,
        ranks: Iterable[int] | None = None,
    ) -> Steps:
        """A step barrier pacing this program's loop (see `Steps`); arguments are checked
        here, before anything is written to etcd. `ranks`: the ranks that step (default
        all; a parameter server's trainers, say). Losing a rank outside them fails the
        steps whatever `on_loss` says."""
        stepping = check_ranks(ranks, self.rank, self.world_size)
        spec = barrier_spec(method, staleness, sample, staleness_upper, stepping=len(stepping))
        loss = on_loss_of(on_loss)
        target = check_stop(num_steps, last_step, start)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._steps_made += 1
        root = self.member.keys.program_steps(self._steps_made)
        return Steps(self.member, spec, loss, target, start, seed, timeout, root, stepping)

    # -- XGBoost ------------------------------------------------------------

    def xgboost(self, timeout: int = 300) -> AbstractContextManager[None]:
        """`with ctx.xgboost(): xgboost.train(...)`: the body runs in XGBoost's collective,
        rank 0 running the tracker on MASTER_PORT. A lost peer ends it with `MemberLost`
        (see `coordinator.xgboost_collective`); `timeout`: XGBoost's, in seconds."""
        from coordinator.xgboost_collective import collective

        master = self.roster.master
        return collective(
            self.member,
            (master.addr, master.port),
            lambda name, seconds: self.barrier(name, timeout=seconds),
            timeout,
        )

    # -- reports ------------------------------------------------------------

    def report(
        self,
        step: int | None = None,
        *,
        total: int | None = None,
        message: str | None = None,
        **metrics: float,
    ) -> None:
        """Report progress: a `report` event on stdout, at most one every 0.2 s (the
        latest wins; the last is printed at exit). Never blocks on etcd."""
        try:
            event = Report(
                step=step,
                total=total,
                message=message,
                metrics={name: float(value) for name, value in metrics.items()},
            )
        except (ValidationError, TypeError, ValueError) as exc:
            raise ValueError(f"report: {exc}") from None
        self._reporter.offer(event)

    def flush(self) -> None:
        """Print the report held back by coalescing now."""
        self._reporter.flush()

    def close(self) -> None:
        self._reporter.flush()
        with self._lock:
            if self._member is not None:
                self._member.close()
                self._member = None
            if self._etcd is not None:
                self._etcd.close()
                self._etcd = None


def _reports_fd(env: Mapping[str, str]) -> int | None:
    """The pipe the member reads reports from (COORDINATOR_REPORTS_FD), if it is one."""
    value = env.get(REPORTS_FD_ENV, "")
    if not value.isdigit() or len(value) > 6:
        return None
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        os.set_inheritable(fd, False)  # the program's own children have no business there
    except OSError:
        return None
    return fd


class _Reporter:
    """Coalesces reports: one line at once, then at most one per REPORT_SECONDS.

    Lines go to the member's reports pipe: the timer thread that writes a held-back
    report must not write into stdout, where it could land inside a line the program
    is printing (print writes the text and its newline apart). Without the pipe (an
    older member), stdout it is."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._pending: Report | None = None
        self._last = 0.0
        self._timer: threading.Timer | None = None
        atexit.register(self.flush)

    def offer(self, event: Report) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last >= REPORT_SECONDS and self._timer is None:
                self._last = now
                self._write(event)
                return
            self._pending = event
            if self._timer is None:
                delay = max(0.0, self._last + REPORT_SECONDS - now)
                self._timer = threading.Timer(delay, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._pending is not None:
                self._write(self._pending)
                self._pending = None
                self._last = time.monotonic()

    def _write(self, event: Report) -> None:
        if self._fd is not None:
            data = (event.to_line() + "\n").encode()
            try:
                while data:  # (a line under PIPE_BUF, 4 KiB, goes in one atomic write)
                    data = data[os.write(self._fd, data) :]
                return
            except OSError:  # the program closed it: stdout from now on
                self._fd = None
        write_line(event.to_line())


_context: Context | None = None
_context_lock = threading.Lock()


def context() -> Context:
    """This program's `Context` (one per process), from its environment; `NotInJob`
    (saying how to run the program under `coordinator run`) outside a job."""
    global _context
    with _context_lock:
        if _context is None:
            _context = Context()
            atexit.register(_context.close)
        return _context
