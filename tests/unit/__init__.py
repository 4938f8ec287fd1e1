"""Pure tests: no etcd, no process, no network. `pytest tests/unit` runs in seconds."""
