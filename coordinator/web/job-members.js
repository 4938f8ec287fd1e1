// The job page's members table: each member of the latest attempt, by rank, with its role
// in the job (the service's, from the kind), where it runs, its phase, exit and failure.

import { escape } from "./shared.js";

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
    return `<tr data-index="${m.index}">
      <td class="rank num">${m.rank ?? ""}</td><td class="role muted">${escape(m.role || "")}</td>
      <td class="address">${escape(m.address || "-")}</td><td class="host">${escape(host)}</td>
      <td class="phase">${escape(phase)}</td>
      <td class="exit num ${exit !== "" && exit !== 0 ? "bad" : ""}">${exit}</td>
      <td class="failure">${escape(failure)}</td></tr>`;
  }).join("");
  return members;
}
