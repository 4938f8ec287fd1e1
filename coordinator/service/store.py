"""Job records in etcd: create once, change only by compare-and-swap, list in pages.

Each record is one key, `<ns>/api/jobs/<id>`, holding the `JobRecord` JSON.
The key's create revision is the job's place in the queue; its mod revision
is what a change must still find, so two replicas never both move a job. Deleting a
record also deletes what its job's members left under `<ns>/jobs/<id>/`.

Nothing read from etcd is trusted: every record must carry the service's
signature (`coordinator.signing`, over every other field: a record written to etcd
by anyone else, or changed since, is refused as `signature: ...`), and is
validated (strictly, with the API's own models, and its id must be its key's)
before anything uses it. Every write re-signs the whole record. A
record that fails is logged once per revision, naming its key and the first
error, and left alone: listings and the leader's scans skip it, and reading or
changing that job raises `InvalidRecord`, which the API answers with a 409.

With `mirror=True` the store also keeps every record in memory, current within
one watch notification and never older than this replica's own writes (a
version is replaced only by a newer revision). Reads, lists and the leader's
scans then cost no request to etcd; writes still go to etcd, compared against
the revision they were based on, so a stale mirror can delay a change but
never let a wrong one through.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import LeaseNotFound
from coordinator.etcd.txn import Guard, KeyValue, Put
from coordinator.etcd.watch import Watch, WatchEvent
from coordinator.keys import Keys
from coordinator.service.model import Condition, JobRecord, JobSpec, JobState
from coordinator.signing import (
    JOB,
    SIGNATURE,
    SignatureError,
    Signer,
    canonical,
    loads_object,
    split,
    verify,
)

log = logging.getLogger(__name__)
MAX_CAS_TRIES = 50


class JobNotFound(LookupError):
    pass


class JobConflict(ValueError):
    """The id is taken by a job with another spec."""


class InvalidRecord(ValueError):
    """The record stored for a job fails validation: nothing acts on it."""

    def __init__(self, job_id: str, cause: str) -> None:
        super().__init__(f"the stored record of job {job_id!r} is invalid: {cause}")
        self.job_id = job_id
        self.cause = cause


class InvalidChange(ValueError):
    """A change would store a record that fails validation: nothing was written."""


@dataclass(frozen=True)
class Stored:
    record: JobRecord
    mod_revision: int
    create_revision: int  # arrival order
    raw: bytes  # the record's JSON as stored (served as it is)


@dataclass(frozen=True)
class Rejected:
    """A stored version that failed validation (kept so the mirror's order holds)."""

    error: InvalidRecord
    mod_revision: int


def parse_record(job_id: str, raw: bytes, key: Ed25519PublicKey) -> JobRecord:
    """The record stored at job `job_id`'s key, signed by the service's `key` and
    validated as the API validates; raises `InvalidRecord` naming the first error."""
    try:
        document = loads_object(raw)
        verify(key, JOB, *split(document))
    except SignatureError as exc:
        raise InvalidRecord(job_id, f"signature: {exc}") from None
    return validate_record(job_id, canonical(document))  # exactly what was verified


def validate_record(job_id: str, raw: bytes | str) -> JobRecord:
    """`raw` validated as a record of job `job_id` (its signature is not checked)."""
    try:
        record = JobRecord.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise InvalidRecord(job_id, first_error(exc)) from None
    if record.id != job_id:
        raise InvalidRecord(job_id, f"id: {record.id!r} is stored under another job's key")
    return record


def first_error(exc: ValidationError) -> str:
    """`field.path: message` of the first error, short enough for a log line."""
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    text = f"{where}: {message}" if where else message
    return text if len(text) <= 300 else text[:297] + "..."


class JobStore:
    def __init__(self, etcd: Etcd, signer: Signer, mirror: bool = False) -> None:
        self.etcd = etcd
        self.signer = signer  # signs every record written, verifies every one read
        self.keys = Keys(etcd.namespace)
        self._mirror: dict[str, Stored | Rejected] | None = None
        self._deleted: dict[str, int] = {}  # id -> revision of its deletion (mirror only)
        self._reported: dict[str, int] = {}  # id -> the invalid revision last logged
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        if mirror:
            self._start_mirror()

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
        _, raw = self._signed(record)
        created, current, _ = self.etcd.create(self.keys.record(spec.id), raw)
        stored = self._checked(spec.id, current)
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
        written and the record is returned as it was. The new record is validated
        before it is written (`InvalidChange`: nothing was); a stored record that fails
        validation raises `InvalidRecord` and is never changed."""
        stored = self.get(job_id)
        for _ in range(MAX_CAS_TRIES):
            new = change(stored.record)
            if new is None or new == stored.record:
                return stored.record
            try:  # as any reader will see it
                new = validate_record(job_id, new.model_dump_json(exclude={SIGNATURE}))
            except InvalidRecord as exc:
                raise InvalidChange(f"job {job_id}: not written, {exc.cause}") from None
            new, raw = self._signed(new)
            try:
                written, current, revision = self.etcd.replace(
                    self.keys.record(job_id), raw, stored.mod_revision, when=guards, also=also
                )
            except LeaseNotFound:  # a reserved agent died meanwhile
                return stored.record
            if written:
                self._offer(job_id, Stored(new, revision, stored.create_revision, raw))
                return new
            if current is None:
                raise JobNotFound(job_id)
            if current.mod_revision == stored.mod_revision:
                return stored.record  # the record is as read: a guard failed
            stored = self._checked(job_id, current)
        raise RuntimeError(f"job {job_id}: {MAX_CAS_TRIES} writers raced for the record")

    def delete(self, stored: Stored) -> bool:
        """Delete the record if it is still as read, then every key the job's members left
        (`<ns>/jobs/<id>/`); False when the record changed meanwhile (nothing is deleted)."""
        job_id = stored.record.id
        deleted, revision = self.etcd.delete_if(self.keys.record(job_id), stored.mod_revision)
        if deleted:
            self._forget(job_id, revision)
            self.etcd.delete_prefix(self.keys.job(job_id).job)
        return deleted

    # -- reads ------------------------------------------------------------------

    def get(self, job_id: str) -> Stored:
        """The job's record; `JobNotFound`, or `InvalidRecord` for one that fails validation."""
        if self._mirror is not None:
            with self._lock:
                entry = self._mirror.get(job_id)
            if isinstance(entry, Rejected):
                raise entry.error
            if entry is not None:
                return entry
        kv = self.etcd.get(self.keys.record(job_id))  # not mirrored (yet): ask etcd
        if kv is None:
            raise JobNotFound(job_id)
        return self._checked(job_id, kv)

    def cached(self, job_id: str) -> Stored | None:
        """The mirrored version, without asking etcd (None: not mirrored, unknown, or
        invalid)."""
        if self._mirror is None:
            return None
        with self._lock:
            entry = self._mirror.get(job_id)
        return entry if isinstance(entry, Stored) else None

    def scan(self) -> Iterator[Stored]:
        """Every job whose record is valid, in id order (from the mirror, or a page at a
        time from etcd)."""
        if self._mirror is not None:
            with self._lock:
                everything = sorted(self._mirror.items())
            yield from (entry for _, entry in everything if isinstance(entry, Stored))
            return
        after: str | None = None
        while True:
            kvs, more = self.etcd.page(self.keys.records, after, 500)
            for kv in kvs:
                try:
                    yield self._checked(self.keys.record_id(kv.key), kv)
                except InvalidRecord:
                    continue  # logged; left alone
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

    # -- signatures and validation ----------------------------------------------------

    def _signed(self, record: JobRecord) -> tuple[JobRecord, bytes]:
        """`record` with the service's signature over every other field, and the bytes
        to store."""
        payload = json.loads(record.model_dump_json(exclude={SIGNATURE}))
        signature = self.signer.sign(JOB, payload)
        raw = canonical({**payload, SIGNATURE: signature})
        return record.model_copy(update={SIGNATURE: signature}), raw

    def parse(self, job_id: str, raw: bytes) -> JobRecord:
        """A version of job `job_id`'s record read from etcd (`InvalidRecord` unless it
        is signed and valid)."""
        return parse_record(job_id, raw, self.signer.public)

    def _checked(self, job_id: str, kv: KeyValue) -> Stored:
        """`kv` as a validated record (offered to the mirror either way); raises
        `InvalidRecord`, logged once per revision."""
        return self._accept(job_id, kv.value, kv.mod_revision, kv.create_revision)

    def _accept(self, job_id: str, raw: bytes, revision: int, created: int) -> Stored:
        try:
            stored = Stored(self.parse(job_id, raw), revision, created, raw)
        except InvalidRecord as exc:
            self._report(exc, revision)
            self._offer(job_id, Rejected(exc, revision))
            raise
        self._offer(job_id, stored)
        return stored

    def _report(self, error: InvalidRecord, revision: int) -> None:
        with self._lock:
            if self._reported.get(error.job_id) == revision:
                return
            self._reported[error.job_id] = revision
        log.warning(
            "ignoring %r (revision %d): %s", self.keys.record(error.job_id), revision, error.cause
        )

    # -- the mirror -----------------------------------------------------------------

    def _start_mirror(self) -> None:
        self._mirror = {}
        kvs, revision = self.etcd.get_prefix(self.keys.records)
        for kv in kvs:
            job_id = self.keys.record_id(kv.key)
            self._offer_quietly(job_id, kv.value, kv.mod_revision, kv.create_revision)
        self._watch = self.etcd.watch(
            self.keys.records, self._on_events, start_revision=revision + 1, prefix=True
        )

    def _on_events(self, events: list[WatchEvent]) -> None:
        for event in events:
            job_id = self.keys.record_id(event.key)
            if event.kind == "delete":
                self._forget(job_id, event.revision)
            else:
                self._offer_quietly(job_id, event.value, event.revision, event.create_revision)

    def _offer_quietly(self, job_id: str, raw: bytes, revision: int, created: int) -> None:
        """Mirror a version read from etcd, valid or not (an invalid one is logged). One
        the mirror has already (this replica's own write, at the revision etcd gave it)
        is not verified and validated again."""
        assert self._mirror is not None
        with self._lock:
            current = self._mirror.get(job_id)
        if current is not None and current.mod_revision >= revision:
            return
        with contextlib.suppress(InvalidRecord):
            self._accept(job_id, raw, revision, created)

    def _offer(self, job_id: str, entry: Stored | Rejected) -> None:
        """Keep `entry` unless the mirror already has this job at a newer revision."""
        if self._mirror is None:
            return
        with self._lock:
            current = self._mirror.get(job_id)
            if entry.mod_revision <= self._deleted.get(job_id, 0):
                return
            if current is None or entry.mod_revision > current.mod_revision:
                self._mirror[job_id] = entry

    def _forget(self, job_id: str, revision: int) -> None:
        with self._lock:
            self._reported.pop(job_id, None)
        if self._mirror is None:
            return
        with self._lock:
            current = self._mirror.get(job_id)
            if current is not None and current.mod_revision < revision:
                del self._mirror[job_id]
            self._deleted[job_id] = max(revision, self._deleted.get(job_id, 0))
