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

etcd as containers see it: the service gives members its own endpoints
(`--etcd HOST:PORT`), but a container's 127.0.0.1 is not the host's. The launcher
replaces the value of `--etcd` in the worker arguments by `container_etcd`
(`coordinator serve --docker-etcd`, e.g. `etcd:2379` for an etcd container on the
same network), and refuses loopback endpoints: the service's embedded etcd
listens on loopback only, so docker jobs need an etcd of their own (`--etcd`).

Containers are kept after they exit: their exit code and output are what the
job record and `GET .../logs` read, for as long as the record lives. `remove(run_id)`
deletes a submission's containers when its record is deleted (`DELETE /v1/jobs/{id}`);
`docker ps -a --filter label=etcd-coordinator.run` lists what is left.

Engine errors while following (the engine restarting, a slow socket) never escape
`exit_code`, `output`, `terminate` or `kill`: the reconciler asks again on its next
tick. `start` raises, and the reconciler fails the attempt naming why.
"""

from __future__ import annotations

import logging
import threading

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from docker.models.containers import Container

from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.rendezvous.address import endpoint_host, is_loopback
from coordinator.service.launchers import NOTHING, VANISHED, Launch, Reservation, with_etcd
from coordinator.service.model import Member

log = logging.getLogger(__name__)

LABEL_PREFIX = "etcd-coordinator"
RUN_LABEL = f"{LABEL_PREFIX}.run"
ATTEMPT_LABEL = f"{LABEL_PREFIX}.attempt"
INDEX_LABEL = f"{LABEL_PREFIX}.index"
MANAGED_LABEL = f"{LABEL_PREFIX}.managed"  # on the networks this launcher created
ENGINE_ERRORS = (DockerException, requests.RequestException)


def container_endpoints(service_etcd: str, seen_from_containers: str | None) -> str:
    """The etcd endpoints to give containers: `seen_from_containers` if given, else the
    service's own, which must then not be loopback (a container's loopback is its own)."""
    if seen_from_containers:
        return seen_from_containers
    loopback = [e for e in service_etcd.split(",") if e.strip() and is_loopback(endpoint_host(e))]
    if loopback:
        raise ValueError(
            f"etcd at {', '.join(loopback)} is loopback, which containers cannot reach: "
            "give --etcd at an address they reach, or --docker-etcd HOST:PORT as they see it"
        )
    return service_etcd


class DockerLauncher:
    def __init__(
        self,
        image: str,
        network: str,
        base_url: str | None,
        container_etcd: str,
        api_timeout: int = 60,
    ) -> None:
        """`base_url` None: the engine from the environment (DOCKER_HOST, else the default
        socket). Nothing connects here: the service starts (and runs its local jobs) while
        the engine is away; a docker job then fails, naming why."""
        self.image, self.network_name, self.base_url = image, network, base_url
        self.container_etcd = container_endpoints(container_etcd, None)
        self.api_timeout = api_timeout  # seconds, per request to the engine
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
        client = self.client()
        container = self._find(client, name)
        if container is None:
            self.ensure_network()
            try:
                container = self._run(client, name, launch, index)
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
    ) -> Container:
        """Create and start the member (the image's entrypoint is `coordinator`)."""
        run_id, attempt = launch.run_id, launch.attempt
        environment, files = _etcd_security()
        return client.containers.run(
            self.image,
            ["worker", *with_etcd(launch.worker_args, self.container_etcd)],
            name=name,
            detach=True,
            network=self.network_name,
            labels={RUN_LABEL: run_id, ATTEMPT_LABEL: str(attempt), INDEX_LABEL: str(index)},
            environment={"PYTHONUNBUFFERED": "1", **environment},
            volumes=files,
        )

    def exit_code(self, member: Member) -> int | None:
        try:
            container = self.client().containers.get(self._id(member))
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
            container = self.client().containers.get(self._id(member))
            return container.logs(stdout=True, stderr=True)[offset:]
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
        return removed

    def _signal(self, member: Member, signal: str) -> None:
        try:
            container = self.client().containers.get(self._id(member))
            if container.status in ("running", "paused"):
                container.kill(signal=signal)
            elif container.status == "created" and signal == "SIGKILL":
                container.remove(force=True)  # never ran, never will: gone is its end
        except NotFound:
            return
        except ENGINE_ERRORS as exc:  # it exited meanwhile, or the engine is away
            log.warning("container %s: %s %s", member.container, signal, exc)

    @staticmethod
    def _id(member: Member) -> str:
        assert member.container is not None
        return member.container

    @staticmethod
    def _find(client: docker.DockerClient, name: str) -> Container | None:
        try:
            return client.containers.get(name)
        except NotFound:
            return None


def _etcd_security() -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The service's etcd TLS and auth settings for a member container: the variables,
    and each file mounted read-only at the same path (uid 10001 must be able to read it)."""
    security = EtcdSecurity.from_env()
    environment: dict[str, str] = {}
    files: dict[str, dict[str, str]] = {}
    for name, variable in ENV.items():
        value = getattr(security, name)
        if value:
            environment[variable] = value
            if name != "user":
                files[value] = {"bind": value, "mode": "ro"}
    return environment, files
