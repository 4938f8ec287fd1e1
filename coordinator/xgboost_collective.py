"""XGBoost's collective for a `command` job's program: `with ctx.xgboost(): xgboost.train(...)`.

The same set-up as the built-in `xgboost` kind (`coordinator.jobs.boosting`), from
the program's side:

- Rank 0 runs XGBoost's tracker on the port its member reserved for the program
  (MASTER_ADDR:MASTER_PORT, the roster's `master`): bound to that address only,
  never all interfaces. Every rank reads the address from the roster file.
- A program barrier (`xgboost`) follows, so nobody dials the tracker before it
  listens, and a peer lost before the collective is named by `MemberLost`.
- Everyone joins with task id = its rank (zero-padded: the tracker sorts task ids
  as strings), so the collective's rank is the job's rank (checked).
- A lost peer breaks the collective on the others (its sockets close): they wait
  for etcd to name the lost member (its lease ends within a TTL) and raise
  `MemberLost`, XGBoost's message included. A collective that hangs instead
  (a peer stopped, not dead) is ended by the members: they stop every program
  once etcd names the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from coordinator.rendezvous.errors import MemberLost
from coordinator.rendezvous.member import Member

#: The program barrier every rank passes once the tracker listens.
BARRIER = "xgboost"
#: Longest wait for etcd to name a lost peer after the collective failed, beyond the
#: program's lease TTL (as the built-in kind waits).
LOSS_MARGIN = 2.0


@contextlib.contextmanager
def collective(
    member: Member,
    master: tuple[str, int],
    barrier: Callable[[str, float], None],
    timeout: int,
) -> Iterator[None]:
    """The body runs inside XGBoost's collective (see the module docstring): `member` is
    the program's side of its member, `master` the roster's (address, port), `barrier`
    the program's named barrier (name, timeout)."""
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1:
        raise ValueError(f"timeout must be a whole number of seconds >= 1, got {timeout!r}")
    try:
        import xgboost
        from xgboost import collective as xgb_collective
        from xgboost.tracker import RabitTracker
    except ImportError as exc:
        raise RuntimeError(f"ctx.xgboost() needs XGBoost: pip install xgboost ({exc})") from None

    (addr, port), rank, world_size = master, member.rank, member.world_size
    tracker = None
    if rank == 0:
        tracker = RabitTracker(
            n_workers=world_size,
            host_ip=addr,
            port=port,
            sortby="task",
            timeout=timeout,
        )
        tracker.start()
    try:
        barrier(BARRIER, float(timeout))
        args = {
            "dmlc_tracker_uri": addr,
            "dmlc_tracker_port": port,
            "dmlc_task_id": f"{rank:06d}",  # compared as strings: pad so rank order holds
            "dmlc_timeout": timeout,
            "dmlc_retry": 3,
        }
        try:
            with xgb_collective.CommunicatorContext(**args):
                given = (xgb_collective.get_rank(), xgb_collective.get_world_size())
                if given != (rank, world_size):
                    raise RuntimeError(
                        f"XGBoost gave rank {given[0]} of {given[1]} to job rank {rank} "
                        f"of {world_size}"
                    )
                yield
        except xgboost.core.XGBoostError as exc:
            _explain_failure(member, exc)
        if tracker is not None:
            tracker.wait_for(timeout)
    finally:
        if tracker is not None:
            # A tracker whose workers failed reports that again here: already said.
            with contextlib.suppress(xgboost.core.XGBoostError):
                tracker.free()


def _explain_failure(member: Member, error: Exception) -> None:
    """Name the peer whose loss broke the collective, if etcd does within a TTL + 2 s."""
    text = str(error).strip()
    message = text.splitlines()[0] if text else repr(error)
    lost = member.wait_for_loss(member.ttl + LOSS_MARGIN)
    if lost is not None:
        raise MemberLost(lost.rank, "xgboost", f"{lost.reason}; XGBoost: {message}") from error
    raise RuntimeError(f"XGBoost's collective failed: {message}") from error
