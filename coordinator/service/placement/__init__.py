"""Agent placement: where members go on the agents, and what the service writes them."""
