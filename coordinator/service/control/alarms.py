"""The NOSPACE alarms the service disarms: those the database's size does not justify.

Any etcd user may raise an alarm (etcd checks no key permission on `Alarm`), and a
NOSPACE alarm makes every write of the deployment fail. etcd raises it itself only
when its database reaches the quota; one raised while the database holds less than
half the quota was raised by hand, and the service disarms it within
`CHECK_EVERY` seconds and logs it. A justified alarm is left alone (it needs a
compaction and a defrag, which are the operator's).
"""

from __future__ import annotations

import logging
import threading

from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError

log = logging.getLogger(__name__)

#: etcd's own default of `--quota-backend-bytes` (2 GiB), the embedded etcd's quota.
DEFAULT_QUOTA = 2 * 1024**3
CHECK_EVERY = 1.0


def unjustified(
    alarms: list[etcdrpc.AlarmMember], db_size: int, quota: int
) -> list[etcdrpc.AlarmMember]:
    """The NOSPACE alarms that a database of `db_size` bytes under `quota` does not
    justify (under half the quota)."""
    if db_size >= quota // 2:
        return []
    return [a for a in alarms if a.alarm == etcdrpc.AlarmType.Value("NOSPACE")]


class AlarmGuard:
    """A thread that looks at etcd's alarms every `every` seconds and disarms the
    NOSPACE ones the database's size does not justify."""

    def __init__(self, etcd: Etcd, quota: int = DEFAULT_QUOTA, every: float = CHECK_EVERY) -> None:
        self.etcd, self.quota, self.every = etcd, quota, every
        self.disarmed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="alarm-guard")

    def start(self) -> AlarmGuard:
        self._thread.start()
        return self

    def check(self) -> int:
        """Disarm what is unjustified now; how many alarms were disarmed."""
        get = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET)
        alarms = list(self.etcd.maintenance_api("Alarm", get).alarms)
        if not alarms:
            return 0
        status = self.etcd.maintenance_api("Status", etcdrpc.StatusRequest())
        disarmed = 0
        for alarm in unjustified(alarms, status.dbSize, self.quota):
            self.etcd.maintenance_api(
                "Alarm",
                etcdrpc.AlarmRequest(
                    action=etcdrpc.AlarmRequest.DEACTIVATE,
                    memberID=alarm.memberID,
                    alarm=alarm.alarm,
                ),
            )
            disarmed += 1
            log.warning(
                "disarmed a NOSPACE alarm on etcd member %x: the database holds %d bytes, "
                "under half its quota of %d (someone raised it by hand)",
                alarm.memberID,
                status.dbSize,
                self.quota,
            )
        self.disarmed += disarmed
        return disarmed

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.check()
            except EtcdError as exc:  # etcd away, or the alarm calls refused us: next time
                log.debug("alarm check: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.etcd.timeout + 1)
