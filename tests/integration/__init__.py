"""In-process tests against real servers: etcd, loopback sockets, an API stand-in."""
