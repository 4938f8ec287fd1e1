"""The host agent: one host's daemon that runs the members etcd assigns to it."""
