"""Members as containers, through the docker SDK (Docker, or podman's compatible API).

Each member is a container of the worker image named `<run_id>-a<attempt>-m<index>`,
running the image's entrypoint (`coordinator`) with `worker <args>`, on a
user-defined bridge network of its own (`--docker-network`, created and labelled
`etcd-coordinator.managed` when missing). The name makes `start` idempotent: a
container of that name is the member, whoever started it. Labels
(`etcd-coordinator.run`, `.attempt`, `.index`) find a submission's containers
again. On that network every container has an address of its own; the worker
advertises the address of the interface that routes to etcd (the default), which
is its address on that network, so members reach each other without port mappings.

A `command` job's members run in the job's `image` (default: the worker image), which
must be one the service allows (`serve --allowed-image`, see coordinator/service/images.py)
and must contain `coordinator` (build it FROM the worker image): `coordinator worker
--kind command ... -- PROGRAM` is the container's process, the job's `env` is in the
container's environment and its `working_dir` is the container's (inside the image).

etcd as containers see it: the service gives members its own endpoints
(`--etcd HOST:PORT`), but a container's 127.0.0.1 is not the host's. The launcher
replaces the value of `--etcd` in the worker arguments by `container_etcd`
(`coordinator serve --docker-etcd`, e.g. `etcd:2379` for an etcd container on the
same network), and refuses loopback endpoints: the service's embedded etcd
listens on loopback only, so docker jobs need an etcd of their own (`--etcd`).

Every member container runs with the least privilege compose gives its containers,
with limits on its processes and memory, and of the service's etcd settings only the
TLS files (`docker_container`). Its per-job etcd user (`Launch.credentials`) reaches
it as a password file the launcher writes for the submission (readable by uid 10001,
in a private folder), mounted read-only at `MEMBER_PASSWORD_FILE`. Only a job without
a user of its own (an etcd without auth, a service that may not make users) gets the
service's settings, as local members do.

Containers are kept after they exit: their exit code and output are what the
job record and `GET .../logs` read, for as long as the record lives. `remove(run_id)`
deletes a submission's containers when its record is deleted (`DELETE /v1/jobs/{id}`);
`docker ps -a --filter label=etcd-coordinator.run` lists what is left.

Engine errors while following (the engine restarting, a slow socket) never escape
`exit_code`, `output`, `terminate` or `kill`: the reconciler asks again on its next
tick. `start` raises, and the reconciler fails the attempt naming why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from docker.models.containers import Container

from coordinator.jobs.kinds import kind_of
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import (
    NOTHING,
    OUTPUT_CAP,
    VANISHED,
    Launch,
    OnDemandLauncher,
    Reservation,
    member_command,
)
from coordinator.service.launchers.docker_container import (
    DEFAULT_ARTIFACTS,
    DEFAULT_MEMORY,
    DEFAULT_PIDS_LIMIT,
    MEMBER_PASSWORD_FILE,
    MEMBER_UID,
    check_limits,
    container_endpoints,
    etcd_settings,
    member_hardening,
    program_settings,
)
from coordinator.service.model import JobSpec, Member

log = logging.getLogger(__name__)

LABEL_PREFIX = "etcd-coordinator"
RUN_LABEL = f"{LABEL_PREFIX}.run"
ATTEMPT_LABEL = f"{LABEL_PREFIX}.attempt"
INDEX_LABEL = f"{LABEL_PREFIX}.index"
MANAGED_LABEL = f"{LABEL_PREFIX}.managed"  # on the networks this launcher created
ENGINE_ERRORS = (DockerException, requests.RequestException)


class DockerLauncher(OnDemandLauncher):
    def __init__(
        self,
        image: str,
        network: str,
        base_url: str | None,
        container_etcd: str,
        api_timeout: int = 60,
        *,
        memory: str = DEFAULT_MEMORY,
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        artifacts: str = DEFAULT_ARTIFACTS,
        secrets_dir: Path | None = None,
        images: ImagePolicy | None = None,
    ) -> None:
        """`base_url` None: the engine from the environment (DOCKER_HOST, else the default
        socket). Nothing connects here: the service starts (and runs its local jobs) while
        the engine is away; a docker job then fails, naming why.

        `memory` and `pids_limit` bound each member container; `artifacts` is the volume
        (or absolute host path) at its /artifacts; `secrets_dir` holds the members'
        password files (a private temporary folder when None); `images`: those a
        `command` job may run in (None: only `image`)."""
        check_limits(memory, pids_limit)
        self.image, self.network_name, self.base_url = image, network, base_url
        self.images = images or ImagePolicy(image)
        self.container_etcd = container_endpoints(container_etcd, None)
        self.api_timeout = api_timeout  # seconds, per request to the engine
        self.hardening = member_hardening(memory, pids_limit, artifacts)
        self.secrets_dir = _private_dir(secrets_dir)
        self._own_secrets_dir = secrets_dir is None
        # One client per thread (the reconciler's, the API's workers): a client's HTTP
        # session is not meant to be shared across threads.
        self._local = threading.local()
        self._network_ready = False

    def client(self) -> docker.DockerClient:
        client = getattr(self._local, "client", None)
        if client is None:
            if self.base_url:
                client = docker.DockerClient(base_url=self.base_url, timeout=self.api_timeout)
            else:
                client = docker.from_env(timeout=self.api_timeout)
            self._local.client = client
        return client

    def ensure_network(self) -> None:
        """The network exists (created, labelled, if it did not); once per launcher."""
        if self._network_ready:
            return
        client = self.client()
        try:
            client.networks.get(self.network_name)
        except NotFound:
            try:
                client.networks.create(
                    self.network_name, driver="bridge", labels={MANAGED_LABEL: "true"}
                )
            except APIError as exc:
                if exc.status_code != 409:  # 409: another replica created it meanwhile
                    raise
        self._network_ready = True

    @staticmethod
    def name(run_id: str, attempt: int, index: int) -> str:
        return f"{run_id}-a{attempt}-m{index}"

    def reserve(self, launch: Launch) -> Reservation:
        return NOTHING  # the service's --max-workers is the limit

    def start(self, launch: Launch, index: int) -> Member:
        name = self.name(launch.run_id, launch.attempt, index)
        image = self.image_of(launch.spec)  # before the engine: a refused image starts nothing
        client = self.client()
        container = self._find(client, name)
        if container is None:
            self.ensure_network()
            try:
                container = self._run(client, name, launch, index, image)
            except APIError as exc:
                if exc.status_code != 409:  # 409: another replica's, just created
                    self._network_ready = False  # removed meanwhile? looked at again
                    raise
                container = self._find(client, name)
                if container is None:
                    raise
        elif container.status == "created":  # created by a launch that died before `start`
            container.start()
        assert container.id is not None
        return Member(index=index, container=container.id)

    def _run(
        self,
        client: docker.DockerClient,
        name: str,
        launch: Launch,
        index: int,
        image: str,
    ) -> Container:
        """Create and start the member (the image's entrypoint is `coordinator`)."""
        run_id, attempt = launch.run_id, launch.attempt
        settings = dict(self.hardening)
        environment, files = etcd_settings(own_user=launch.credentials is None)
        environment.update(self._credentials(launch, files))
        settings["volumes"] = {**settings["volumes"], **files}
        program = program_settings(launch.spec)
        return client.containers.run(
            image,
            ["worker", *launch.command.with_etcd(self.container_etcd).argv()],
            name=name,
            detach=True,
            network=self.network_name,
            labels={RUN_LABEL: run_id, ATTEMPT_LABEL: str(attempt), INDEX_LABEL: str(index)},
            # The root filesystem is read-only: no bytecode next to the packages.
            environment={
                **program.pop("environment", {}),
                "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
                **environment,
            },
            **program,
            **settings,
        )

    def image_of(self, spec: JobSpec) -> str:
        """The image of the job's members: a `command` job's own (or the default), if
        allowed (checked at submit; again here, as the record came from etcd: ValueError
        naming the image otherwise); the worker image for the other kinds."""
        if kind_of(spec.kind).takes_command:
            return self.images.check(spec.image)
        return self.image

    def _credentials(self, launch: Launch, files: dict[str, dict[str, str]]) -> dict[str, str]:
        """The member's per-job etcd user: its password written to a file of the
        submission's own, mounted read-only (added to `files`); the variables naming them.
        Nothing without credentials (an etcd without auth)."""
        if launch.credentials is None:
            return {}
        path = self.password_path(launch.run_id)
        _write_private(path, launch.credentials.password, MEMBER_UID)
        files[str(path)] = {"bind": MEMBER_PASSWORD_FILE, "mode": "ro"}
        # Only the etcd user's variables: the program's env and folder are the container's
        # own (see `program_settings`), so the member must not look for them on its host.
        in_container = launch.command.model_copy(update={"program_env": {}, "working_dir": None})
        return member_command(in_container, launch.credentials, MEMBER_PASSWORD_FILE).env()

    def password_path(self, run_id: str) -> Path:
        """Where the members of submission `run_id` get their etcd password from."""
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"run id {run_id!r} cannot name a folder")
        return self.secrets_dir / run_id / "etcd-password"

    def exit_code(self, member: Member) -> int | None:
        try:
            container = self._get(member)
        except NotFound:
            return VANISHED
        except ENGINE_ERRORS as exc:
            log.warning("container %s: %s", member.container, exc)
            return None  # unknown for now: asked again next tick
        state = container.attrs.get("State") or {}
        if state.get("Status") in ("exited", "dead"):
            return int(state.get("ExitCode", VANISHED))
        return None

    def terminate(self, member: Member) -> None:
        """SIGTERM only: `container.stop` would block the reconciler for the whole grace
        (the reconciler sends SIGKILL itself once the grace is over)."""
        self._signal(member, "SIGTERM")

    def kill(self, member: Member) -> None:
        self._signal(member, "SIGKILL")

    def output(self, member: Member, offset: int) -> bytes:
        """The engine keeps the output; it reads it whole (no byte offsets in its API)."""
        try:
            container = self._get(member)
            return container.logs(stdout=True, stderr=True)[offset : offset + OUTPUT_CAP]
        except ENGINE_ERRORS as exc:
            if not isinstance(exc, NotFound):
                log.warning("container %s: %s", member.container, exc)
            return b""

    def remove(self, run_id: str) -> int:
        """Remove every container of the submission `run_id` (running ones too); how many."""
        ours = {"label": f"{RUN_LABEL}={run_id}"}
        removed = 0
        for container in self.client().containers.list(all=True, filters=ours):
            try:
                container.remove(force=True, v=True)
                removed += 1
            except NotFound:
                pass  # removed meanwhile
        shutil.rmtree(self.password_path(run_id).parent, ignore_errors=True)
        return removed

    def close(self) -> None:
        """Remove the temporary folder of password files if no run holds one any more
        (a member still running keeps its file, and the folder with it)."""
        if self._own_secrets_dir:
            with contextlib.suppress(OSError):
                self.secrets_dir.rmdir()

    def _signal(self, member: Member, signal: str) -> None:
        try:
            container = self._get(member)
            if container.status in ("running", "paused"):
                container.kill(signal=signal)
            elif container.status == "created" and signal == "SIGKILL":
                container.remove(force=True)  # never ran, never will: gone is its end
        except NotFound:
            return
        except ENGINE_ERRORS as exc:  # it exited meanwhile, or the engine is away
            log.warning("container %s: %s %s", member.container, signal, exc)

    def _get(self, member: Member) -> Container:
        """The member's container, only if this launcher made it for that index: a record
        naming any other container (a forged id) finds nothing, so it is never signalled
        or read. Raises NotFound otherwise."""
        assert member.container is not None
        container = self.client().containers.get(member.container)
        labels = container.labels or {}
        if RUN_LABEL not in labels or labels.get(INDEX_LABEL) != str(member.index):
            raise NotFound(f"container {member.container} is not a member of ours")
        return container

    @staticmethod
    def _find(client: docker.DockerClient, name: str) -> Container | None:
        try:
            return client.containers.get(name)
        except NotFound:
            return None


def _private_dir(path: Path | None) -> Path:
    """`path` (made 0700 if missing), or a new private temporary folder."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="coordinator-docker-secrets-"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _write_private(path: Path, content: str, reader_uid: int) -> None:
    """Write `content` to `path` for uid `reader_uid` only: 0400 and owned by it where
    the service may change owners (root), else 0444 inside a 0700 folder of the
    service's (the container's only user can read it, nobody else on the host)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(content + "\n")
        if os.geteuid() == 0:
            os.chown(temporary, reader_uid, reader_uid)
            temporary.chmod(0o400)
        else:
            temporary.chmod(0o444)
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
