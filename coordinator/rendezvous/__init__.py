"""How a job's members find each other through etcd: ranks, the roster, the named
barriers, the authenticated endpoint, and the typed errors when a peer is lost."""
