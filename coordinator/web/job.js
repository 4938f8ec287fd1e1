// One job's page (#/jobs/<id>): its state and conditions, followed live from its event
// stream; its charts (job-charts.js), members (job-members.js), events and logs
// (job-events.js); and a cancel button for a token that may submit.

import { makeSvg } from "./charts.js";
import { JobCharts } from "./job-charts.js";
import { EventList, Logs } from "./job-events.js";
import { showMembers } from "./job-members.js";
import { FINAL, activate, api, badge, canSubmit, clockTime, escape, kinds, main, quietly, stream } from "./shared.js";

export function jobPage(jobId, signal) {
  activate("jobs");
  window.dashboard = { clocks: {}, clockUpdates: 0 };
  main().innerHTML = `
    <section class="job-head">
      <div>
        <a href="#/" class="muted">← jobs</a>
        <h1>${escape(jobId)} <span id="job-state" class="badge"></span></h1>
        <p class="muted" id="job-summary"></p>
      </div>
      <div class="actions" id="job-actions"></div>
    </section>
    <p class="reason" id="job-reason"></p>
    <div class="grid">
      <section class="card" data-shows="curve"><div class="card-head"><h2 id="curve-title">Learning curve</h2>
        <select id="curve-axis"><option value="x">by round</option><option value="t">by time</option></select></div><div id="curve-box"></div><p class="muted small" id="curve-latest"></p></section>
      <section class="card" data-shows="clocks"><h2>Step clocks</h2><p class="muted small" id="clocks-note"></p><div id="clocks-box"></div><div id="gaps-box"></div></section>
      <section class="card" data-shows="clocks"><h2>Staleness</h2><p class="muted small" id="staleness-title"></p><div id="staleness-box"></div></section>
      <section class="card"><h2>Members</h2>
        <table id="members" class="table small"><thead><tr><th class="num">rank</th><th>role</th><th>address</th><th>runs as</th><th>phase</th><th class="num">exit</th><th>failure</th></tr></thead><tbody></tbody></table>
      </section>
      <section class="card"><h2>Conditions</h2><ol id="conditions" class="timeline"></ol></section>
      <section class="card"><h2>Events</h2><ol id="events" class="events"></ol></section>
    </div>
    <section class="card">
      <div class="card-head"><h2>Logs</h2><select id="log-rank"></select></div>
      <pre id="logs" class="logs"></pre>
    </section>`;
  document.getElementById("curve-box").append(makeSvg("chart-curve"));
  document.getElementById("clocks-box").append(makeSvg("chart-clocks", 640, 230));
  document.getElementById("gaps-box").append(makeSvg("chart-gaps", 640, 150));
  document.getElementById("staleness-box").append(makeSvg("chart-staleness", 640, 220));
  const view = new JobView(jobId, signal);
  view.start();
}

class JobView {
  constructor(jobId, signal) {
    this.jobId = jobId;
    this.signal = signal;
    this.record = null;
    this.charts = new JobCharts(signal);
    this.events = new EventList();
    this.logs = new Logs(jobId, signal);
  }

  start() {
    quietly(this.followRecord());
    this.logs.start();
    document.getElementById("curve-axis").addEventListener("change", () => this.charts.markDirty());
    this.charts.draw();
  }

  async followRecord() {
    await stream(`/v1/jobs/${encodeURIComponent(this.jobId)}/events`, (name, data) => {
      const first = this.record === null;
      const wasFinal = !first && FINAL.has(this.record.state);
      this.showRecord(JSON.parse(data));
      // A final job's history comes whole; a live job's stream starts with its history,
      // and once the job is over its whole history is read again, so the page ends
      // complete however the live stream's last poll fell.
      if (first) quietly(FINAL.has(this.record.state) ? this.loadSeries() : this.followLive());
      else if (!wasFinal && FINAL.has(this.record.state)) quietly(this.loadSeries());
    }, this.signal);
  }

  async loadSeries() {
    const response = await api(`/v1/jobs/${encodeURIComponent(this.jobId)}/series`, { signal: this.signal });
    if (!response.ok) return;
    const series = await response.json();
    this.charts.setSeries(series);
    series.events.forEach((event) => this.events.addMemberEvent(event));
  }

  async followLive() {
    await stream(`/v1/jobs/${encodeURIComponent(this.jobId)}/live`, (name, data) => {
      const body = JSON.parse(data);
      if (name === "bound") this.charts.bound = body.bound;
      else if (name === "clocks") this.charts.addClocks(body.t, body.clocks);
      else if (name === "events") body.forEach((event) => this.addEvent(event));
    }, this.signal);
  }

  addEvent(event) {
    if (["phase", "failed", "done"].includes(event.event)) this.events.addMemberEvent(event);
    this.charts.addEvent(event);
  }

  showRecord(record) {
    const first = this.record === null;
    this.record = record;
    this.logs.record = record;
    if (first) {
      // Only the charts the kind has data for (as /v1/kinds says).
      const charts = kinds.byName.get(record.spec.kind)?.charts || [];
      for (const card of document.querySelectorAll("[data-shows]")) {
        card.hidden = !charts.includes(card.dataset.shows);
      }
    }
    const stateEl = document.getElementById("job-state");
    stateEl.textContent = record.state;
    stateEl.className = `badge state-${record.state.toLowerCase()}`;
    const spec = record.spec;
    const params = Object.entries(spec.params).map(([k, v]) => `${k}=${v}`).join(", ");
    document.getElementById("job-summary").textContent =
      `${spec.kind} · ${spec.workers} workers · ${spec.launcher} · attempt ${record.attempts.length || "–"}` +
      (params ? ` · ${params}` : "");
    const last = record.conditions[record.conditions.length - 1];
    document.getElementById("job-reason").textContent = last ? last.reason : "";
    this.showActions(record);
    this.logs.offer(showMembers(record));
    document.getElementById("conditions").innerHTML = record.conditions.map((c) =>
      `<li><span class="time">${clockTime(c.at)}</span>${badge(c.state)}<span>${escape(c.reason)}</span></li>`).join("");
    this.events.addConditions(record);
    if (first) this.logs.load();
  }

  showActions(record) {
    const box = document.getElementById("job-actions");
    const canCancel = canSubmit() && !FINAL.has(record.state) && !record.cancel_requested_at;
    if (!canCancel) {
      box.innerHTML = record.cancel_requested_at && !FINAL.has(record.state) ? `<span class="muted">cancelling…</span>` : "";
      return;
    }
    if (document.getElementById("cancel")) return;
    box.innerHTML = `<button id="cancel" class="danger">Cancel job</button>`;
    document.getElementById("cancel").addEventListener("click", async (event) => {
      event.target.disabled = true;
      await quietly(api(`/v1/jobs/${encodeURIComponent(this.jobId)}/cancel`, { method: "POST", signal: this.signal }));
    });
  }
}
