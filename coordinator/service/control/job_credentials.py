"""Each job's own etcd user, which may touch only `<ns>/jobs/<id>/`.

Made when an attempt starts, kept at `<ns>/api/credentials/<id>` (the
service's alone, so a new leader can finish a launch), and deleted with its role
when the job ends or is deleted. Against an etcd without auth, or when the
service's own user may not make users, members connect as the service does.
"""

from __future__ import annotations

import json
import logging

from coordinator.etcd.client import Etcd
from coordinator.etcd.users import (
    CannotManageUsers,
    Credentials,
    job_user,
    job_users,
    new_password,
    provision_job,
    revoke_job,
)
from coordinator.keys import Keys
from coordinator.service.store import InvalidRecord, JobNotFound, JobStore

log = logging.getLogger(__name__)


class JobCredentials:
    def __init__(self, etcd: Etcd, store: JobStore) -> None:
        self.etcd, self.store = etcd, store
        self.keys = Keys(etcd.namespace)
        self._per_job_users: bool | None = None  # None: not known yet

    def key(self, job_id: str) -> str:
        return self.keys.credential(job_id)

    def planned(self, job_id: str) -> Credentials | None:
        """The job's user with a new password (not made yet: `provision` does), or None
        when members must connect as the service does."""
        if self._per_job_users is None and not self.etcd.auth_enabled():
            self._per_job_users = False  # a plain etcd: nobody has credentials
        if self._per_job_users is False:
            return None
        return Credentials(job_user(self.etcd.namespace, job_id), new_password())

    def provision(self, job_id: str, credentials: Credentials) -> bool:
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

    def stored(self, job_id: str) -> Credentials | None:
        """The credentials the attempt started with (a predecessor's launch to finish)."""
        kv = self.etcd.get(self.key(job_id))
        if kv is None:
            return None
        try:
            stored = json.loads(kv.value)
            user, password = stored["user"], stored["password"]
            if not isinstance(user, str) or not isinstance(password, str):
                raise TypeError("user and password must be text")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("job %s: stored credentials unusable (%s): making new ones", job_id, exc)
            planned = self.planned(job_id)
            return planned if planned is not None and self.provision(job_id, planned) else None
        return Credentials(user, password)

    def revoke(self, job_id: str) -> None:
        """The job's stored credentials, then its etcd user and role, go (none there is
        fine). A leader that dies in between leaves a user `remove_stale` finds."""
        self.etcd.delete(self.key(job_id))
        if self._per_job_users is not False:
            try:
                revoke_job(self.etcd, job_id)
            except CannotManageUsers:
                self._per_job_users = False
            except ValueError:  # not a job id (a key that is no job's)
                pass

    def remove_stale(self) -> None:
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
            self.revoke(job_id)
