// The dashboard: a page per route (#/, #/jobs/<id>, #/submit, #/simulate), fed by the
// REST API with the user's token. Event streams are read with fetch (EventSource cannot
// send a token). Nothing is loaded from anywhere but this service.

import { PALETTE, histogram, lineChart, makeSvg } from "/ui/charts.js";

const FINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const STATES = ["PENDING", "STARTING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED"];
// The job kinds, as `GET /v1/kinds` describes them: this page names none of its own.
const kinds = { list: [], byName: new Map() };
const LAUNCHERS = ["local", "docker", "agents", "kubernetes"];
const TOKEN_KEY = "coordinator-token";
const JOBS_REFRESH_MS = 2000;
const MAX_CLOCK_POINTS = 4000; // per trainer: older points are thinned beyond this (long runs)

// `coordinator serve` prints a link with its token in the fragment (#token=...), which the
// browser never sends: keep it for this session, and take it out of the address bar and the
// history at once, so it is neither bookmarked nor shown over a shoulder.
function tokenFromLink() {
  const match = location.hash.match(/^#token=([^&]+)$/);
  if (!match) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
  history.replaceState(null, "", `${location.pathname}${location.search}#/`);
}
tokenFromLink();

const session = { token: sessionStorage.getItem(TOKEN_KEY), role: "none", auth: false };
let page = null; // the current page's AbortController: its requests and timers stop with it
window.dashboard = { clocks: {}, clockUpdates: 0 };

class SignInNeeded extends Error {}

// -- talking to the API --------------------------------------------------------------

async function api(path, { method = "GET", json, signal, accept } = {}) {
  const headers = {};
  if (session.token) headers.Authorization = `Bearer ${session.token}`;
  if (accept) headers.Accept = accept;
  const options = { method, headers, signal };
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(json);
  }
  const response = await fetch(path, options);
  if (response.status === 401) {
    session.role = "none";
    showSignIn();
    throw new SignInNeeded();
  }
  return response;
}

// Server-Sent Events over fetch: calls onEvent(name, data) until the stream ends.
async function stream(path, onEvent, signal) {
  const response = await api(path, { signal, accept: "text/event-stream" });
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const held = buffer.endsWith("\r") ? "\r" : ""; // a CRLF split across two chunks
    buffer = buffer.slice(0, buffer.length - held.length).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
    buffer += held;
  }
}

async function loadKinds() {
  if (kinds.list.length) return;
  const response = await api("/v1/kinds");
  if (!response.ok) throw new Error(`/v1/kinds: ${response.status}`);
  const body = await response.json();
  kinds.list = body.kinds;
  kinds.byName = new Map(body.kinds.map((kind) => [kind.name, kind]));
}

// The kinds this token may submit (all of them, to filter or read).
function kindOptions(forSubmit = false) {
  return kinds.list
    .filter((kind) => !forSubmit || !kind.needs_exec || session.role === "exec")
    .map((kind) => `<option value="${escape(kind.name)}">${escape(kind.name)}</option>`).join("");
}

function quietly(promise) {
  return promise.catch((error) => {
    if (error.name !== "AbortError" && !(error instanceof SignInNeeded)) console.warn(error.message);
  });
}

// -- small helpers ---------------------------------------------------------------------

function escape(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function age(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function clockTime(unix) {
  return new Date(unix * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

function badge(state) {
  return `<span class="badge state-${escape(state).toLowerCase()}">${escape(state)}</span>`;
}

function progressCell(record) {
  const { step, total } = record.progress || {};
  if (step == null) return `<span class="muted">–</span>`;
  const fraction = total ? Math.min(1, step / total) : 0;
  const text = total ? `${step} / ${total}` : `${step}`;
  return `<div class="bar"><div style="width:${(fraction * 100).toFixed(1)}%"></div></div><span class="bar-text">${escape(text)}</span>`;
}

// Every other point of the older half goes: memory stays bounded, recent detail stays.
function thinOlderHalf(points) {
  const half = Math.floor(points.length / 2);
  const older = points.slice(0, half).filter((_, i) => i % 2 === 0);
  points.splice(0, half, ...older);
}

function main() {
  return document.getElementById("main");
}

// -- sign-in and roles -------------------------------------------------------------------

// `exec` includes `submit`: both may submit and cancel (only `exec` may submit a command job).
function canSubmit() {
  return session.role === "submit" || session.role === "exec";
}

async function learnRole() {
  const response = await api("/v1/whoami");
  const me = await response.json();
  if (me.role === "none") {
    showSignIn();
    throw new SignInNeeded();
  }
  session.role = me.role;
  session.auth = me.auth;
  document.body.dataset.role = me.role;
  const who = document.getElementById("who");
  who.innerHTML = me.auth
    ? `${escape(me.role === "read" ? "reader" : me.role === "exec" ? "submitter (exec)" : "submitter")} · <a href="#" id="sign-out">sign out</a>`
    : `<span class="muted">no auth (--insecure)</span>`;
  const out = document.getElementById("sign-out");
  if (out) {
    out.addEventListener("click", (event) => {
      event.preventDefault();
      sessionStorage.removeItem(TOKEN_KEY);
      session.token = null;
      showSignIn();
    });
  }
}

function showSignIn() {
  stopPage();
  document.body.dataset.role = "none";
  document.getElementById("who").textContent = "";
  main().replaceChildren(document.getElementById("login-template").content.cloneNode(true));
  const form = document.getElementById("login");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    session.token = form.token.value.trim();
    try {
      await learnRole();
      sessionStorage.setItem(TOKEN_KEY, session.token);
      route();
    } catch (error) {
      if (error instanceof SignInNeeded) {
        document.querySelector('.field-error[data-field="token"]').textContent = "That token is not valid here.";
      }
    }
  });
}

// -- routing ------------------------------------------------------------------------------

function stopPage() {
  if (page) page.abort();
  page = new AbortController();
  return page.signal;
}

function route() {
  if (session.role === "none") return;
  const hash = location.hash || "#/";
  for (const link of document.querySelectorAll("[data-nav]")) link.classList.remove("active");
  const signal = stopPage();
  quietly(loadKinds().then(() => {
    if (!signal.aborted) showPage(hash, signal);
  }));
}

function showPage(hash, signal) {
  let match;
  if ((match = hash.match(/^#\/jobs\/([^/]+)$/))) return jobPage(decodeURIComponent(match[1]), signal);
  if (hash === "#/submit") return submitPage(signal);
  if (hash === "#/simulate") return simulatePage(signal);
  return jobsPage(signal);
}

function activate(name) {
  document.querySelector(`[data-nav="${name}"]`)?.classList.add("active");
}

// -- the jobs table ------------------------------------------------------------------------

function jobsPage(signal) {
  activate("jobs");
  main().innerHTML = `
    <section class="card">
      <div class="card-head">
        <h1>Jobs <span class="count" id="jobs-count">0</span></h1>
        <div class="filters">
          <select id="filter-state"><option value="">any state</option>${STATES.map((s) => `<option>${s}</option>`).join("")}</select>
          <select id="filter-kind"><option value="">any kind</option>${kindOptions()}</select>
          <input id="filter-label" placeholder="label key=value" size="18">
        </div>
      </div>
      <p class="field-error" data-field="label"></p>
      <table id="jobs" class="table">
        <thead><tr><th>job</th><th>state</th><th>kind</th><th class="num">workers</th><th>launcher</th><th>progress</th><th class="num">age</th></tr></thead>
        <tbody></tbody>
      </table>
      <p class="muted empty-note" hidden>No jobs yet. <a class="needs-submit" href="#/submit">Submit one.</a></p>
    </section>`;
  const filters = ["filter-state", "filter-kind", "filter-label"].map((id) => document.getElementById(id));
  let timer = null;
  let latest = null; // a newer load aborts the older, so a slow old answer never overwrites a newer one
  const refresh = async () => {
    clearTimeout(timer);
    latest?.abort();
    const load = (latest = new AbortController());
    const both = AbortSignal.any([signal, load.signal]);
    await quietly(loadJobs(filters, both));
    if (!both.aborted) timer = setTimeout(refresh, JOBS_REFRESH_MS);
  };
  for (const filter of filters) filter.addEventListener("change", refresh);
  signal.addEventListener("abort", () => clearTimeout(timer));
  refresh();
}

async function loadJobs([state, kind, labelFilter], signal) {
  const query = new URLSearchParams({ limit: "500" });
  if (state.value) query.set("state", state.value);
  if (kind.value) query.set("kind", kind.value);
  if (labelFilter.value.trim()) query.set("label", labelFilter.value.trim());
  const jobs = [];
  let token = null;
  const error = document.querySelector('.field-error[data-field="label"]');
  do {
    if (token) query.set("page_token", token);
    const response = await api(`/v1/jobs?${query}`, { signal });
    if (response.status === 422) {
      const message = (await response.json()).detail[0].msg;
      if (!signal.aborted) error.textContent = message;
      return;
    }
    const body = await response.json();
    jobs.push(...body.jobs);
    token = body.next_page_token;
  } while (token);
  if (signal.aborted) return;
  error.textContent = "";
  const now = Date.now() / 1000;
  jobs.sort((a, b) => b.submitted_at - a.submitted_at);
  const rows = jobs.map((job) => `
    <tr data-job="${escape(job.id)}">
      <td class="id"><a href="#/jobs/${encodeURIComponent(job.id)}">${escape(job.id)}</a></td>
      <td class="state" title="${escape(job.conditions[job.conditions.length - 1]?.reason)}">${badge(job.state)}${
        job.state === "FAILED" ? `<div class="why">${escape(job.conditions[job.conditions.length - 1]?.reason)}</div>` : ""}</td>
      <td class="kind">${escape(job.spec.kind)}</td>
      <td class="workers num">${job.spec.workers}</td>
      <td class="launcher">${escape(job.spec.launcher)}</td>
      <td class="progress">${progressCell(job)}</td>
      <td class="age num">${age(now - job.submitted_at)}</td>
    </tr>`);
  document.querySelector("#jobs tbody").innerHTML = rows.join("");
  document.getElementById("jobs-count").textContent = String(jobs.length);
  document.querySelector(".empty-note").hidden = jobs.length > 0;
}

// -- one job --------------------------------------------------------------------------------

function jobPage(jobId, signal) {
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
    this.curve = []; // {t, x, metrics}
    this.curveKind = { x: "round", t: "unix" };
    this.clocks = {}; // rank -> [[t, clock], ...] from etcd, while this page watches
    this.logged = {}; // rank -> [[t, clock], ...] from the trainers' output (every 0.5 s)
    this.slowest = []; // [t, slowest clock, slowest + bound]
    this.bound = null;
    this.gaps = {}; // clock gap to the slowest -> count (live)
    this.passageGaps = {}; // the same, as the trainers saw it at each step (final)
    this.reported = {}; // staleness the trainers reported (final)
    this.seen = new Set(); // events already listed
    this.dirty = false;
    this.logTimer = null;
    this.logLoad = null;
  }

  start() {
    const { signal } = this;
    quietly(this.followRecord());
    document.getElementById("log-rank").addEventListener("change", () => this.loadLogs());
    document.getElementById("curve-axis").addEventListener("change", () => this.markDirty());
    signal.addEventListener("abort", () => clearTimeout(this.logTimer));
    this.draw();
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
    this.bound = series.bound;
    this.curve = series.curve;
    this.curveKind = { x: series.curve_x, t: series.curve_t };
    for (const [rank, points] of Object.entries(series.clocks)) this.logged[rank] = points.slice();
    this.reported = series.staleness;
    this.passageGaps = series.gaps;
    series.events.forEach((event) => this.listMemberEvent(event));
    this.markDirty();
  }

  async followLive() {
    await stream(`/v1/jobs/${encodeURIComponent(this.jobId)}/live`, (name, data) => {
      const body = JSON.parse(data);
      if (name === "bound") this.bound = body.bound;
      else if (name === "clocks") this.addClocks(body.t, body.clocks);
      else if (name === "events") body.forEach((event) => this.addEvent(event));
    }, this.signal);
  }

  addClocks(t, clocks) {
    for (const [rank, clock] of Object.entries(clocks)) {
      const points = (this.clocks[rank] ||= []);
      points.push([t, clock]);
      if (points.length > MAX_CLOCK_POINTS) thinOlderHalf(points);
      window.dashboard.clocks[rank] = clock;
      window.dashboard.clockUpdates += 1;
    }
    const latest = Object.values(this.clocks).map((points) => points[points.length - 1][1]);
    const slowest = Math.min(...latest);
    for (const clock of latest) this.gaps[clock - slowest] = (this.gaps[clock - slowest] || 0) + 1;
    if (this.bound != null) this.slowest.push([t, slowest, slowest + this.bound]);
    this.markDirty();
  }

  addEvent(event) {
    if (["phase", "failed", "done"].includes(event.event)) this.listMemberEvent(event);
    if (event.event === "round" && event.rank === 0) {
      this.curve.push({ t: event.t, x: event.round, metrics: event.metrics || {} });
      this.curveKind = { x: "round", t: "unix" };
    } else if (event.event === "metrics") {
      this.curve.push({ t: event.t, x: event.n, metrics: { accuracy: event.accuracy, loss: event.loss } });
      this.curveKind = { x: "evaluation", t: "since start" };
    } else if (event.event === "report" && event.metrics && (event.rank ?? 0) === 0
               && Object.keys(event.metrics).length > 0) {
      // A program's own metrics (ctx.report), whatever their names.
      this.curve.push({ t: event.t, x: event.step ?? this.curve.length, metrics: event.metrics });
      this.curveKind = { x: "step", t: "unix" };
    } else if (event.event === "step") {
      (this.logged[event.rank] ||= []).push([event.t, event.clock]);
    } else if (event.event === "done") {
      for (const [behind, count] of Object.entries(event.result?.staleness || {})) {
        this.reported[behind] = (this.reported[behind] || 0) + count;
      }
    }
    this.markDirty();
  }

  markDirty() {
    if (this.dirty) return;
    this.dirty = true;
    requestAnimationFrame(() => {
      this.dirty = false;
      if (!this.signal.aborted) this.draw();
    });
  }

  draw() {
    this.drawCurve();
    this.drawClocks();
    this.drawStaleness();
  }

  drawCurve() {
    const names = [...new Set(this.curve.flatMap((p) => Object.keys(p.metrics)))];
    // Any kind's program may report metrics (ctx.report): their curve shows once there are some.
    if (names.length) document.querySelector('[data-shows="curve"]').hidden = false;
    const byRound = this.curveKind.x === "round";
    const reported = this.curveKind.x === "step"; // a program's own metrics (ctx.report)
    const axis = document.getElementById("curve-axis");
    axis.options[0].textContent = byRound ? "by round" : reported ? "by step" : "by evaluation";
    const byTime = axis.value === "t";
    const start = this.curveKind.t === "unix" && this.curve.length ? Math.min(...this.curve.map((p) => p.t)) : 0;
    const series = names.map((name, i) => ({
      name,
      color: PALETTE[i % PALETTE.length],
      points: this.curve.filter((p) => name in p.metrics).map((p) => [byTime ? p.t - start : p.x, p.metrics[name]]),
    }));
    document.getElementById("curve-title").textContent = !series.length ? "Learning curve"
      : byRound ? "Evaluation metrics" : reported ? "Reported metrics" : "Test accuracy and loss";
    lineChart(document.getElementById("chart-curve"), {
      series,
      xLabel: byTime ? "seconds since training began" : byRound ? "boosting round" : reported ? "step" : "evaluation",
      yLabel: "value",
      zero: true,
      integerX: !byTime,
      emptyText: "no evaluation yet",
    });
    const last = this.curve[this.curve.length - 1];
    document.getElementById("curve-latest").textContent = last
      ? "latest: " + Object.entries(last.metrics).map(([k, v]) => `${k} ${Number(v).toPrecision(4)}`).join(", ")
      : "";
  }

  drawClocks() {
    const ranks = [...new Set([...Object.keys(this.clocks), ...Object.keys(this.logged)])].sort((a, b) => a - b);
    const merged = Object.fromEntries(ranks.map((rank) => {
      const points = [...(this.logged[rank] || []), ...(this.clocks[rank] || [])];
      return [rank, points.sort((a, b) => a[0] - b[0])];
    }));
    const start = Math.min(...ranks.map((r) => merged[r][0]?.[0] ?? Infinity));
    const series = ranks.map((rank, i) => ({
      name: `rank ${rank}`,
      color: PALETTE[i % PALETTE.length],
      points: merged[rank].map(([t, clock]) => [t - start, clock]),
    }));
    const note = document.getElementById("clocks-note");
    note.textContent = this.bound == null
      ? "No bound: the method lets trainers drift apart freely (ASP), or the job has no step barrier."
      : `The method lets the fastest trainer be at most ${this.bound} step(s) ahead of the slowest (shaded, and dashed below).`;
    const band = this.bound == null || !this.slowest.length ? null : {
      name: "allowed",
      points: this.slowest.map(([t, low, high]) => [t - start, low, high]),
    };
    lineChart(document.getElementById("chart-clocks"), {
      series, band, xLabel: "seconds", yLabel: "step clock",
      emptyText: "no step clocks (only kinds with a step barrier have them)",
    });
    const gaps = this.gapSeries(Object.keys(this.clocks).sort((a, b) => a - b), start);
    if (this.bound != null && gaps.length) {
      const xs = gaps.flatMap((s) => s.points.map((p) => p[0]));
      gaps.push({ name: "bound", color: "#6b7280", dashed: true, points: [[Math.min(...xs), this.bound], [Math.max(...xs), this.bound]] });
    }
    lineChart(document.getElementById("chart-gaps"), {
      series: gaps, xLabel: "seconds", yLabel: "ahead of slowest", zero: true,
      emptyText: "clock lead over the slowest, drawn live while the job runs (the whole run: Staleness)",
    });
  }

  // Each trainer's steps ahead of the slowest, after every batch of clock changes (the
  // changes of one moment are applied together: one at a time would show false gaps).
  gapSeries(ranks, start) {
    const changes = ranks.flatMap((rank) => this.clocks[rank].map(([t, clock]) => [t, rank, clock]));
    changes.sort((a, b) => a[0] - b[0]);
    const latest = {};
    const out = Object.fromEntries(ranks.map((rank) => [rank, []]));
    const moments = changes.filter((change, i) => i === changes.length - 1 || changes[i + 1][0] !== change[0]).length;
    const stride = Math.max(1, Math.floor(moments / 1500)); // enough points to draw
    let moment = 0;
    changes.forEach(([t, rank, clock], i) => {
      latest[rank] = clock;
      if (i < changes.length - 1 && changes[i + 1][0] === t) return; // the same moment goes on
      moment += 1;
      if (Object.keys(latest).length < ranks.length || (moment % stride && i !== changes.length - 1)) return;
      const slowest = Math.min(...Object.values(latest));
      for (const r of ranks) out[r].push([t - start, latest[r] - slowest]);
    });
    return ranks.map((rank, i) => ({ name: `rank ${rank}`, color: PALETTE[i % PALETTE.length], points: out[rank] }));
  }

  drawStaleness() {
    const reported = Object.keys(this.reported).length > 0;
    const live = Object.keys(this.gaps).length > 0;
    const source = reported ? this.reported : live ? this.gaps : this.passageGaps;
    const keys = Object.keys(source).map(Number).sort((a, b) => a - b);
    const bins = keys.length ? Array.from({ length: keys[keys.length - 1] + 1 }, (_, i) => [String(i), source[i] || 0]) : [];
    document.getElementById("staleness-title").textContent = reported
      ? "How many versions behind the weights were that each training step used (the trainers' own count, at the end)."
      : live ? "How far each trainer was ahead of the slowest, at every clock change seen here."
      : "How far each trainer was ahead of the slowest when it began each step.";
    histogram(document.getElementById("chart-staleness"), {
      bins,
      xLabel: reported ? "versions behind" : "clock lead over the slowest",
      yLabel: reported ? "step count" : "observations",
      emptyText: "appears once trainers step",
    });
  }

  showRecord(record) {
    const first = this.record === null;
    this.record = record;
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
    this.showMembers(record);
    document.getElementById("conditions").innerHTML = record.conditions.map((c) =>
      `<li><span class="time">${clockTime(c.at)}</span>${badge(c.state)}<span>${escape(c.reason)}</span></li>`).join("");
    this.listEvents(record);
    if (first) this.loadLogs();
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

  showMembers(record) {
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
        <td class="address">${escape(m.address || "")}</td><td class="host">${escape(host)}</td>
        <td class="phase">${escape(phase)}</td>
        <td class="exit num ${exit !== "" && exit !== 0 ? "bad" : ""}">${exit}</td>
        <td class="failure">${escape(failure)}</td></tr>`;
    }).join("");
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
  }

  listEvents(record) {
    for (const c of record.conditions) this.listItem(c.at, `job ${c.state}: ${c.reason}`, `job:${c.state}:${c.at}`);
  }

  listMemberEvent(event) {
    const who = event.rank != null ? `rank ${event.rank}` : "a member";
    const text = event.event === "phase" ? `${who}: ${event.phase}`
      : event.event === "done" ? `${who}: done`
      : `${who} failed in ${event.phase} (${event.error}): ${event.message}`;
    this.listItem(event.t, text, `${event.event}:${event.rank}:${event.phase}:${event.t}`);
  }

  listItem(at, text, key) {
    if (this.seen.has(key)) return;
    this.seen.add(key);
    const list = document.getElementById("events");
    const li = document.createElement("li");
    li.dataset.at = String(at);
    li.innerHTML = `<span class="time">${clockTime(at)}</span><span>${escape(text)}</span>`;
    const later = [...list.children].find((item) => Number(item.dataset.at) < at);
    list.insertBefore(li, later || null); // newest first
  }

  async loadLogs() {
    clearTimeout(this.logTimer);
    this.logLoad?.abort(); // the rank may change while a load is out: only the newest shows
    const load = (this.logLoad = new AbortController());
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
      this.logTimer = setTimeout(() => this.loadLogs(), 2000);
    }
  }
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

// -- submitting --------------------------------------------------------------------------------

function submitPage(signal) {
  activate("submit");
  if (!canSubmit()) {
    main().innerHTML = `<section class="card narrow"><h1>Submit</h1><p>This token may only read.</p></section>`;
    return;
  }
  main().innerHTML = `
    <section class="card narrow">
      <h1>Submit a job</h1>
      <form id="submit-form" class="form">
        <label>Kind <select name="kind">${kindOptions(true)}</select></label>
        <p class="muted small" id="kind-description"></p>
        <p class="field-error" data-field="kind"></p>
        <label>Workers <input name="workers" type="number" min="1" value="2" required></label>
        <p class="field-error" data-field="workers"></p>
        <label>Parameters <span class="muted small">one key=value per line</span>
          <textarea name="params" rows="5"></textarea></label>
        <p class="field-error" data-field="params"></p>
        <details id="param-help"><summary class="small">parameters of this kind</summary>
          <table class="table small"><thead><tr><th>name</th><th>type</th><th>default</th><th>what</th></tr></thead><tbody></tbody></table>
        </details>
        <div id="spec-fields"></div>
        <div class="row">
          <label>Launcher <select name="launcher"><option value="">service default</option>${LAUNCHERS.map((l) => `<option>${l}</option>`).join("")}</select></label>
          <label>Restarts <input name="max_restarts" type="number" min="0" value="0"></label>
        </div>
        <p class="field-error" data-field="launcher"></p>
        <p class="field-error" data-field="max_restarts"></p>
        <label>Id <span class="muted small">optional</span> <input name="id" placeholder="generated"></label>
        <p class="field-error" data-field="id"></p>
        <p class="field-error" data-field="form"></p>
        <button id="submit-job" type="submit">Submit</button>
      </form>
    </section>`;
  const form = document.getElementById("submit-form");
  const describeKind = () => {
    const kind = kinds.byName.get(form.kind.value);
    if (!kind) return;
    form.params.placeholder = Object.entries(kind.example).map(([k, v]) => `${k}=${v}`).join("\n");
    document.getElementById("kind-description").textContent = kind.description;
    document.querySelector("#param-help tbody").innerHTML = kind.params.map((p) => `
      <tr data-param="${escape(p.name)}"><td>${escape(p.name)}</td>
        <td class="muted">${escape(p.choices.length ? p.choices.join("|") : p.type)}</td>
        <td>${escape(p.default ?? "")}</td><td>${escape(p.description)}</td></tr>`).join("");
    document.getElementById("spec-fields").innerHTML = kind.spec_fields.map((f) => `
      <label>${escape(f.name)} <span class="muted small">${escape(f.description)}${
        f.type === "list" ? ", a JSON list" : f.type === "map" ? ", a JSON object" : ""}</span>
        <input name="${escape(f.name)}" data-spec-field="${escape(f.type)}" autocomplete="off"></label>
      <p class="field-error" data-field="${escape(f.name)}"></p>`).join("");
  };
  form.kind.addEventListener("change", describeKind);
  describeKind();
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
    const params = {};
    for (const line of form.params.value.split("\n").map((l) => l.trim()).filter(Boolean)) {
      const at = line.indexOf("=");
      if (at <= 0) {
        form.querySelector('.field-error[data-field="params"]').textContent = `"${line}": expected key=value`;
        return;
      }
      params[line.slice(0, at).trim()] = line.slice(at + 1).trim();
    }
    const spec = { kind: form.kind.value, workers: Number(form.workers.value), params, max_restarts: Number(form.max_restarts.value || 0) };
    if (form.launcher.value) spec.launcher = form.launcher.value;
    for (const input of form.querySelectorAll("[data-spec-field]")) {
      const text = input.value.trim();
      if (!text) continue;
      if (input.dataset.specField === "text") {
        spec[input.name] = text;
        continue;
      }
      try {
        spec[input.name] = JSON.parse(text);
      } catch {
        form.querySelector(`.field-error[data-field="${input.name}"]`).textContent = `not JSON: ${text}`;
        return;
      }
    }
    if (form.id.value.trim()) spec.id = form.id.value.trim();
    const button = document.getElementById("submit-job");
    button.disabled = true;
    try {
      const response = await api("/v1/jobs", { method: "POST", json: spec, signal });
      const body = await response.json();
      if (response.ok) {
        location.hash = `#/jobs/${encodeURIComponent(body.id)}`;
        return;
      }
      showErrors(form, body.detail);
    } catch (error) {
      if (!(error instanceof SignInNeeded)) form.querySelector('.field-error[data-field="form"]').textContent = error.message;
    } finally {
      button.disabled = false;
    }
  });
}

function showErrors(form, detail) {
  const items = Array.isArray(detail) ? detail : [{ loc: ["body", "form"], msg: String(detail) }];
  for (const item of items) {
    const field = item.loc && item.loc.length > 1 ? item.loc[1] : "form";
    const slot = form.querySelector(`.field-error[data-field="${field}"]`) || form.querySelector('.field-error[data-field="form"]');
    slot.textContent = slot.textContent ? `${slot.textContent} ${item.msg}` : item.msg;
  }
}

// -- the simulator ------------------------------------------------------------------------------

function simulatePage(signal) {
  activate("simulate");
  if (!canSubmit()) {
    main().innerHTML = `<section class="card narrow"><h1>Simulator</h1><p>Running the simulator needs a submit token.</p></section>`;
    return;
  }
  main().innerHTML = `
    <section class="card">
      <h1>Simulator</h1>
      <p class="muted">Virtual workers under barrier methods, without etcd: how far each gets in the same time (the same code decides every wait as in live jobs).</p>
      <form id="simulate-form" class="form inline">
        <label>Methods <input name="barrier" value="bsp,ssp:2,pssp:2:8,asp" size="28"></label>
        <label>Workers <input name="workers" type="number" value="100" min="1" max="10000"></label>
        <label>Seconds <input name="seconds" type="number" value="100" min="1" max="1000"></label>
        <label>Step times <input name="delay" value="exp:1,1" size="16"></label>
        <label>Seed <input name="seed" type="number" value="0"></label>
        <button id="run-simulation" type="submit">Run</button>
      </form>
      <p class="field-error" data-field="barrier"></p><p class="field-error" data-field="workers"></p>
      <p class="field-error" data-field="seconds"></p><p class="field-error" data-field="delay"></p>
      <p class="field-error" data-field="form"></p>
      <div id="simulation-box"></div>
      <table id="simulation-table" class="table small"></table>
    </section>`;
  document.getElementById("simulation-box").append(makeSvg("chart-simulation", 1200, 380));
  lineChart(document.getElementById("chart-simulation"), { series: [], xLabel: "", yLabel: "", emptyText: "run a simulation" });
  const form = document.getElementById("simulate-form");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    for (const el of document.querySelectorAll(".field-error")) el.textContent = "";
    const request = {
      barrier: form.barrier.value, workers: Number(form.workers.value), seconds: Number(form.seconds.value),
      delay: form.delay.value, seed: Number(form.seed.value || 0),
    };
    const button = document.getElementById("run-simulation");
    button.disabled = true;
    button.textContent = "Running…";
    try {
      const response = await api("/v1/simulate", { method: "POST", json: request, signal });
      const body = await response.json();
      if (!response.ok) return showErrors(document.querySelector("main .card"), body.detail);
      const series = body.methods.map((m) => ({
        name: m.label,
        points: m.final_steps.map((step, i) => [step, (i + 1) / m.final_steps.length]),
      }));
      lineChart(document.getElementById("chart-simulation"), {
        series, xLabel: "final step", yLabel: "fraction of workers (CDF)", zero: true,
      });
      const columns = Object.keys(body.methods[0]?.summary || {});
      document.getElementById("simulation-table").innerHTML =
        `<thead><tr>${columns.map((c) => `<th>${escape(c.replace("_", " "))}${c === "mean_wait" ? " (s)" : ""}</th>`).join("")}</tr></thead>` +
        `<tbody>${body.methods.map((m) => `<tr>${columns.map((c) => `<td>${escape(m.summary[c])}</td>`).join("")}</tr>`).join("")}</tbody>`;
    } catch (error) {
      if (error.name !== "AbortError" && !(error instanceof SignInNeeded)) {
        document.querySelector('.field-error[data-field="form"]').textContent = error.message;
      }
    } finally {
      button.disabled = false;
      button.textContent = "Run";
    }
  });
}

// -- start ---------------------------------------------------------------------------------------

window.addEventListener("hashchange", route);
quietly(learnRole().then(route));
