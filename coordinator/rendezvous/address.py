"""The address at which the other members can reach this one.

Containers on bridge networks and hosts with several interfaces make the
hostname's address a poor guess. The interface the kernel would use to reach
etcd is the one the other members share with us, so ask the routing table:
a UDP `connect` picks that route and sends nothing.
"""

from __future__ import annotations

import ipaddress
import os
import socket

ADVERTISE_ENV = "COORDINATOR_ADVERTISE_ADDRESS"


def route_address(host: str, port: int) -> str | None:
    """The local address of the interface that routes to `host:port`."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            address = sock.getsockname()[0]
    except OSError:
        return None
    return None if address in ("0.0.0.0", "::") else address


def advertise_address(etcd_endpoints: list[str], override: str | None = None) -> str:
    """An explicit override (argument, then environment) wins; else the route to etcd."""
    explicit = override or os.environ.get(ADVERTISE_ENV, "").strip()
    if explicit:
        return explicit
    for endpoint in etcd_endpoints:
        host, _, port = endpoint.rpartition(":")
        found = route_address(host.strip("[]"), int(port))
        if found:
            return found
    return socket.gethostbyname(socket.gethostname())


def is_loopback(host: str) -> bool:
    """`host` (a name or an address) is this machine's own loopback, which another
    container or pod cannot reach."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: resolved wherever it is used


def endpoint_host(endpoint: str) -> str:
    """The host of `[scheme://]HOST:PORT`."""
    return endpoint.strip().split("://")[-1].rpartition(":")[0].strip("[]")
