"""The docker launcher's temporary folder of password files goes when the service
stops, unless a run still holds a file there (nothing here reaches an engine)."""

from __future__ import annotations

from coordinator.service.launchers.docker import DockerLauncher


def launcher() -> DockerLauncher:
    return DockerLauncher("worker:test", "net", None, "etcd:2379")


def test_an_empty_secrets_folder_goes_with_the_launcher() -> None:
    docker = launcher()
    folder = docker.secrets_dir
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
    docker.close()
    assert not folder.exists()


def test_a_folder_still_holding_a_runs_password_stays() -> None:
    docker = launcher()
    password = docker.password_path("run-1")
    password.parent.mkdir()
    password.write_text("x")
    docker.close()
    assert password.exists()
    # what `remove` does once the run is over (no engine here to remove containers)
    password.unlink()
    password.parent.rmdir()
    docker.close()
    assert not docker.secrets_dir.exists()
