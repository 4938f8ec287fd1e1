"""The process exit codes every command shares (docs/rendezvous.md's table lists them with the
member's own; `worker.EXIT_CODES` says what each means)."""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_ETCD_UNAVAILABLE = 3  # etcd away, or it refused the TLS or auth settings
EXIT_INTERRUPTED = 130
