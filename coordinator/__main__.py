from coordinator.cli import app

app(prog_name="coordinator")
