"""Drive the service from Python: `python examples/client.py` beside a running
`coordinator serve` (on this host, its token is found as the CLI finds it; elsewhere
set COORDINATOR_SERVER and COORDINATOR_TOKEN).

Submits an XGBoost job, follows it to its end, prints its last log lines, then submits
a second job and cancels it."""

from coordinator.client import Client, Refused

with Client() as service:
    job = service.submit({"kind": "xgboost", "workers": 2, "params": {"rounds": "5"}})
    print("submitted", job.id)
    for record in service.events(job.id):  # each change, until the job is final
        print(" ", record.state, "-", record.conditions[-1].reason)
    for line in list(service.logs(job.id, rank=0))[-3:]:
        print(" ", line)

    try:
        service.submit({"kind": "noop", "workers": 2, "params": {"colour": "red"}})
    except Refused as refused:
        print("refused:", refused.fields)

    second = service.submit({"kind": "noop", "workers": 2, "params": {"seconds": "60"}})
    service.cancel(second.id)
    print(second.id, service.wait(second.id, timeout=60).state)
