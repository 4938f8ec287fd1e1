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
- Following: each member's JSON events give its rank, phase, failure and the
  job's progress (rounds or steps and the latest metrics). When every member
  passed `connect` the job is RUNNING.
- Ending: all members exit 0 -> SUCCEEDED. A member fails -> RESTARTING while
  `max_restarts` allows, else FAILED, with the first failure that is not a
  consequence of another (a `MemberLost` names its cause) as the reason. A
  cancel or the deadline stops the attempt too. The members then get SIGTERM,
  SIGKILL after the grace; once all are gone the leases of the attempt's keys
  are revoked and its rendezvous keys deleted, and only then does the job
  enter its final state (or its next attempt, a new rendezvous round).
- Leading: the reconciler acts only while its leadership lease is proven (see
  `leadership`): each job's step and each member's start first asks. A member
  is started only then, and recorded with a write fenced by the leader key; one
  that cannot be recorded before the lease could have expired is killed at
  once, so a successor that starts that member finds no other copy running.
- Credentials: each attempt's members connect as an etcd user of the job's own,
  which may touch only `<ns>/jobs/<id>/`. It is made when the attempt starts,
  kept at `<ns>/api/credentials/<id>` (the service's alone, so a new leader can
  finish a launch), and deleted with its role when the job ends or is deleted; a
  new leader first deletes those of jobs that ended or are gone meanwhile.
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

from pydantic import BaseModel, ValidationError

from coordinator.etcd.client import Etcd, EtcdError, Put, WatchEvent
from coordinator.etcd.users import (
    CannotManageUsers,
    Credentials,
    job_user,
    job_users,
    new_password,
    provision_job,
    revoke_job,
)
from coordinator.events import Done, Failed, Phase, Report, Round, Step
from coordinator.jobs import COMMAND
from coordinator.jobs.kinds import kind_of
from coordinator.keys import Keys
from coordinator.launch import WorkerCommand
from coordinator.service.launchers import (
    OWN_SLOTS,
    VANISHED,
    Launch,
    PlacesAhead,
    Reservation,
    WorkerLauncher,
)
from coordinator.service.leadership import Leadership
from coordinator.service.model import Attempt, JobRecord, JobState, Launcher, Member
from coordinator.service.series import member_events
from coordinator.service.states import TRANSITIONS, advance, restarts_left
from coordinator.service.store import InvalidChange, InvalidRecord, JobNotFound, JobStore

log = logging.getLogger(__name__)
S = JobState
PAST_CONNECT = {"connect", "training", "cleaner", "done"}
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
        self._offsets: dict[tuple[str, int, int], int] = {}  # (job, attempt, index) -> bytes read
        self._progress_at: dict[str, float] = {}
        self._pending_progress: dict[str, dict[str, Any]] = {}  # job -> not yet written
        # Per-job etcd users: None until known; False when etcd has no auth or the service's
        # user may not make users (members then connect as the service does).
        self._per_job_users: bool | None = None
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
                    self._remove_stale_users()
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
            elif self._isolated(record.id, self._start_attempt, record, now):
                if launcher in OWN_SLOTS:
                    free -= record.spec.workers
            else:
                held.add(launcher)
        for each in self.launchers.values():
            if isinstance(each, PlacesAhead):  # placements a writer never committed
                self._check_leading()
                each.sweep()

    def _isolated(self, job_id: str, step: Callable[..., Any], *args: Any) -> Any:
        """One job's step (its result; None when it failed): what goes wrong with one job
        stops only that job's step, never the others'. A record that turned invalid
        meanwhile is left alone (the store logged it). A leader that can no longer prove
        its lease takes no step at all."""
        self._check_leading()
        try:
            return step(*args)
        except (JobNotFound, InvalidRecord):
            return None
        except (EtcdError, NotLeading):
            raise  # etcd away, or leadership unproven: the whole pass waits for the next tick
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
        credentials = self._planned_credentials(record.id)
        launch = self._launch(record, number, credentials)
        reservation = launcher.reserve(launch)
        if reservation is None:
            return False
        started: JobRecord | None = None
        try:
            if credentials is not None and not self._provision(record.id, credentials):
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
            puts.append(Put(self.keys.credential(record.id), json.dumps(stored)))

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

    # -- credentials --------------------------------------------------------------

    def _planned_credentials(self, job_id: str) -> Credentials | None:
        """The job's user with a new password (not made yet: `_provision` does), or None
        when members must connect as the service does."""
        if self._per_job_users is None and not self.etcd.auth_enabled():
            self._per_job_users = False  # a plain etcd: nobody has credentials
        if self._per_job_users is False:
            return None
        return Credentials(job_user(self.etcd.namespace, job_id), new_password())

    def _provision(self, job_id: str, credentials: Credentials) -> bool:
        """Make the job's user (if missing) with these credentials' password; False when
        the service's own user may not make users."""
        try:
            provision_job(self.etcd, job_id, credentials.password)
        except CannotManageUsers as exc:
            log.warning("members connect as the service's own etcd user: %s", exc)
            self._per_job_users = False
            return False
        self._per_job_users = True
        return True

    def _stored_credentials(self, job_id: str) -> Credentials | None:
        """The credentials the attempt started with (a predecessor's launch to finish)."""
        kv = self.etcd.get(self.keys.credential(job_id))
        if kv is None:
            return None
        try:
            stored = json.loads(kv.value)
            user, password = stored["user"], stored["password"]
            if not isinstance(user, str) or not isinstance(password, str):
                raise TypeError("user and password must be text")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("job %s: stored credentials unusable (%s): making new ones", job_id, exc)
            planned = self._planned_credentials(job_id)
            return planned if planned is not None and self._provision(job_id, planned) else None
        return Credentials(user, password)

    def _revoke(self, job_id: str) -> None:
        """The job's stored credentials, then its etcd user and role, go (none there is
        fine). A leader that dies in between leaves a user `_remove_stale_users` finds."""
        self.etcd.delete(self.keys.credential(job_id))
        if self._per_job_users is not False:
            try:
                revoke_job(self.etcd, job_id)
            except CannotManageUsers:
                self._per_job_users = False
            except ValueError:  # not a job id (a key that is no job's)
                pass

    def _remove_stale_users(self) -> None:
        """Remove the users of jobs that ended or are gone (a leader died before it could)."""
        try:
            with_users = set(job_users(self.etcd))
        except CannotManageUsers:
            with_users = set()
        stored, _ = self.etcd.get_prefix(self.keys.credentials, keys_only=True)
        for job_id in sorted(with_users | {self.keys.credential_id(kv.key) for kv in stored}):
            try:
                if not self.store.get(job_id).record.state.terminal:
                    continue
            except JobNotFound:
                pass
            except InvalidRecord:
                continue  # left alone, like everything about that job
            self._revoke(job_id)

    def _remove_deleted_users(self) -> None:
        with self._deleted_lock:
            deleted, self._deleted = self._deleted, set()
        for job_id in deleted:
            self._revoke(job_id)

    def _ended(self, record: JobRecord) -> None:
        """Once a job is over, its members' credentials go."""
        if record.state.terminal:
            self._revoke(record.id)

    def _worker_command(self, record: JobRecord, attempt: int) -> WorkerCommand:
        spec = record.spec
        params = kind_of(spec.kind).retry_params(spec.params, attempt)  # e.g. mnist resumes
        is_command = spec.kind == COMMAND and bool(spec.command)
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
        attempt = record.attempt
        if attempt is None:
            return
        if attempt.ended_at is not None:  # RESTARTING, and the failed attempt's members are gone
            if record.cancel_requested_at is not None:
                self._advance(record.id, S.CANCELLED, "cancelled by request", now)
            elif record.spec.deadline_seconds is not None and self._overdue(record, now):
                reason = f"deadline of {record.spec.deadline_seconds:g}s passed"
                self._advance(record.id, S.FAILED, reason, now)
            else:
                self._start_attempt(record, now)
            return
        launcher = self.launchers[record.spec.launcher]
        if (
            record.state == S.STARTING
            and attempt.stopping_since is None
            and len(attempt.members) < record.spec.workers
        ):
            credentials = self._stored_credentials(record.id)
            launch = self._launch(record, attempt.number, credentials)
            self._launch_members(record, launch, now)  # a predecessor died half-way through
            record = self.store.get(record.id).record
            attempt = record.attempt
            assert attempt is not None
        members = [self._follow(record, attempt.number, m, launcher) for m in attempt.members]
        progress = self._progress(record)
        codes = [m.exit_code for m in members]
        record = self._record_members(record, attempt.number, members, progress, now)
        attempt = record.attempt
        assert attempt is not None

        if attempt.stopping_since is not None:
            if all(code is not None for code in codes):
                self._finish_attempt(record, now)
            elif now - attempt.stopping_since > self.settings.grace:
                for member in members:
                    if member.exit_code is None:
                        launcher.kill(member)
            return
        complete = len(members) == record.spec.workers
        if (
            record.state == S.STARTING
            and complete
            and all(m.phase in PAST_CONNECT for m in members)
        ):  # said even when the job is already over: its history shows it ran
            self._advance(record.id, S.RUNNING, "every member passed connect", now)
        if record.cancel_requested_at is not None:
            self._stop_attempt(record.id, attempt.number, "cancelled by request", S.CANCELLED, now)
        elif record.spec.deadline_seconds is not None and self._overdue(record, now):
            reason = f"deadline of {record.spec.deadline_seconds:g}s passed"
            self._stop_attempt(record.id, attempt.number, reason, S.FAILED, now)
        elif complete and all(code == 0 for code in codes):
            self._stop_attempt(record.id, attempt.number, "every member exited 0", S.SUCCEEDED, now)
        elif any(code not in (None, 0) for code in codes):
            reason = _root_cause(members)
            then = S.RESTARTING if restarts_left(record) > 0 else S.FAILED
            self._stop_attempt(record.id, attempt.number, reason, then, now)

    def _follow(
        self, record: JobRecord, attempt: int, member: Member, launcher: WorkerLauncher
    ) -> Member:
        """The member with what its new output and its exit code say. What a member
        prints is not trusted to fit the record: what would not is left out."""
        key = (record.id, attempt, member.index)
        offset = self._offsets.get(key, 0)
        chunk = launcher.output(member, offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only
        self._offsets[key] = offset + len(complete)
        update: dict[str, Any] = {}
        for event in member_events(complete):
            rank = getattr(event, "rank", None)
            if rank is not None and rank < record.spec.workers:
                update["rank"] = rank
            if isinstance(event, Phase):
                update["phase"] = event.phase
            elif isinstance(event, Failed):
                update["failure"] = event.wire()
                update["phase"] = _text(f"failed in {event.phase}")
            elif isinstance(event, Done):
                update["phase"] = "done"
                if (address := event.address) is not None:
                    update["address"] = _text(address, 300)
                self._note_result(record.id, event.result)
            elif isinstance(event, Round | Step | Report):
                self._note_progress(record.id, event)
        if member.exit_code is None:
            code = launcher.exit_code(member)
            update["exit_code"] = code if code is None or _is_exit_code(code) else VANISHED
        return member.model_copy(update=_fitting(member, update)) if update else member

    def _note_progress(self, job_id: str, event: Round | Step | Report) -> None:
        pending = self._pending_progress.setdefault(job_id, {})
        if isinstance(event, Round):  # xgboost: rounds and the evaluation metrics
            pending.update(step=event.round, total=event.rounds, metrics=event.metrics)
        elif isinstance(event, Step):  # steps and mnist trainers: steps and the loss
            pending.update(step=event.clock, total=event.target, metrics={"loss": event.loss})
        else:  # a command job's program, of itself: what it reports, no more
            reported = {"step": event.step, "total": event.total, "metrics": event.metrics}
            pending.update({k: v for k, v in reported.items() if v is not None and v != {}})

    def _note_result(self, job_id: str, result: dict[str, Any]) -> None:
        found = {k: str(v) for k, v in result.items() if k.endswith("_path") and v}
        self._pending_progress.setdefault(job_id, {}).setdefault("artifacts", {}).update(found)

    def _progress(self, record: JobRecord) -> dict[str, Any] | None:
        """What to write about the job's progress now (None: nothing, or not yet)."""
        pending = self._pending_progress.get(record.id)
        if not pending:
            return None
        due = self._progress_at.get(record.id, 0.0) + self.settings.progress_interval
        if time.monotonic() < due and "artifacts" not in pending:
            return None
        self._progress_at[record.id] = time.monotonic()
        return self._pending_progress.pop(record.id)

    def _record_members(
        self,
        record: JobRecord,
        attempt: int,
        members: list[Member],
        progress: dict[str, Any] | None,
        now: float,
    ) -> JobRecord:
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
                fields = _fitting(updated.progress, fields)
                if fields:
                    updated.progress = updated.progress.model_copy(
                        update={**fields, "updated_at": now}
                    )
            return updated

        return self.store.update(record.id, change)

    # -- ending ---------------------------------------------------------------

    def _stop_attempt(
        self, job_id: str, attempt: int, reason: str, then: JobState, now: float
    ) -> None:
        """Ask the attempt's members to leave; the job moves on once they are gone."""

        def change(record: JobRecord) -> JobRecord | None:
            last = record.attempt
            if last is None or last.number != attempt or last.stopping_since is not None:
                return None
            updated = record.model_copy(deep=True)
            if then == S.RESTARTING:  # says so at once; the next attempt waits for the members
                left = restarts_left(record)
                updated = advance(updated, S.RESTARTING, f"{reason}; {left} restart(s) left", now)
            updated.attempts[-1].outcome = reason
            updated.attempts[-1].stopping_since = now
            updated.attempts[-1].then = then
            return updated

        record = self.store.update(job_id, change)
        last = record.attempt
        assert last is not None
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
        if isinstance(launcher, PlacesAhead):  # what let its members start goes with them
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
        for index in range(len(attempt.members)):
            self._offsets.pop((record.id, attempt.number, index), None)
        if attempt.then != S.RESTARTING:  # the job is over: nothing more to note for it
            self._pending_progress.pop(record.id, None)
            self._progress_at.pop(record.id, None)

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

    def _overdue(self, record: JobRecord, now: float) -> bool:
        first = record.attempts[0].started_at if record.attempts else now
        return now - first > (record.spec.deadline_seconds or 0)


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


def _root_cause(members: list[Member]) -> str:
    """Why the attempt failed: a member's own failure before one that only lost a peer,
    and a member that died without a word named by its rank."""
    failures = [m for m in members if m.failure is not None]
    own = [m for m in failures if m.failure and m.failure.get("error") != "MemberLost"]
    for member in own:
        return _describe(member)
    for member in members:
        if member.exit_code not in (None, 0) and member.failure is None:
            return _describe(member)
    return _describe(failures[0]) if failures else "a member failed"


def _describe(member: Member) -> str:
    who = f"rank {member.rank}" if member.rank is not None else f"member {member.index}"
    if member.failure is not None:
        error, message = member.failure.get("error"), member.failure.get("message")
        return f"{who} failed ({error}): {message}"
    if member.exit_code == VANISHED:
        return f"{who} ended without a word (killed?)"
    signal_number = (member.exit_code or 0) - 128
    if signal_number > 0:
        return f"{who} was killed by signal {signal_number} (exit {member.exit_code})"
    return f"{who} exited {member.exit_code}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_exit_code(code: int) -> bool:
    return _is_int(code) and -1 <= code <= 255


def _text(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else str(value)
    return text[:limit]


def _fitting(current: BaseModel, update: dict[str, Any]) -> dict[str, Any]:
    """`update` without the fields that would make `current` invalid (a member's output
    is not trusted to fit the record; the store refuses to write a record that fails)."""
    update = dict(update)
    while update:
        try:
            type(current).model_validate({**current.model_dump(), **update}, strict=True)
            return update
        except ValidationError as exc:
            bad = {error["loc"][0] for error in exc.errors() if error["loc"]} & update.keys()
            if not bad:
                return {}
            for name in bad:
                del update[name]
    return update
