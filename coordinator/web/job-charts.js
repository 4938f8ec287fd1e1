// The job page's charts: its learning curve, its trainers' step clocks and their lead over
// the slowest, and its staleness. Fed by the job's series (its whole history, once final)
// and by its live stream (while it runs); drawn at most once a frame.

import { PALETTE, histogram, lineChart } from "./charts.js";

const MAX_CLOCK_POINTS = 4000; // per trainer: older points are thinned beyond this (long runs)

// Every other point of the older half goes: memory stays bounded, recent detail stays.
function thinOlderHalf(points) {
  const half = Math.floor(points.length / 2);
  const older = points.slice(0, half).filter((_, i) => i % 2 === 0);
  points.splice(0, half, ...older);
}

export class JobCharts {
  constructor(signal) {
    this.signal = signal;
    this.curve = []; // {t, x, metrics}
    this.curveKind = { x: "round", t: "unix" };
    this.clocks = {}; // rank -> [[t, clock], ...] from etcd, while this page watches
    this.logged = {}; // rank -> [[t, clock], ...] from the trainers' output (every 0.5 s)
    this.slowest = []; // [t, slowest clock, slowest + bound]
    this.bound = null;
    this.gaps = {}; // clock gap to the slowest -> count (live)
    this.passageGaps = {}; // the same, as the trainers saw it at each step (final)
    this.reported = {}; // staleness the trainers reported (final)
    this.dirty = false;
  }

  // The job's whole history, as `GET /v1/jobs/{id}/series` gives it.
  setSeries(series) {
    this.bound = series.bound;
    this.curve = series.curve;
    this.curveKind = { x: series.curve_x, t: series.curve_t };
    for (const [rank, points] of Object.entries(series.clocks)) this.logged[rank] = points.slice();
    this.reported = series.staleness;
    this.passageGaps = series.gaps;
    this.markDirty();
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

  // A member's event from the live stream: what it adds to the charts.
  addEvent(event) {
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
}
