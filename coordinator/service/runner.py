"""One replica of the service: the API, and the reconciler when it leads.

`coordinator serve` builds this and runs it under uvicorn. Stopping it stops
the reconciler and gives up leadership at once (another replica takes over);
members keep running, to be adopted by whichever replica leads next.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

from fastapi import FastAPI

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import EtcdSecurity
from coordinator.jobs.threads import host_cores
from coordinator.launch.pids import DEFAULT_PIDS_LIMIT
from coordinator.service.admission import Roots
from coordinator.service.control.alarms import AlarmGuard
from coordinator.service.control.leadership import Leadership
from coordinator.service.control.reconciler import Reconciler, ReconcilerSettings
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import LauncherUnavailable, WorkerLauncher
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import Launcher
from coordinator.service.placement.agents_launcher import AgentsLauncher
from coordinator.service.placement.ahead import PLACEMENT_GRACE
from coordinator.service.placement.chunks import DEFAULT_MAX_TXN_OPS
from coordinator.service.rest.api import create_app
from coordinator.service.rest.auth import Tokens
from coordinator.service.rest.context import ApiContext
from coordinator.service.rest.metrics import ServiceMetrics
from coordinator.service.store import JobStore
from coordinator.signing import Signer, data_dir_key, load_private_key


def service_signer(options: ServiceOptions) -> Signer:
    """The service's signing key: `--signing-key`, else the data dir's own."""
    if options.signing_key is not None:
        return Signer(load_private_key(options.signing_key))
    return Signer(data_dir_key(options.data_dir))


@dataclass(frozen=True)
class ServiceOptions:
    etcd: str  # endpoints, for the service and its members
    namespace: str
    data_dir: Path  # member logs and default artifacts
    max_workers: int
    gpus: tuple[int, ...] = ()  # what local members may get (`serve --gpus`)
    max_threads: int | None = None  # a job's thread counts, per member (None: host cores)
    member_pids_limit: int = DEFAULT_PIDS_LIMIT  # processes and threads of a local member
    run_as: range | None = None  # the uids local members' programs run under (`--run-as-uids`)
    grace: float = 10.0
    events_ping: float = 15.0  # seconds between keep-alives of a quiet events stream
    member_ttl: int = 10
    member_connect_timeout: float = 10.0
    leader_ttl: int = 5
    tokens: Tokens | None = None
    default_launcher: Launcher = Launcher.LOCAL
    # The agents launcher: the most operations of one etcd transaction (a bigger
    # placement is written in chunks), and how long one written ahead may wait for its
    # commit before the leader removes it.
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS
    placement_grace: float = PLACEMENT_GRACE
    # The docker launcher, enabled by an image: its network, the engine's API (None:
    # DOCKER_HOST or the default socket) and etcd as containers see it (None: `etcd`).
    docker_image: str | None = None
    docker_network: str = "coordinator"
    docker_host: str | None = None
    docker_etcd: str | None = None
    # Each member container's limits, and the volume at its /artifacts.
    docker_memory: str = "2g"
    docker_pids_limit: int = 1024
    docker_artifacts: str = "etcd-coordinator-artifacts"
    # The images a `command` job may run in (patterns; empty: only the launcher's own image).
    allowed_images: tuple[str, ...] = ()
    # The kubernetes launcher, enabled by an image: its namespace (None: the pod's own,
    # else the kubeconfig's) and etcd as pods see it (None: --etcd).
    k8s_image: str | None = None
    k8s_namespace: str | None = None
    k8s_etcd: str | None = None
    # The key job records and assignments are signed with (None: DATA_DIR/signing-key,
    # made on the first start).
    signing_key: Path | None = None
    # TLS and auth of the service's etcd client (None: the COORDINATOR_ETCD_* variables).
    # Local members inherit them from the environment (`serve` exports them there).
    security: EtcdSecurity | None = None
    # Where submitted paths may point (None: the roots `serve` exported for the members).
    roots: Roots | None = None


class Service:
    def __init__(self, options: ServiceOptions) -> None:
        self.options = options
        os.environ.setdefault("COORDINATOR_ARTIFACTS", str(options.data_dir / "artifacts"))
        roots = options.roots or Roots.from_environment()
        self.etcd = Etcd(options.etcd, namespace=options.namespace, security=options.security)
        self.signer = service_signer(options)
        self.store = JobStore(self.etcd, self.signer, mirror=True)
        self.launchers: dict[Launcher, WorkerLauncher] = {
            Launcher.LOCAL: LocalLauncher(
                options.data_dir / "logs",
                # A program without a working_dir runs in the root of working_dirs.
                workdir=work if (work := roots.working_dir).is_dir() else None,
                gpus=options.gpus,
                run_as=options.run_as,
                pids_limit=options.member_pids_limit,
            ),
            Launcher.AGENTS: AgentsLauncher(
                self.etcd,
                self.signer,
                max_txn_ops=options.max_txn_ops,
                placement_grace=options.placement_grace,
            ),
        }
        images: dict[Launcher, ImagePolicy] = {}
        if options.docker_image:
            from coordinator.service.launchers.docker import DockerLauncher

            images[Launcher.DOCKER] = ImagePolicy.of(options.docker_image, options.allowed_images)
            self.launchers[Launcher.DOCKER] = DockerLauncher(
                options.docker_image,
                options.docker_network,
                options.docker_host,
                options.docker_etcd or options.etcd,
                memory=options.docker_memory,
                pids_limit=options.docker_pids_limit,
                artifacts=options.docker_artifacts,
                secrets_dir=options.data_dir / "docker-secrets",  # the members' passwords
                images=images[Launcher.DOCKER],
            )
        if options.k8s_image:
            from coordinator.service.launchers.kubernetes import KubernetesLauncher
            from coordinator.service.launchers.kubernetes_api import current_namespace

            images[Launcher.KUBERNETES] = ImagePolicy.of(options.k8s_image, options.allowed_images)
            try:
                self.launchers[Launcher.KUBERNETES] = KubernetesLauncher(
                    options.k8s_image,
                    options.k8s_namespace or current_namespace(),
                    options.k8s_etcd or options.etcd,
                    grace_seconds=round(options.grace),
                    images=images[Launcher.KUBERNETES],
                )
            except (ValueError, RuntimeError) as exc:  # a loopback etcd, no cluster config
                raise LauncherUnavailable(f"the kubernetes launcher: {exc}") from None
        replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.leadership = Leadership(self.etcd, replica, options.leader_ttl)
        # The reconciler acts on the options of the same names (tick and the rest: its own).
        shared = {f.name for f in fields(ReconcilerSettings)} & {f.name for f in fields(options)}
        settings = ReconcilerSettings(**{name: getattr(options, name) for name in shared})
        self.reconciler = Reconciler(
            self.etcd, self.store, self.launchers, settings, self.leadership
        )
        metrics = ServiceMetrics(
            self.store, lambda: (self.reconciler.launched, self.reconciler.restarts)
        )
        context = ApiContext(
            etcd=self.etcd,
            store=self.store,
            launchers=self.launchers,
            max_workers=options.max_workers,
            metrics=metrics,
            local_gpus=options.gpus,
            tokens=options.tokens,
            default_launcher=options.default_launcher,
            roots=roots,
            images=images,
            max_threads=options.max_threads or host_cores(),
            events_ping=options.events_ping,
        )
        self.app: FastAPI = create_app(context)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.reconciler.run, args=(self._stop,), daemon=True, name="reconciler"
        )

    def start(self) -> None:
        self._thread.start()
        self.alarms = AlarmGuard(self.etcd).start()  # NOSPACE alarms nobody needed

    def idle(self) -> bool:
        """No job is live (nothing would miss etcd if it stopped)."""
        return all(stored.record.state.terminal for stored in self.store.scan())

    def stop(self) -> None:
        self._stop.set()
        if (alarms := getattr(self, "alarms", None)) is not None:
            alarms.close()
        self._thread.join(10)
        self.reconciler.close()
        self.leadership.close()
        for launcher in self.launchers.values():
            launcher.close()  # the kubernetes launcher's pod watch, docker's client
        self.store.close()
        self.etcd.close()
