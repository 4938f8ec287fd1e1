"""Who is where: read the roster file `coordinator run -- ...` gives each member.

coordinator run --workers 3 -- python examples/roster.py
"""

import json
import os

with open(os.environ["COORDINATOR_ROSTER"]) as handle:
    roster = json.load(handle)
me = int(os.environ["COORDINATOR_RANK"])
print(
    f"rank {me} of {roster['world_size']} in job {roster['job_id']}; "
    f"master {roster['master']['addr']}:{roster['master']['port']}"
)
for member in roster["members"]:
    print(
        f"rank {me} sees rank {member['rank']} on {member['hostname']} at {member['address']} "
        f"(reserved ports {member['reserved_ports']})"
    )
