"""Job records in etcd: create once, change only by compare-and-swap, list in pages.

Each record is one key, `<ns>/api/jobs/<id>`, holding the `JobRecord` JSON.
The key's create revision is the job's place in the queue; its mod revision
is what a change must still find, so two replicas never both move a job.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coordinator.etcd.client import Etcd, KeyValue
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


class JobStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.prefix = etcd.key("api", "jobs") + "/"

    def key(self, job_id: str) -> str:
        return self.prefix + job_id

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
        if created:
            return record, True
        existing = JobRecord.model_validate_json(current.value)
        if existing.spec != spec:
            raise JobConflict(f"job {spec.id!r} exists with another spec; submit it under a new id")
        return existing, False

    def get(self, job_id: str) -> Stored:
        kv = self.etcd.get(self.key(job_id))
        if kv is None:
            raise JobNotFound(job_id)
        return _stored(kv)

    def update(self, job_id: str, change: Callable[[JobRecord], JobRecord | None]) -> JobRecord:
        """Apply `change` (pure; None: leave the record as it is) with compare-and-swap,
        re-reading and re-applying when another writer got there first."""
        stored = self.get(job_id)
        for _ in range(MAX_CAS_TRIES):
            new = change(stored.record)
            if new is None or new == stored.record:
                return stored.record
            written, current = self.etcd.replace(
                self.key(job_id), new.model_dump_json(), stored.mod_revision
            )
            if written:
                return new
            if current is None:
                raise JobNotFound(job_id)
            stored = _stored(current)
        raise RuntimeError(f"job {job_id}: {MAX_CAS_TRIES} writers raced for the record")

    def scan(self) -> Iterator[Stored]:
        """Every job, in id order, a page at a time."""
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
        after = self.key(token) if token else None
        while True:
            kvs, more = self.etcd.page(self.prefix, after, max(limit, 50))
            for kv in kvs:
                record = _stored(kv).record
                if keep(record):
                    found.append(record)
                    if len(found) == limit:
                        last_page = not more and kv is kvs[-1]
                        return found, None if last_page else record.id
            if not more or not kvs:
                return found, None
            after = kvs[-1].key

    def delete(self, stored: Stored) -> bool:
        """Delete the record if it is still as read; False when it changed meanwhile."""
        written, _ = self.etcd.replace(self.key(stored.record.id), b"", stored.mod_revision)
        if written:
            self.etcd.delete(self.key(stored.record.id))
        return written


def _stored(kv: KeyValue) -> Stored:
    return Stored(JobRecord.model_validate_json(kv.value), kv.mod_revision, kv.create_revision)
