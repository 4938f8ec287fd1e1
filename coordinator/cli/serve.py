"""`coordinator serve`: the REST service (API, and the reconciler when this replica leads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from coordinator.cli.etcd_options import (
    DEFAULT_ETCD,
    EtcdOption,
    checked_security,
    with_etcd_security,
)
from coordinator.cli.options import (
    MaxThreadsOption,
    MemberPidsLimitOption,
    NamespaceOption,
    RunAsOption,
    console,
    run_as_range,
    unset_option,
)
from coordinator.etcd.security import EtcdSecurity
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE
from coordinator.jobs.threads import MAX_THREADS_ENV, host_cores
from coordinator.launch import parse_gpus
from coordinator.launch.pids import DEFAULT_PIDS_LIMIT
from coordinator.rendezvous.address import is_loopback
from coordinator.service.model import Launcher
from coordinator.service.placement.chunks import DEFAULT_MAX_TXN_OPS, MIN_TXN_OPS

if TYPE_CHECKING:  # imported when a command runs: the CLI starts without them
    from coordinator.service.admission import Roots
    from coordinator.service.rest.auth import Tokens
    from coordinator.service.runner import ServiceOptions


# The types of serve's options that share a wording: the folders submitted paths must be
# in, and the container launchers' images and etcd endpoints.
def root_option(envvar: str, paths: str, default: str) -> Any:
    """The type of an option naming the folder that submitted `paths` must be in (left
    out: DATA_DIR/`default`)."""
    return unset_option(Path, envvar, f"the folder {paths} must be in [DATA_DIR/{default}]")


DataRootOption = root_option("COORDINATOR_DATA_ROOT", "jobs' data and eval_data paths", "data")
ArtifactsRootOption = root_option("COORDINATOR_ARTIFACTS_ROOT", "jobs' artifacts", "artifacts")
WorkingDirRootOption = root_option(
    "COORDINATOR_WORKING_DIR_ROOT", "command jobs' working_dir", "work"
)


def image_option(launcher: str) -> Any:
    """The type of an option naming the worker image that turns `launcher` on (left out:
    it is off)."""
    return Annotated[str | None, typer.Option(help=f"worker image: enables the {launcher}")]


def reached_etcd_option(members: str) -> Any:
    """The type of an option giving the etcd endpoints as `members` reach them, for when
    --etcd's are not theirs (e.g. this host's loopback)."""
    wording = f"etcd endpoints HOST:PORT[,...] as {members} reach them [--etcd]"
    return Annotated[str | None, typer.Option(help=wording)]


DockerImageOption = image_option("docker launcher (containers)")
DockerHostOption = unset_option(
    str, "DOCKER_HOST", "the engine's API, e.g. unix:///run/podman.sock"
)
DockerEtcdOption = reached_etcd_option("containers")
K8sImageOption = image_option("kubernetes launcher (an Indexed Job)")
K8sEtcdOption = reached_etcd_option("pods")


@with_etcd_security
def serve(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    host: Annotated[str, typer.Option(envvar="COORDINATOR_HOST", help="address to listen on")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(envvar="COORDINATOR_PORT", min=0, max=65535)] = 8080,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
    data_dir: Annotated[
        Path,
        typer.Option(
            envvar="COORDINATOR_DATA",
            help="member logs, default artifacts, and the embedded etcd's data",
        ),
    ] = Path("coordinator-data"),
    data_root: DataRootOption = None,
    artifacts_root: ArtifactsRootOption = None,
    working_dir_root: WorkingDirRootOption = None,
    max_workers: Annotated[
        int, typer.Option(min=1, help="worker slots: jobs queue until theirs are free")
    ] = max(2, 2 * (os.cpu_count() or 1)),
    gpus: Annotated[
        str,
        typer.Option(
            help="GPU ids local members may get (gpus_per_worker), e.g. 0,1 [none]",
            show_default=False,
        ),
    ] = "",
    max_threads: MaxThreadsOption = None,
    member_pids_limit: MemberPidsLimitOption = DEFAULT_PIDS_LIMIT,
    run_as: RunAsOption = None,
    grace: Annotated[float, typer.Option(min=0, help="seconds from SIGTERM to SIGKILL")] = 10.0,
    events_ping: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="seconds between keep-alives on a quiet events stream (below the idle "
            "timeout of any proxy in front of the service)",
        ),
    ] = 15.0,
    member_ttl: Annotated[int, typer.Option(min=2, help="lease TTL of the members")] = 10,
    member_connect_timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="seconds a member waits for etcd, at its start and on each request "
            "(raise it on hosts that start many members at once)",
        ),
    ] = 10.0,
    token_file: Annotated[
        Path | None,
        typer.Option(
            envvar="COORDINATOR_TOKEN_FILE",
            help="lines of '<read|submit|exec> <token>', mode 0600, owned by this user or root "
            "(exec needs it) [made: DATA_DIR/api-token, one submit token]",
        ),
    ] = None,
    signing_key: Annotated[
        Path | None,
        typer.Option(
            envvar="COORDINATOR_SIGNING_KEY",
            help="Ed25519 private key (PEM, mode 0600) that signs job records and agents' "
            "assignments; agents verify with its public half [made: DATA_DIR/signing-key "
            "and DATA_DIR/signing-key.pub]",
            show_default=False,
        ),
    ] = None,
    insecure: Annotated[
        bool, typer.Option(help="serve without tokens at all (anyone who reaches it may submit)")
    ] = False,
    default_launcher: Annotated[
        Launcher,
        typer.Option(envvar="COORDINATOR_DEFAULT_LAUNCHER", help="for jobs that name none"),
    ] = Launcher.LOCAL,
    max_txn_ops: Annotated[
        int,
        typer.Option(
            min=MIN_TXN_OPS,
            help="operations of one etcd transaction the service makes, below etcd's "
            "--max-txn-ops (128); a bigger placement on agents is written in chunks",
        ),
    ] = DEFAULT_MAX_TXN_OPS,
    docker_image: DockerImageOption = None,
    docker_network: Annotated[
        str, typer.Option(help="the containers' bridge network (created when missing)")
    ] = "coordinator",
    docker_host: DockerHostOption = None,
    docker_etcd: DockerEtcdOption = None,
    docker_memory: Annotated[
        str, typer.Option(help="memory limit of each member container (e.g. 2g, 512m)")
    ] = "2g",
    docker_pids_limit: Annotated[
        int, typer.Option(min=1, help="processes and threads of each member container")
    ] = 1024,
    docker_artifacts: Annotated[
        str, typer.Option(help="volume (or absolute host path) at the members' /artifacts")
    ] = "etcd-coordinator-artifacts",
    allowed_image: Annotated[
        list[str] | None,
        typer.Option(
            help="an image a `command` job may run in (docker, kubernetes): a name, or a glob "
            "such as trainer:* (repeatable) [only --docker-image]"
        ),
    ] = None,
    k8s_image: K8sImageOption = None,
    k8s_namespace: Annotated[
        str | None,
        typer.Option(help="Kubernetes namespace of the Jobs [the pod's own, or kubeconfig's]"),
    ] = None,
    k8s_etcd: K8sEtcdOption = None,
) -> None:
    """Serve the REST API (OpenAPI at /docs); without --etcd, an etcd of its own in DATA_DIR."""
    from coordinator.service.runner import ServiceOptions

    # Without --etcd, the service is root of its own etcd, with its own settings (auth and
    # a client certificate); members get users of their own.
    security = checked_security(etcd, etcd_settings) if etcd else EtcdSecurity()
    tokens = checked_tokens(token_file, insecure, host, data_dir)
    check_signing_key(signing_key)
    check_container_options(
        etcd, docker_image, docker_memory, docker_pids_limit, docker_etcd, allowed_image, k8s_image
    )
    try:
        gpu_ids = parse_gpus(gpus)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpus") from None
    run_as_uids = run_as_range(run_as)
    data_dir = data_dir.absolute()
    roots = made_roots(data_dir, data_root, artifacts_root, working_dir_root)
    max_threads = max_threads or host_cores()
    export_for_members(roots, max_threads)
    # By concern: etcd; the local members; the API and placing; the container launchers.
    options = ServiceOptions(
        etcd=etcd or "", namespace=namespace, security=security,
        data_dir=data_dir, max_workers=max_workers, gpus=gpu_ids, run_as=run_as_uids, grace=grace,
        events_ping=events_ping, roots=roots,
        max_threads=max_threads, member_pids_limit=member_pids_limit,
        member_ttl=member_ttl, member_connect_timeout=member_connect_timeout,
        tokens=tokens, default_launcher=default_launcher, max_txn_ops=max_txn_ops,
        signing_key=signing_key.absolute() if signing_key is not None else None,
        docker_image=docker_image, docker_network=docker_network, docker_host=docker_host,
        docker_etcd=docker_etcd, docker_memory=docker_memory,
        docker_pids_limit=docker_pids_limit, docker_artifacts=docker_artifacts,
        allowed_images=tuple(allowed_image or ()),
        k8s_image=k8s_image, k8s_namespace=k8s_namespace, k8s_etcd=k8s_etcd,
    )  # fmt: skip
    run_service(options, host, port, shown_token=tokens is not None and token_file is None)


def checked_tokens(
    token_file: Path | None, insecure: bool, host: str, data_dir: Path
) -> Tokens | None:
    """The API's tokens: `--token-file`'s; on loopback without one, a token of its own
    (never no auth by accident); None only with --insecure."""
    from coordinator.service.rest.auth import Tokens, generated_tokens

    if token_file is not None:
        try:
            return Tokens.load(token_file)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--token-file") from None
    if insecure:
        return None
    if not is_loopback(host):
        raise typer.BadParameter(
            f"{host} is not loopback: give --token-file, or --insecure to serve without auth",
            param_hint="--host",
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        return generated_tokens(data_dir.absolute())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data-dir") from None


def check_signing_key(signing_key: Path | None) -> None:
    if signing_key is None:
        return
    from coordinator.signing import load_private_key

    try:
        load_private_key(signing_key)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--signing-key") from None


def check_container_options(
    etcd: str | None,
    docker_image: str | None,
    docker_memory: str,
    docker_pids_limit: int,
    docker_etcd: str | None,
    allowed_image: list[str] | None,
    k8s_image: str | None,
) -> None:
    """The container launchers' options, refused naming the option before anything starts."""
    from coordinator.service.images import ImagePolicy, check_reference

    if docker_image:
        from coordinator.service.launchers.docker_container import (
            check_limits,
            container_endpoints,
        )

        try:
            check_limits(docker_memory, docker_pids_limit)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--docker-memory") from None
        try:  # without --etcd, the embedded etcd: on loopback
            container_endpoints(etcd or DEFAULT_ETCD, docker_etcd)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--docker-etcd") from None
        try:
            check_reference(docker_image)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--docker-image") from None
    if allowed_image:
        if not (docker_image or k8s_image):
            raise typer.BadParameter(
                "needs a container launcher: --docker-image or --k8s-image", "--allowed-image"
            )
        try:
            ImagePolicy.of(docker_image or k8s_image or "", allowed_image)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--allowed-image") from None
    if k8s_image:
        try:
            import kubernetes  # noqa: F401 (only checked for)
        except ImportError:
            raise typer.BadParameter(
                "the kubernetes launcher needs the kubernetes extra: "
                "pip install 'etcd-coordinator[kubernetes]'",
                param_hint="--k8s-image",
            ) from None


def made_roots(
    data_dir: Path, data_root: Path | None, artifacts_root: Path | None, working_dir: Path | None
) -> Roots:
    """Where submitted paths may point, each folder made where it can be (the jobs' default
    artifacts folder, $COORDINATOR_ARTIFACTS, is the default artifacts root)."""
    from coordinator.service.admission import Roots

    default_artifacts = os.environ.get("COORDINATOR_ARTIFACTS") or data_dir / "artifacts"
    roots = Roots.of(
        data_root or data_dir / "data",
        artifacts_root or Path(default_artifacts),
        working_dir or data_dir / "work",
    )
    for name, folder in roots.environment().items():
        root = Path(folder)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a folder only the agents' or pods' hosts have
            console.print(f"[dim]{name.lower()}: {root} is not here ({exc.strerror})[/dim]")
    return roots


def export_for_members(roots: Roots, max_threads: int) -> None:
    """What the local members inherit and check again as they read: the roots, the jobs'
    default artifacts folder and the thread cap. The service itself is passed them."""
    os.environ.update(roots.environment())
    os.environ.setdefault("COORDINATOR_ARTIFACTS", str(roots.artifacts))
    os.environ[MAX_THREADS_ENV] = str(max_threads)


def run_service(options: ServiceOptions, host: str, port: int, shown_token: bool) -> None:
    """Build the service (on an etcd of its own without --etcd), serve until SIGTERM, stop."""
    import dataclasses

    from coordinator.etcd.errors import EtcdError
    from coordinator.service.embedded import ServiceEtcd
    from coordinator.service.launchers import LauncherUnavailable
    from coordinator.service.rest import server
    from coordinator.service.rest.auth import GENERATED_TOKEN_FILE
    from coordinator.service.runner import Service

    embedded = ServiceEtcd(options.data_dir) if not options.etcd else None
    if embedded is not None:
        embedded.security.export()  # the local members inherit it
        options = dataclasses.replace(options, etcd=embedded.endpoint, security=embedded.security)
    try:
        service = Service(options)
    except EtcdError as exc:  # unreachable, or a TLS or auth setting refused
        if embedded is not None:
            embedded.stop()
        console.print(f"[red]cannot reach etcd: {exc}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
    except LauncherUnavailable as exc:  # e.g. a loopback --k8s-etcd, no cluster configured
        if embedded is not None:
            embedded.stop()
        raise typer.BadParameter(str(exc), param_hint="--k8s-image") from None
    console.print(f"[dim]etcd at {options.etcd}; data in {options.data_dir}[/dim]")
    service.start()
    shown = "[::1]" if host == "::1" else host
    link = f"http://{shown}:{port}/"
    if shown_token:
        if console.file.isatty():  # a person's terminal; in the fragment: never sent on
            assert options.tokens is not None
            link += f"#token={options.tokens.strongest()}"
        else:  # a log: the token stays in its file
            link += f" (token: {options.data_dir / GENERATED_TOKEN_FILE})"
    console.print(f"dashboard: {link}", soft_wrap=True, highlight=False)
    try:
        simulator = service.app.state.context.simulator  # its runs end 503 at SIGTERM
        server.run(service.app, host, port, options.grace, on_stop=simulator.stop)
    finally:
        idle = service.idle()
        service.stop()
        if embedded is not None and idle:  # else its members still need it: it stays up
            embedded.stop()
