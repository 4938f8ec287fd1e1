"""Real processes end to end: workers, members, the service, agents, containers, a browser."""
