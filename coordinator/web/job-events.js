// The job page's events (its conditions and its members' phases, ends and failures, newest
// first) and its logs (the output of one member or of all, tailed while the job runs).

import { FINAL, api, clockTime, escape, quietly } from "./shared.js";

const LOGS_REFRESH_MS = 2000;

export class EventList {
  constructor() {
    this.seen = new Set(); // events already listed
  }

  addConditions(record) {
    for (const c of record.conditions) this.add(c.at, `job ${c.state}: ${c.reason}`, `job:${c.state}:${c.at}`);
  }

  addMemberEvent(event) {
    const who = event.rank != null ? `rank ${event.rank}` : "a member";
    const text = event.event === "phase" ? `${who}: ${event.phase}`
      : event.event === "done" ? `${who}: done`
      : `${who} failed in ${event.phase} (${event.error}): ${event.message}`;
    this.add(event.t, text, `${event.event}:${event.rank}:${event.phase}:${event.t}`);
  }

  add(at, text, key) {
    if (this.seen.has(key)) return;
    this.seen.add(key);
    const list = document.getElementById("events");
    const li = document.createElement("li");
    li.dataset.at = String(at);
    li.innerHTML = `<span class="time">${clockTime(at)}</span><span>${escape(text)}</span>`;
    const later = [...list.children].find((item) => Number(item.dataset.at) < at);
    list.insertBefore(li, later || null); // newest first
  }
}

export class Logs {
  constructor(jobId, signal) {
    this.jobId = jobId;
    this.signal = signal;
    this.record = null; // the job's latest record: its members, and whether it still runs
    this.timer = null;
    this.loading = null;
    this.chosen = false; // whether the reader chose a rank (else a failure's own is shown)
  }

  start() {
    document.getElementById("log-rank").addEventListener("change", () => {
      this.chosen = true; // the reader's choice stays
      this.load();
    });
    this.signal.addEventListener("abort", () => clearTimeout(this.timer));
  }

  // The members to choose from (as the members table lists them), kept while unchanged.
  offer(members) {
    const select = document.getElementById("log-rank");
    const options = members.map((m) => [m.index, m.rank != null ? `rank ${m.rank}` : `member ${m.index}`]);
    const wanted = options.map(([index, text]) => `${index}:${text}`).join("|");
    if (select.dataset.options !== wanted) {
      const chosen = select.value;
      select.innerHTML = `<option value="">all members</option>` +
        options.map(([index, text]) => `<option value="${index}">${escape(text)}</option>`).join("");
      select.value = options.some(([index]) => String(index) === chosen) ? chosen : "";
      select.dataset.options = wanted;
    }
    // A failed job opens on the rank its reason names, until the reader chooses another.
    const culprit = members.find((m) => m.rank != null && m.rank === culpritRank(this.record));
    if (culprit && !this.chosen && select.value !== String(culprit.index)) {
      select.value = String(culprit.index);
      this.load();
    }
  }

  async load() {
    clearTimeout(this.timer);
    this.loading?.abort(); // the rank may change while a load is out: only the newest shows
    const load = (this.loading = new AbortController());
    const signal = AbortSignal.any([this.signal, load.signal]);
    const rank = document.getElementById("log-rank").value;
    const member = rank === "" ? null : Number(rank);
    const attempt = this.record?.attempts[this.record.attempts.length - 1];
    const query = new URLSearchParams({ tail: "300" });
    const chosen = member == null ? null : attempt?.members.find((m) => m.index === member);
    if (chosen && chosen.rank != null) query.set("rank", String(chosen.rank));
    await quietly((async () => {
      const response = await api(`/v1/jobs/${encodeURIComponent(this.jobId)}/logs?${query}`, { signal });
      if (!response.ok) return;
      const text = await response.text();
      if (signal.aborted) return;
      const pre = document.getElementById("logs");
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
      pre.textContent = text || "(no output yet)";
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    })());
    if (!signal.aborted && this.record && !FINAL.has(this.record.state)) {
      this.timer = setTimeout(() => this.load(), LOGS_REFRESH_MS);
    }
  }
}

// The rank a failure's reason names: the service ends it with the command showing that
// rank's output (`...; its output: coordinator logs <job> --rank <r>`).
function culpritRank(record) {
  const reason = record?.conditions[record.conditions.length - 1]?.reason || "";
  const named = / --rank (\d+)$/.exec(reason);
  return named ? Number(named[1]) : null;
}
