// The jobs table (#/): every job, newest first, refreshed every few seconds, narrowed by
// state, kind and label.

import { activate, age, api, badge, escape, kindOptions, main, progressCell, quietly } from "./shared.js";

const STATES = ["PENDING", "STARTING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED"];
const JOBS_REFRESH_MS = 2000;

export function jobsPage(signal) {
  activate("jobs");
  main().innerHTML = `
    <section class="card">
      <div class="card-head">
        <h1>Jobs <span class="count" id="jobs-count" title="loading">…</span></h1>
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
  const count = document.getElementById("jobs-count");
  count.textContent = String(jobs.length);
  count.removeAttribute("title");
  document.querySelector(".empty-note").hidden = jobs.length > 0;
}
