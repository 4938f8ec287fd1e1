"""What the tests share, and bench/ with them: harnesses for real processes, etcd, the
service, agents, containers and the browser. No test module imports another; they
import from here, and their fixtures live in conftest.py files."""
