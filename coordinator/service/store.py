"""Job records in etcd: create once, change only by compare-and-swap, list in pages.

Each record is one key, `<ns>/api/jobs/<id>`, holding the `JobRecord` JSON.
The key's create revision is the job's place in the queue; its mod revision
is what a change must still find, so two replicas never both move a job.

With `mirror=True` the store also keeps every record in memory, current within
one watch notification and never older than this replica's own writes (a
version is replaced only by a newer revision). Reads, lists and the leader's
scans then cost no request to etcd; writes still go to etcd, compared against
the revision they were based on, so a stale mirror can delay a change but
never let a wrong one through.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from coordinator.etcd.client import Etcd, Guard, KeyValue, LeaseNotFound, Put, Watch, WatchEvent
from coordinator.service.model import Condition, JobRecord, JobSpec, JobState

MAX_CAS_TRIES = 50


class JobNotFound(LookupError):
    pass


class JobConflict(ValueError):
    """The id is taken by a job with another spec."""


@dataclass(frozen=True)
class Stored:
    record: JobRecord
    mod_revision: int
    create_revision: int  # arrival order
    raw: bytes  # the record's JSON as stored (served as it is)


class JobStore:
    def __init__(self, etcd: Etcd, mirror: bool = False) -> None:
        self.etcd = etcd
        self.prefix = etcd.key("api", "jobs") + "/"
        self._mirror: dict[str, Stored] | None = None
        self._deleted: dict[str, int] = {}  # id -> revision of its deletion (mirror only)
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        if mirror:
            self._start_mirror()

    def key(self, job_id: str) -> str:
        return self.prefix + job_id

    # -- writes -----------------------------------------------------------------

    def submit(self, spec: JobSpec, now: float) -> tuple[JobRecord, bool]:
        """Create the job, or return the one already there with an equal spec: (record,
        created). A retried submit is safe; the same id with another spec is refused."""
        record = JobRecord(
            id=spec.id,
            uid=uuid.uuid4().hex,
            spec=spec,
            state=JobState.PENDING,
            conditions=[Condition(state=JobState.PENDING, reason="submitted", at=now)],
            submitted_at=now,
        )
        created, current, _ = self.etcd.create(self.key(spec.id), record.model_dump_json())
        stored = _stored(current)
        self._offer(stored)
        if created:
            return stored.record, True
        if stored.record.spec != spec:
            raise JobConflict(f"job {spec.id!r} exists with another spec; submit it under a new id")
        return stored.record, False

    def update(
        self,
        job_id: str,
        change: Callable[[JobRecord], JobRecord | None],
        guards: Sequence[Guard] = (),
        also: Sequence[Put] = (),
    ) -> JobRecord:
        """Apply `change` (pure; None: leave the record as it is) with compare-and-swap,
        re-reading and re-applying when another writer got there first.

        `guards` and `also` make the change one transaction with other keys (a
        reservation's): when a guard fails, or names a lease that expired, nothing is
        written and the record is returned as it was."""
        stored = self.get(job_id)
        for _ in range(MAX_CAS_TRIES):
            new = change(stored.record)
            if new is None or new == stored.record:
                return stored.record
            raw = new.model_dump_json().encode()
            try:
                written, current, revision = self.etcd.replace(
                    self.key(job_id), raw, stored.mod_revision, guards=guards, also=also
                )
            except LeaseNotFound:  # a reserved agent died meanwhile
                return stored.record
            if written:
                self._offer(Stored(new, revision, stored.create_revision, raw))
                return new
            if current is None:
                raise JobNotFound(job_id)
            if current.mod_revision == stored.mod_revision:
                return stored.record  # the record is as read: a guard failed
            stored = _stored(current)
        raise RuntimeError(f"job {job_id}: {MAX_CAS_TRIES} writers raced for the record")

    def delete(self, stored: Stored) -> bool:
        """Delete the record if it is still as read; False when it changed meanwhile."""
        deleted, revision = self.etcd.delete_if(self.key(stored.record.id), stored.mod_revision)
        if deleted:
            self._forget(stored.record.id, revision)
        return deleted

    # -- reads ------------------------------------------------------------------

    def get(self, job_id: str) -> Stored:
        if self._mirror is not None:
            with self._lock:
                stored = self._mirror.get(job_id)
            if stored is not None:
                return stored
        kv = self.etcd.get(self.key(job_id))  # not mirrored (yet): ask etcd
        if kv is None:
            raise JobNotFound(job_id)
        stored = _stored(kv)
        self._offer(stored)
        return stored

    def cached(self, job_id: str) -> Stored | None:
        """The mirrored version, without asking etcd (None: not mirrored, or unknown)."""
        if self._mirror is None:
            return None
        with self._lock:
            return self._mirror.get(job_id)

    def scan(self) -> Iterator[Stored]:
        """Every job, in id order (from the mirror, or a page at a time from etcd)."""
        if self._mirror is not None:
            with self._lock:
                everything = sorted(self._mirror.items())
            yield from (stored for _, stored in everything)
            return
        after: str | None = None
        while True:
            kvs, more = self.etcd.page(self.prefix, after, 500)
            yield from (_stored(kv) for kv in kvs)
            if not more or not kvs:
                return
            after = kvs[-1].key

    def page(
        self, keep: Callable[[JobRecord], bool], limit: int, token: str | None
    ) -> tuple[list[JobRecord], str | None]:
        """Up to `limit` jobs that `keep` accepts, after the job id `token`, in id order;
        and the token of the next page (None: this is the last)."""
        found: list[JobRecord] = []
        for stored in self.scan():
            record = stored.record
            if token is not None and record.id <= token:
                continue
            if keep(record):
                if len(found) == limit:
                    return found, found[-1].id
                found.append(record)
        return found, None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    # -- the mirror -----------------------------------------------------------------

    def _start_mirror(self) -> None:
        self._mirror = {}
        kvs, revision = self.etcd.get_prefix(self.prefix)
        for kv in kvs:
            self._offer(_stored(kv))
        self._watch = self.etcd.watch(
            self.prefix, self._on_events, start_revision=revision + 1, prefix=True
        )

    def _on_events(self, events: list[WatchEvent]) -> None:
        for event in events:
            job_id = event.key[len(self.prefix) :]
            if event.kind == "delete":
                self._forget(job_id, event.revision)
            else:
                record = JobRecord.model_validate_json(event.value)
                self._offer(Stored(record, event.revision, event.create_revision, event.value))

    def _offer(self, stored: Stored) -> None:
        """Keep `stored` unless the mirror already has this job at a newer revision."""
        if self._mirror is None:
            return
        job_id = stored.record.id
        with self._lock:
            current = self._mirror.get(job_id)
            if stored.mod_revision <= self._deleted.get(job_id, 0):
                return
            if current is None or stored.mod_revision > current.mod_revision:
                self._mirror[job_id] = stored

    def _forget(self, job_id: str, revision: int) -> None:
        if self._mirror is None:
            return
        with self._lock:
            current = self._mirror.get(job_id)
            if current is not None and current.mod_revision < revision:
                del self._mirror[job_id]
            self._deleted[job_id] = max(revision, self._deleted.get(job_id, 0))


def _stored(kv: KeyValue) -> Stored:
    record = JobRecord.model_validate_json(kv.value)
    return Stored(record, kv.mod_revision, kv.create_revision, kv.value)
