// The job page's members table: each member of the latest attempt, by rank, with its role
// in the job (the kind's roles, from /v1/kinds), where it runs, its phase, exit and failure.

import { escape, kinds } from "./shared.js";

// Shows the latest attempt's members; returns them, in the table's order.
export function showMembers(record) {
  const attempt = record.attempts[record.attempts.length - 1];
  const members = (attempt ? attempt.members : []).slice().sort((a, b) => (a.rank ?? 1e9 + a.index) - (b.rank ?? 1e9 + b.index));
  document.querySelector("#members tbody").innerHTML = members.map((m) => {
    const host = m.assignment ? `agent ${m.assignment.split("/")[0]}`
      : m.container ? `container ${m.container.slice(0, 12)}` : m.pid ? `local pid ${m.pid}` : "";
    const failure = m.failure ? `${m.failure.error}: ${m.failure.message}` : "";
    const exit = m.exit_code == null ? "" : m.exit_code;
    // "connect" is the last phase a member reports before its job's work ends.
    const phase = m.phase === "connect" && record.state === "RUNNING" ? "working" : m.phase;
    const role = memberRole(record, m.rank);
    return `<tr data-index="${m.index}">
      <td class="rank num">${m.rank ?? ""}</td><td class="role muted">${escape(role)}</td>
      <td class="address">${escape(m.address || "-")}</td><td class="host">${escape(host)}</td>
      <td class="phase">${escape(phase)}</td>
      <td class="exit num ${exit !== "" && exit !== 0 ? "bad" : ""}">${exit}</td>
      <td class="failure">${escape(failure)}</td></tr>`;
  }).join("");
  return members;
}

// What a rank does in its job: the kind's roles are spans of ranks, in order, each of a
// parameter's count (else its default); the last takes every rank left.
function kindRole(record, rank) {
  let start = 0;
  for (const span of kinds.byName.get(record.spec.kind)?.roles || []) {
    if (span.count_param == null) return span.role;
    const count = Number.parseInt(record.spec.params[span.count_param] ?? span.count_default, 10);
    start += Number.isNaN(count) ? span.count_default : count;
    if (rank < start) return span.role;
  }
  return "";
}

function memberRole(record, rank) {
  if (rank == null) return "";
  const params = record.spec.params;
  const parts = [kindRole(record, rank)].filter(Boolean);
  if (params.straggler_rank !== undefined && Number(params.straggler_rank) === rank) {
    parts.push(`straggler ×${params.straggler_factor || "?"}`);
  }
  return parts.join(", ");
}
