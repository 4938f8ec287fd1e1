"""etcd in a container for the tests (the `--etcd-from container` source), with auth on
as the product runs it."""

from __future__ import annotations

from pathlib import Path

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.users import ROOT, enable_auth, new_password, write_password_file
from tests.support.containers import LABEL


class EtcdContainer:
    """etcd in a container started by testcontainers, with auth on as the product runs it
    (a root password in a private file of the test session's); as on EmbeddedEtcd,
    `endpoint` and `security`."""

    def __init__(self, image: str, folder: Path) -> None:
        from testcontainers.core.container import DockerContainer

        self.container = (
            DockerContainer(image, labels={LABEL: "1"})
            .with_command(
                "/usr/local/bin/etcd --name=etcd --data-dir=/var/lib/etcd "
                "--listen-client-urls=http://0.0.0.0:2379 "
                "--advertise-client-urls=http://127.0.0.1:2379 --bcrypt-cost=4"
            )
            .with_exposed_ports(2379)
            .start()
        )
        host = self.container.get_container_host_ip()
        self.endpoint = f"{host}:{self.container.get_exposed_port(2379)}"
        password = new_password()
        password_file = write_password_file(folder / "root.password", password)
        with Etcd(self.endpoint, connect_timeout=30, security=EtcdSecurity()) as plain:
            enable_auth(plain, password)
        self.security = EtcdSecurity(user=ROOT, password_file=str(password_file))

    def stop(self) -> None:
        self.container.stop()
