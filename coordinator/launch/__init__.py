"""How a member is started, in one place: the typed `coordinator worker` command
(`WorkerCommand`: argv for what is public, the environment for secrets and a
program's settings) and the local process launcher every local member runs under."""

from coordinator.launch.command import GPUS_ENV, WorkerCommand, parse_gpus

__all__ = ["GPUS_ENV", "WorkerCommand", "parse_gpus"]
