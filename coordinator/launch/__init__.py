"""How a member is started, in one place: the typed `coordinator worker` command
(`WorkerCommand`: argv for what is public, the environment for secrets, a program's
settings and GPUs), and `local.start_process`, which every local member process
(`run`'s, the service's, an agent's) is started by; `piped.PipedLauncher` is `coordinator
run`'s, which reads its members' events and output through pipes."""

from coordinator.launch.command import GPUS_ENV, WorkerCommand, parse_gpus

__all__ = ["GPUS_ENV", "WorkerCommand", "parse_gpus"]
