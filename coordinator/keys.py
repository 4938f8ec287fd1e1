"""Every etcd key the product writes or reads, composed and parsed here alone.

Pure: no etcd I/O, no imports from the product (its modules import this). Callers
pass the namespace as `Etcd.namespace` spells it (`/coordinator`, or empty). Ranks
are 6 digits, so a prefix lists them in rank order. The map, with whose lease a key is
bound to in brackets ("none": it stays until deleted on purpose):

    <ns>/
      jobs/<job>/                          all its members may touch; goes with its record
        rendezvous/                          deleted by the last member out, or for a restart
          arrivals/<member-id>               each member on arrival: host, pid [member]
          members/<rank>                     the rank claim, then its state; gone: lost [member]
          elected                            the leader once all N ranks are held [leader]
          addresses/<rank>                   each member: its host and port [member]
          roster                             the leader, once: roster, round's secret [leader]
          barriers/<round>/<name>/<use>/     a named barrier's use-th passage:
            arrived/<rank>                     each arrival: {"t"} [member]
            ready                              the arrival that completes the count [member]
          program/barriers/<round>/...       the same, for a command program's own [member]
        steps/                               step barriers (`StepKeys`; also program/steps/<n>/)
          <round>/clocks/<rank>                a worker's clock JSON [worker]
          <round>/order/<level>/<rank>         BSP/SSP: the clock, at its 12-digit level [worker]
          <round>/slowest                      BSP/SSP: the job-wide slowest clock [none]
          <round>/at/<rank>                    pBSP/pSSP: fixed-width clock [worker; lost: none]
          <round>/mail/<to>/<from>             pBSP/pSSP: `from` wakes `to` [from]
          dssp/<rank>                          DSSP: the worker's credit, across restarts [none]
          progress/<rank>                      the steps kind: {"clock", "target"} [none]
        program/rounds/<round>               each round of a command program: `ctx.attempt` [none]
        failures/<rank>                      why a member failed: phase, error, lost_rank [none]
        command/<round>/ports/<rank>         the command kind: each reserved port [member]
        command/<round>/failed/<rank>        a member whose program failed: {status, at} [member]
        xgboost/<round>/tracker              the leader's tracker: {host, port} [leader]
        xgboost/shards/<rank>                what each member read [none]
        xgboost/metrics/<n>                  rank 0, after each boosting round [none]
        xgboost/summary                      rank 0: rounds, metrics, the model [none]
        mnist/servers/<rank>                 each parameter server at the end [none]
        mnist/step-times/<trainer>           each trainer's step durations [none]
        mnist/metrics/<n>                    rank 0's n-th test evaluation [none]
        mnist/summary                        rank 0 at the end [none]
      api/jobs/<id>                        the service: a job's `JobRecord` [none]
      api/credentials/<id>                 the leader: a running job's etcd user, password [none]
      api/leader                           the replica that runs the reconciler [replica]
      api/heartbeat                        the leader, every TTL/3: proof it still acts [replica]
      agents/<agent>                       an agent's registration, `AgentRecord` [agent]
      assignments/<agent>/<member>         the service: a member placed there; the agent
                                           deletes it when the member ends [agent]
      reports/<agent>/<member>             the agent: the member's last state [agent]
      placements/<placement>               a big placement's commit, till its attempt ends [none]

`<member>` is `<run_id>-a<attempt>-m<index>`, `<placement>` `<run_id>-a<attempt>-<16 hex
digits>`. A job's etcd user is `<ns>/jobs/<job>`, an agent's `<ns>/agents/<agent>`
(`coordinator.etcd.users`). Nothing here checks names (`coordinator.etcd.names` does,
before a key is made), nor values: whoever reads one checks it before trusting it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import cached_property

#: Digits of an order level in its key (the clock's fixed-width form): keys sort by level.
LEVEL_DIGITS = 12
PLACEMENT_TOKEN = r"[0-9a-f]{16}"  # what makes each placement id new
# A step clock key: `clocks/<rank>` or `order/<level>/<rank>` under some `steps/<round>/`.
_STEP_CLOCK = re.compile(r"/steps/\d+/(?:clocks|order/\d+)/(\d{6})$")


# -- parsing (pure) -------------------------------------------------------------------------


def leaf(key: str) -> str:
    """The key's last segment."""
    return key.rsplit("/", 1)[1]


def rank_of(key: str) -> int:
    """The rank a key ends in (`members/<rank>`, `clocks/<rank>`, ...)."""
    return int(leaf(key))


def step_clock_rank(key: str) -> int | None:
    """The rank of a step barrier's clock key under a job's `steps/`, or None for any
    other key (a program's own step barriers included)."""
    found = _STEP_CLOCK.search(key)
    return int(found.group(1)) if found else None


# -- names that are key segments ------------------------------------------------------------


def member_name(run_id: str, attempt: int, index: int) -> str:
    """`<member>` of an assignment or report: unique to one member of one attempt."""
    return f"{run_id}-a{attempt}-m{index}"


def of_run(name: str, run_id: str) -> bool:
    """Whether a member name or placement id is of one of this run's attempts."""
    return name.startswith(f"{run_id}-a")


def new_placement(run_id: str, attempt: int) -> str:
    """A placement id of its own for one try to place this attempt (two writers placing
    the same attempt never share one: the commit of one starts nothing of the other's)."""
    return f"{run_id}-a{attempt}-{secrets.token_hex(8)}"


def placements_of(run_id: str, attempt: int | None = None) -> re.Pattern[str]:
    """The placement ids of a run (of one attempt of it), exactly: never another run's
    whose id merely starts with this one."""
    which = str(attempt) if attempt is not None else "[0-9]{1,4}"
    return re.compile(re.escape(run_id) + f"-a{which}-{PLACEMENT_TOKEN}")


# -- relative to the namespace (what `Etcd(probe=...)` takes) ----------------------------


def job_path(job_id: str) -> str:
    """`jobs/<job>/`: all a job's members may touch."""
    return f"jobs/{job_id}/"


def assignments_path(agent_id: str) -> str:
    """`assignments/<agent>/`: an agent's assignments."""
    return f"assignments/{agent_id}/"


# -- the namespace's keys -------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """The keys directly under a namespace (the service's, the agents')."""

    namespace: str

    def job(self, job_id: str) -> JobKeys:
        return JobKeys(self.namespace, job_id)

    @cached_property
    def jobs(self) -> str:
        return f"{self.namespace}/jobs/"

    @cached_property
    def records(self) -> str:
        return f"{self.namespace}/api/jobs/"

    def record(self, job_id: str) -> str:
        return self.records + job_id

    def record_id(self, key: str) -> str:
        """The job id of a key under `records`."""
        return key[len(self.records) :]

    @cached_property
    def credentials(self) -> str:
        return f"{self.namespace}/api/credentials/"

    def credential(self, job_id: str) -> str:
        return self.credentials + job_id

    def credential_id(self, key: str) -> str:
        """The job id of a key under `credentials`."""
        return key[len(self.credentials) :]

    @cached_property
    def leader(self) -> str:
        return f"{self.namespace}/api/leader"

    @cached_property
    def heartbeat(self) -> str:
        return f"{self.namespace}/api/heartbeat"

    @cached_property
    def agents(self) -> str:
        return f"{self.namespace}/agents/"

    def agent(self, agent_id: str) -> str:
        return f"{self.namespace}/agents/{agent_id}"

    def assignments(self, agent_id: str | None = None) -> str:
        """Every agent's assignments, or one agent's."""
        return f"{self.namespace}/" + (assignments_path(agent_id) if agent_id else "assignments/")

    def assignment(self, agent_id: str, member: str) -> str:
        return self.assignments(agent_id) + member

    def assigned(self, key: str) -> tuple[str, str]:
        """(agent id, member) of a key under `assignments()`."""
        agent_id, _, member = key[len(self.assignments()) :].partition("/")
        return agent_id, member

    def reports(self, agent_id: str | None = None) -> str:
        """Every agent's reports, or one agent's."""
        return f"{self.namespace}/reports/{agent_id}/" if agent_id else f"{self.namespace}/reports/"

    def report(self, agent_id: str, member: str) -> str:
        return self.reports(agent_id) + member

    @cached_property
    def placements(self) -> str:
        return f"{self.namespace}/placements/"

    def placement(self, placement: str) -> str:
        return self.placements + placement

    def placement_id(self, key: str) -> str:
        """The placement id of a key under `placements`."""
        return key[len(self.placements) :]


# -- a job's keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BarrierKeys:
    """One use of a named barrier: a key per arrival, then `ready`."""

    base: str

    @cached_property
    def arrived(self) -> str:
        return self.base + "arrived/"

    def arrival(self, rank: int) -> str:
        return f"{self.arrived}{rank:06d}"

    @cached_property
    def ready(self) -> str:
        return self.base + "ready"


@dataclass(frozen=True)
class JobKeys:
    """Where a job keeps its keys (all under `<ns>/jobs/<job>/`). Each prefix is made
    once (a cached property): members make keys in their loops."""

    namespace: str
    job_id: str

    @cached_property
    def job(self) -> str:
        return f"{self.namespace}/{job_path(self.job_id)}"

    @cached_property
    def rendezvous(self) -> str:
        return self.job + "rendezvous/"

    @cached_property
    def arrivals(self) -> str:
        return self.rendezvous + "arrivals/"

    def arrival(self, member_id: str) -> str:
        return self.arrivals + member_id

    @cached_property
    def members(self) -> str:
        return self.rendezvous + "members/"

    def member(self, rank: int) -> str:
        return f"{self.members}{rank:06d}"

    @cached_property
    def addresses(self) -> str:
        return self.rendezvous + "addresses/"

    def address(self, rank: int) -> str:
        return f"{self.addresses}{rank:06d}"

    @cached_property
    def elected(self) -> str:
        return self.rendezvous + "elected"

    @cached_property
    def roster(self) -> str:
        return self.rendezvous + "roster"

    def barrier(self, round_: int, name: str, use: int) -> BarrierKeys:
        return BarrierKeys(f"{self.rendezvous}barriers/{round_}/{name}/{use}/")

    @cached_property
    def steps(self) -> str:
        """The job's step barrier root (`StepKeys`)."""
        return self.job + "steps/"

    def step_progress(self, rank: int) -> str:
        return f"{self.steps}progress/{rank:06d}"

    @cached_property
    def program_rounds(self) -> str:
        return self.job + "program/rounds/"

    def program_round(self, round_: int) -> str:
        return f"{self.program_rounds}{round_:020d}"

    def program_steps(self, number: int) -> str:
        """The root of a command program's `number`-th step barrier (`StepKeys`)."""
        return f"{self.job}program/steps/{number}/"

    def failure(self, rank: int) -> str:
        return f"{self.job}failures/{rank:06d}"

    def command_ports(self, round_: int) -> str:
        return f"{self.job}command/{round_}/ports/"

    def command_port(self, round_: int, rank: int) -> str:
        return f"{self.command_ports(round_)}{rank:06d}"

    def command_failures(self, round_: int) -> str:
        return f"{self.job}command/{round_}/failed/"

    def command_failure(self, round_: int, rank: int) -> str:
        return f"{self.command_failures(round_)}{rank:06d}"

    def xgboost_tracker(self, round_: int) -> str:
        return f"{self.job}xgboost/{round_}/tracker"

    def xgboost_shard(self, rank: int) -> str:
        return f"{self.job}xgboost/shards/{rank:06d}"

    def xgboost_metrics(self, number: int) -> str:
        return f"{self.job}xgboost/metrics/{number:06d}"

    @cached_property
    def xgboost_summary(self) -> str:
        return self.job + "xgboost/summary"

    @cached_property
    def mnist_servers(self) -> str:
        return self.job + "mnist/servers/"

    def mnist_server(self, rank: int) -> str:
        return f"{self.mnist_servers}{rank:06d}"

    @cached_property
    def mnist_step_times(self) -> str:
        return self.job + "mnist/step-times/"

    def mnist_step_time(self, trainer: int) -> str:
        return f"{self.mnist_step_times}{trainer:06d}"

    def mnist_metrics(self, number: int) -> str:
        return f"{self.job}mnist/metrics/{number:06d}"

    @cached_property
    def mnist_summary(self) -> str:
        return self.job + "mnist/summary"


class ProgramKeys(JobKeys):
    """The job's keys, with a command program's barriers apart from its member's."""

    def barrier(self, round_: int, name: str, use: int) -> BarrierKeys:
        return BarrierKeys(f"{self.rendezvous}program/barriers/{round_}/{name}/{use}/")


@dataclass(frozen=True)
class StepKeys:
    """A step barrier's keys in one round, under `root` (`JobKeys.steps` by default)."""

    root: str
    round: int

    @cached_property
    def in_round(self) -> str:
        return f"{self.root}{self.round}/"

    @cached_property
    def clocks(self) -> str:
        return self.in_round + "clocks/"

    def clock(self, rank: int) -> str:
        return f"{self.clocks}{rank:06d}"

    @cached_property
    def order(self) -> str:
        return self.in_round + "order/"

    def level(self, level: int) -> str:
        return f"{self.order}{level:0{LEVEL_DIGITS}d}/"

    def ordered(self, level: int, rank: int) -> str:
        return f"{self.level(level)}{rank:06d}"

    def level_of(self, key: str) -> int:
        """The level of a key under `order`."""
        return int(key[len(self.order) :].split("/")[0])

    @cached_property
    def slowest(self) -> str:
        return self.in_round + "slowest"

    def at(self, rank: int) -> str:
        return f"{self.in_round}at/{rank:06d}"

    def mailbox(self, rank: int) -> str:
        return f"{self.in_round}mail/{rank:06d}/"

    def mail(self, to: int, sender: int) -> str:
        return f"{self.mailbox(to)}{sender:06d}"

    def credit(self, rank: int) -> str:
        """DSSP's credit: not per round, so a restarted member continues its episode."""
        return f"{self.root}dssp/{rank:06d}"
