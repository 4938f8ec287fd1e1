"""The leader's loop: start queued jobs, follow their members, end attempts.

Every tick (and at once when a record changes) the leader reads the active
jobs from etcd and moves each one on. It keeps nothing of its own that a
successor could not rebuild: members are found again from the pids or
container ids in the records, and their progress from their output. So a
restarted or newly elected leader adopts running members; it neither orphans
nor duplicates them (starting a member is idempotent, see `launchers`).

- Queue: jobs start in order of priority, then arrival, each as a whole (all
  its members or none) when there is room: the service's own worker slots for
  local and docker members, the launcher's `reserve` for the others (agents'
  slots, written in the same transaction as the move to STARTING). A job that
  does not fit holds back those behind it on the same launcher, so a big job is
  never starved by small ones.
- Following: each member's output gives its rank, phase and failure, and the
  job's progress (`following`). When every member passed `connect` the job is
  RUNNING.
- Ending: when a job succeeds, fails, restarts or is stopped is decided by
  `job_rules.decide`, from the record and its members alone. The members then get
  SIGTERM, SIGKILL after the grace; once all are gone the leases of the attempt's
  keys are revoked and its rendezvous keys deleted, and only then does the job
  enter its final state (or its next attempt, a new rendezvous round).
- Leading: the reconciler acts only while its leadership lease is proven (see
  `leadership`): each job's step and each member's start first asks. A member
  is started only then, and recorded with a write fenced by the leader key; one
  that cannot be recorded before the lease could have expired is killed at
  once, so a successor that starts that member finds no other copy running.
- Credentials: each attempt's members connect as an etcd user of the job's own
  (`job_credentials`); a new leader first deletes those of jobs that ended or
  are gone meanwhile.

It is long because it is the one place where decisions become effects, each
fenced by leadership and written so a successor can take over half-way; the
decisions themselves (`job_rules`), the following (`following`) and the
credentials (`job_credentials`) already live apart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError, EtcdUnavailable
from coordinator.etcd.txn import Put
from coordinator.etcd.users import (
    Credentials,
)
from coordinator.etcd.watch import WatchEvent
from coordinator.jobs.kinds import kind_of
from coordinator.keys import Keys
from coordinator.launch import WorkerCommand
from coordinator.service.control.following import Follower, fitting
from coordinator.service.control.job_credentials import JobCredentials
from coordinator.service.control.job_rules import (
    Action,
    Advance,
    FinishAttempt,
    KillStragglers,
    StartNext,
    StopAttempt,
    decide,
)
from coordinator.service.control.leadership import Leadership
from coordinator.service.launchers import (
    OWN_SLOTS,
    Launch,
    Reservation,
    WorkerLauncher,
)
from coordinator.service.model import Attempt, JobRecord, JobState, Launcher, Member
from coordinator.service.states import TRANSITIONS, advance, restarts_left
from coordinator.service.store import InvalidChange, InvalidRecord, JobNotFound, JobStore

log = logging.getLogger(__name__)
S = JobState
#: Seconds a member's kill is given before the leadership lease could expire.
KILL_TIME = 0.25


class NotLeading(Exception):
    """This replica can no longer prove its leadership lease: it stops acting at once."""


@dataclass(frozen=True)
class ReconcilerSettings:
    etcd: str  # the endpoints members are given
    namespace: str
    max_workers: int
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL
    member_ttl: int = 10
    member_connect_timeout: float = 10.0
    tick: float = 0.25
    progress_interval: float = 0.5  # at most this often a job's progress is written


class Reconciler:
    def __init__(
        self,
        etcd: Etcd,
        store: JobStore,
        launchers: dict[Launcher, WorkerLauncher],
        settings: ReconcilerSettings,
        leadership: Leadership,
    ) -> None:
        self.etcd, self.store, self.launchers = etcd, store, launchers
        self.keys = Keys(etcd.namespace)
        self.settings, self.leadership = settings, leadership
        self.launched = 0  # members started by this replica (for /metrics)
        self.restarts = 0
        self._wake = threading.Event()
        self.follower = Follower(settings.progress_interval)
        # Per-job etcd users: None until known; False when etcd has no auth or the service's
        # user may not make users (members then connect as the service does).
        self.credentials = JobCredentials(etcd, store)
        self._leading = False
        self._deleted: set[str] = set()  # jobs whose records were deleted: users to remove
        self._deleted_lock = threading.Lock()
        self._watch = etcd.watch(store.keys.records, self._on_change, start_revision=0, prefix=True)
        # Records each member just started, so that waiting for it is bounded by the lease.
        self._recorder = ThreadPoolExecutor(1, thread_name_prefix="record-member")

    def _on_change(self, events: list[WatchEvent]) -> None:
        gone = [self.store.keys.record_id(e.key) for e in events if e.kind == "delete"]
        if gone:
            with self._deleted_lock:
                self._deleted.update(gone)
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Lead when possible, and reconcile while leading, until `stop`."""
        while not stop.is_set():
            try:
                if not self.leadership.try_to_lead():
                    self._leading = False
                    self.leadership.wait_for_change(1.0)
                    continue
                if not self._leading:  # nothing of a job outlives it, even after a crash
                    self.credentials.remove_stale()
                    self._leading = True
                self._remove_deleted_users()
                self.reconcile_once(time.time())
            except NotLeading as exc:  # the lease is unproven: nothing more until it is
                log.warning("reconcile paused: %s", exc)
            except EtcdError as exc:  # etcd away: try again next tick
                log.warning("reconcile: %s", exc)
            except Exception:  # a bug must not stop every job's progress: log it, go on
                log.exception("reconcile failed; trying again next tick")
            self._wake.wait(self.settings.tick)
            self._wake.clear()

    def close(self) -> None:
        self._watch.cancel()
        self.follower.reads.close()
        self._recorder.shutdown(wait=False, cancel_futures=True)

    def _check_leading(self) -> None:
        if not self.leadership.leading:
            proven = self.leadership.proven_for()
            raise NotLeading(f"leadership lease proven for only {proven:.2f}s")

    # -- one pass -----------------------------------------------------------

    def reconcile_once(self, now: float) -> None:
        active = [stored for stored in self.store.scan() if not stored.record.state.terminal]
        pending = []
        busy = 0  # the service's own worker slots in use (local and docker members)
        for stored in sorted(active, key=lambda s: s.create_revision):
            record = stored.record
            if record.state == S.PENDING:
                if record.cancel_requested_at is not None:
                    self._isolated(record.id, self._cancel_pending, record.id, now)
                else:
                    pending.append(stored)
                continue
            if record.spec.launcher in OWN_SLOTS:
                busy += record.spec.workers
            self._isolated(record.id, self._tend, record, now)
        free = self.settings.max_workers - busy
        held: set[Launcher] = set()  # launchers whose queue head does not fit
        for stored in sorted(pending, key=lambda s: (-s.record.spec.priority, s.create_revision)):
            record = stored.record
            launcher = record.spec.launcher
            if launcher in held:
                continue  # strict order: nothing overtakes the head of its launcher's queue
            if launcher in OWN_SLOTS and record.spec.workers > free:
                held.add(launcher)
                continue
            started = self._isolated(record.id, self._start_attempt, record, now)
            if started and launcher in OWN_SLOTS:
                free -= record.spec.workers
            elif started is False:  # it does not fit yet (None: its step failed, logged)
                held.add(launcher)
        for each in self.launchers.values():  # placements a writer never committed
            self._check_leading()
            each.sweep()

    def _isolated(self, job_id: str, step: Callable[..., Any], *args: Any) -> Any:
        """One job's step (its result; None when it failed): what goes wrong with one job
        stops only that job's step, never the others'. A record that turned invalid
        meanwhile is left alone (the store logged it). A leader that can no longer prove
        its lease takes no step at all. Only etcd being away stops the whole pass: an
        error of one job's own would otherwise hold back every job after it."""
        self._check_leading()
        try:
            return step(*args)
        except (JobNotFound, InvalidRecord):
            return None
        except (EtcdUnavailable, NotLeading):
            raise  # etcd away, or leadership unproven: the whole pass waits for the next tick
        except EtcdError as exc:  # refused for this job alone (a request too large, say)
            log.warning("job %s: etcd: %s; trying again next tick", job_id, exc)
        except InvalidChange as exc:
            log.warning("job %s: %s", job_id, exc)
        except Exception:
            log.exception("job %s: reconcile step failed; trying again next tick", job_id)
        return None

    def _cancel_pending(self, job_id: str, now: float) -> None:
        def change(record: JobRecord) -> JobRecord | None:
            if record.state != S.PENDING:
                return None
            return advance(record, S.CANCELLED, "cancelled before it started", now)

        self.store.update(job_id, change)

    # -- attempts -------------------------------------------------------------

    def _start_attempt(self, record: JobRecord, now: float) -> bool:
        """Start the job's next attempt if it fits now (False: it waits)."""
        number = len(record.attempts) + 1
        launcher = self.launchers[record.spec.launcher]
        # The credentials are chosen first (the agents launcher writes them into its
        # assignments), but the user is made only once the attempt fits: none for a job
        # that waits.
        credentials = self.credentials.planned(record.id)
        launch = self._launch(record, number, credentials)
        reservation = launcher.reserve(launch)
        if reservation is None:
            return False
        started: JobRecord | None = None
        try:
            if credentials is not None and not self.credentials.provision(record.id, credentials):
                credentials = None  # the service may not make users: members connect as it does
                _release(reservation)  # (assignments written ahead name the credentials)
                launch = self._launch(record, number)
                reservation = launcher.reserve(launch)
                if reservation is None:
                    return False
            started = self._commit_attempt(record, number, reservation, credentials, now)
        finally:
            if started is None or not _started(started, number):
                _release(reservation)  # not committed (or not by us): what it wrote ahead goes
        assert started is not None  # (else it raised)
        record = started
        if not _started(record, number):
            return False
        if number > 1:
            self.restarts += 1
        self.launched += len(reservation.members)
        self._launch_members(record, launch, now)
        return True

    def _commit_attempt(
        self,
        record: JobRecord,
        number: int,
        reservation: Reservation,
        credentials: Credentials | None,
        now: float,
    ) -> JobRecord:
        """Move the job to STARTING with attempt `number`, with the reservation's writes
        and guards in the same transaction; the record as it then is."""
        puts = list(reservation.puts)
        if credentials is not None:  # for a leader that has to finish this launch
            stored = {"user": credentials.user, "password": credentials.password}
            puts.append(Put(self.credentials.key(record.id), json.dumps(stored)))

        def change(current: JobRecord) -> JobRecord | None:
            if current.state not in (S.PENDING, S.RESTARTING) or len(current.attempts) >= number:
                return None  # another replica got there first
            if current.cancel_requested_at is not None:
                return None
            reason = f"attempt {number}: starting {current.spec.workers} members"
            started = advance(current, S.STARTING, reason, now)
            attempt = Attempt(number=number, started_at=now, members=reservation.members)
            started.attempts = [*current.attempts, attempt]
            return started

        self._check_leading()
        guards = [*reservation.guards, *self.leadership.fence()]
        return self.store.update(record.id, change, guards, puts)

    def _launch_members(self, record: JobRecord, launch: Launch, now: float) -> None:
        """Start the attempt's members not yet recorded (all of them, or what a previous
        leader left undone), recording each as soon as it runs."""
        attempt = record.attempt
        assert attempt is not None
        launcher = self.launchers[record.spec.launcher]
        for index in range(len(attempt.members), record.spec.workers):
            self._check_leading()  # never start a member a successor may start too
            try:
                member = launcher.start(launch, index)
            except Exception as exc:  # no container engine, an image missing, ...
                reason = f"could not start member {index}: {exc}"
                self._stop_attempt(record.id, attempt.number, reason, S.FAILED, now)
                return
            self.launched += 1
            record = self._record_started(record.id, attempt.number, member, launcher)

    def _record_started(
        self, job_id: str, attempt: int, member: Member, launcher: WorkerLauncher
    ) -> JobRecord:
        """Record a member just started, fenced by our leadership. Unrecorded once the
        lease could expire (etcd unreachable, a successor's member in its place), it is
        killed: nobody else knows of it, and a successor will start that member anew."""
        budget = self.leadership.proven_for() - KILL_TIME
        write = self._recorder.submit(
            self.store.update, job_id, _with_member(attempt, member), self.leadership.fence()
        )
        try:
            record = write.result(timeout=max(0.0, budget))
        except Exception as exc:
            launcher.kill(member)
            why = "no confirmation in time" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("job %s: member %d killed, unrecorded: %s", job_id, member.index, why)
            if isinstance(exc, TimeoutError):
                raise NotLeading(f"member {member.index} of job {job_id} unrecorded") from None
            raise
        if not _records(record, attempt, member):
            launcher.kill(member)
            log.warning("job %s: member %d killed: not recorded as ours", job_id, member.index)
            raise NotLeading(f"member {member.index} of job {job_id} not recorded as ours")
        return record

    def _launch(
        self, record: JobRecord, attempt: int, credentials: Credentials | None = None
    ) -> Launch:
        command = self._worker_command(record, attempt)
        return Launch(record.run_id, attempt, record.spec, command, credentials)

    def _remove_deleted_users(self) -> None:
        with self._deleted_lock:
            deleted, self._deleted = self._deleted, set()
        for job_id in deleted:
            self.credentials.revoke(job_id)

    def _ended(self, record: JobRecord) -> None:
        """Once a job is over, its members' credentials go."""
        if record.state.terminal:
            self.credentials.revoke(record.id)

    def _worker_command(self, record: JobRecord, attempt: int) -> WorkerCommand:
        spec = record.spec
        params = kind_of(spec.kind).retry_params(spec.params, attempt)  # e.g. mnist resumes
        is_command = kind_of(spec.kind).takes_command and bool(spec.command)
        return WorkerCommand(
            job_id=record.id,
            world_size=spec.workers,
            etcd=self.settings.etcd,
            namespace=self.settings.namespace,
            kind=spec.kind,
            ttl=self.settings.member_ttl,
            connect_timeout=self.settings.member_connect_timeout,
            params=params,
            # A list, never joined; its env and folder reach the member by its environment.
            program=tuple(spec.command) if is_command and spec.command else None,
            program_env=spec.env if is_command else {},
            working_dir=spec.working_dir if is_command else None,
        )

    # -- following ------------------------------------------------------------

    def _tend(self, record: JobRecord, now: float) -> None:
        """Follow the job's members, decide (`job_rules.decide`), apply."""
        attempt = record.attempt
        if attempt is None:
            return
        launcher = self.launchers[record.spec.launcher]
        members = attempt.members
        if attempt.ended_at is None:
            if (
                record.state == S.STARTING
                and attempt.stopping_since is None
                and len(attempt.members) < record.spec.workers
            ):  # a predecessor died half-way through launching
                credentials = self.credentials.stored(record.id)
                self._launch_members(record, self._launch(record, attempt.number, credentials), now)
                record = self.store.get(record.id).record
                attempt = record.attempt
                assert attempt is not None
            members = [
                self.follower.follow(record, attempt.number, m, launcher) for m in attempt.members
            ]
        actions = decide(record, members, now, self.settings.grace)
        if attempt.ended_at is None:  # one update: what was seen, and what was decided of it
            record = self.store.update(
                record.id,
                _observed(attempt.number, members, self.follower.progress(record), actions, now),
            )
            self._ended(record)
        for action in actions:
            if isinstance(action, StopAttempt):
                self._terminate(record, attempt.number)
            elif isinstance(action, KillStragglers):
                for member in members:
                    if member.exit_code is None:
                        launcher.kill(member)
            elif isinstance(action, FinishAttempt):
                self._finish_attempt(record, now)
            elif isinstance(action, StartNext):
                self._start_attempt(record, now)
            elif attempt.ended_at is not None:  # an Advance between attempts
                self._advance(record.id, action.state, action.reason, now)

    # -- ending ---------------------------------------------------------------

    def _stop_attempt(
        self, job_id: str, attempt: int, reason: str, then: JobState, now: float
    ) -> None:
        """Ask the attempt's members to leave; the job moves on once they are gone."""
        record = self.store.update(job_id, _stopping(attempt, StopAttempt(reason, then), now))
        self._terminate(record, attempt)

    def _terminate(self, record: JobRecord, attempt: int) -> None:
        """SIGTERM to the attempt's members still running (once it is stopping)."""
        last = record.attempt
        if last is None or last.number != attempt or last.stopping_since is None:
            return
        launcher = self.launchers[record.spec.launcher]
        for member in last.members:
            if member.exit_code is None:
                launcher.terminate(member)

    def _finish_attempt(self, record: JobRecord, now: float) -> None:
        """Every member is gone: clear the attempt's keys, then enter the state it led to."""
        attempt = record.attempt
        assert attempt is not None and attempt.then is not None
        self._clear_rendezvous(record.id)
        launcher = self.launchers[record.spec.launcher]
        launcher.placement_ended(record.run_id, attempt.number)

        def change(current: JobRecord) -> JobRecord | None:
            last = current.attempt
            if last is None or last.number != attempt.number or last.ended_at is not None:
                return None
            updated = current.model_copy(deep=True)
            updated.attempts[-1].ended_at = now
            if attempt.then == S.RESTARTING:
                return updated  # already RESTARTING; the next tick starts the next attempt
            return advance(updated, attempt.then, attempt.outcome or "", now)

        self._ended(self.store.update(record.id, change))
        job_over = attempt.then != S.RESTARTING
        self.follower.forget(record.id, attempt.number, len(attempt.members), job_over)

    def _clear_rendezvous(self, job_id: str) -> None:
        """Revoke the leases of what the attempt's members left, and their rendezvous keys
        (a member killed by SIGKILL leaves its keys until its lease would expire)."""
        keys = self.keys.job(job_id)
        kvs, _ = self.etcd.get_prefix(keys.job)
        for lease in {kv.lease for kv in kvs if kv.lease}:
            with contextlib.suppress(EtcdError):
                self.etcd.revoke_lease(lease)
        self.etcd.delete_prefix(keys.rendezvous)

    def _advance(self, job_id: str, state: JobState, reason: str, now: float) -> None:
        def change(record: JobRecord) -> JobRecord | None:
            if state not in TRANSITIONS[record.state]:
                return None
            return advance(record, state, reason, now)

        self._ended(self.store.update(job_id, change))


def _observed(
    attempt: int,
    members: list[Member],
    progress: dict[str, Any] | None,
    actions: list[Action],
    now: float,
) -> Callable[[JobRecord], JobRecord | None]:
    """The change that records the attempt's members and the job's progress as seen,
    and what `decide` made of them (RUNNING, the attempt stopping)."""

    def change(current: JobRecord) -> JobRecord | None:
        last = current.attempt
        if last is None or last.number != attempt:
            return None
        updated = current.model_copy(deep=True)
        ours = {m.index: m for m in members}
        updated.attempts[-1].members = [ours.get(m.index, m) for m in last.members]
        if progress:
            artifacts = progress.get("artifacts") or {}
            updated.artifacts = {**updated.artifacts, **artifacts}
            fields = {k: v for k, v in progress.items() if k != "artifacts"}
            fields = fitting(updated.progress, fields)
            if fields:
                updated.progress = updated.progress.model_copy(update={**fields, "updated_at": now})
        for action in actions:
            if isinstance(action, Advance) and action.state in TRANSITIONS[updated.state]:
                updated = advance(updated, action.state, action.reason, now)
            elif isinstance(action, StopAttempt):
                updated = _stopping(attempt, action, now)(updated) or updated
        return updated

    return change


def _stopping(
    attempt: int, stop: StopAttempt, now: float
) -> Callable[[JobRecord], JobRecord | None]:
    """The change that marks attempt `attempt` stopping, for `stop`'s reason and state."""

    def change(record: JobRecord) -> JobRecord | None:
        last = record.attempt
        if last is None or last.number != attempt or last.stopping_since is not None:
            return None
        updated = record.model_copy(deep=True)
        if stop.then == S.RESTARTING:  # says so at once; the next attempt waits for the members
            left = restarts_left(record)
            updated = advance(updated, S.RESTARTING, f"{stop.reason}; {left} restart(s) left", now)
        updated.attempts[-1].outcome = stop.reason
        updated.attempts[-1].stopping_since = now
        updated.attempts[-1].then = stop.then
        return updated

    return change


def _started(record: JobRecord, number: int) -> bool:
    """The record is STARTING attempt `number`."""
    return record.state == S.STARTING and len(record.attempts) == number


def _release(reservation: Reservation | None) -> None:
    """Undo what the reservation wrote ahead (it checks that it was not committed)."""
    if reservation is not None and reservation.release is not None:
        reservation.release()


def _with_member(attempt: int, member: Member) -> Callable[[JobRecord], JobRecord | None]:
    def change(record: JobRecord) -> JobRecord | None:
        last = record.attempt
        if last is None or last.number != attempt:
            return None
        if any(m.index == member.index for m in last.members):
            return None
        updated = record.model_copy(deep=True)
        updated.attempts[-1].members = sorted([*last.members, member], key=lambda m: m.index)
        return updated

    return change


def _records(record: JobRecord, attempt: int, member: Member) -> bool:
    """The record's attempt `attempt` holds `member` as the one we started (its index
    with our process or container), not another's."""
    last = record.attempt
    if last is None or last.number != attempt:
        return False
    found = next((m for m in last.members if m.index == member.index), None)
    return found is not None and (found.pid, found.started, found.container) == (
        member.pid,
        member.started,
        member.container,
    )
