"""The control loop: the leader's reconciler and what it follows, decides and cleans up."""
