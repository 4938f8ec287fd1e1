"""The `mnist` job: parameter-server training of `MnistNet`, paced by the step barriers.

Ranks `0..ps-1` are parameter servers; the others are trainers. The model's
tensors are split across the servers whole, balanced by size.

- **Before joining**, every member checks the parameters and the data files
  (magic numbers, counts, that every trainer gets rows), and that PyTorch is
  installed: bad input exits 2 on every member with nothing written to etcd.
- **After `ip_exchange`** (`on_roster`) each server starts serving on its roster
  endpoint; server 0 loads the test set, each trainer only its own shard.
- **Training.** Everyone passes the `steps-start` barrier together. A trainer
  loops: wait for its turn (the method's rule, on etcd), pull the weights, take
  the next batch of its shard, compute the gradient, push it tagged with the
  version it came from, publish its clock. A straggler sleeps its compute time
  times `straggler_factor - 1` more. Server 0 evaluates the whole model on the
  test set every `eval_seconds` and writes `<job>/mnist/metrics/<n>`.
- **Loss.** A trainer that dies breaks its connections: the servers notice at
  once and, after etcd names it (within the lease TTL), fail with `MemberLost`,
  or with `on_loss=continue` go on without it. A server that dies breaks the
  trainers' connections: they fail with `MemberLost` naming it.
- **Results.** Rank 0 saves `<artifacts>/<job>/model.pt` (a state_dict of
  `MnistNet`) and `summary.json`; every server writes its staleness log
  `staleness-<server>.csv`. Servers checkpoint every `checkpoint_every`
  updates; `resume=true` continues from there.

Stop conditions (seed 000): `epochs` passes over each trainer's shard (default
5), `num_steps` steps per trainer, or `last_step`, an absolute clock; all count
from the job's start, so a resumed trainer does only what is left.

Modules: `options` (the parameters), `batches` (the data order, shared with the
simulator), `job` (a member's side), `trainer`, `server`, `evaluation` (server 0's
test scores), `results` (rank 0's files), `members` (what the job reads off its member).
"""

from coordinator.jobs.mnist.job import MnistJob
from coordinator.jobs.mnist.options import MnistOptions, parse

__all__ = ["MnistJob", "MnistOptions", "parse"]
