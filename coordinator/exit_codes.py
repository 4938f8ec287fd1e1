"""The process exit codes every command shares; `worker.EXIT_CODES`, with the member's
own, says what each means (`coordinator exit-codes` prints it)."""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_ETCD_UNAVAILABLE = 3  # etcd away, or it refused the TLS or auth settings
EXIT_INTERRUPTED = 130
