// The simulator (#/simulate): virtual workers under barrier methods, run by the service
// (`POST /v1/simulate`), drawn as each method's distribution of final steps.

import { lineChart, makeSvg } from "./charts.js";
import { SignInNeeded, activate, api, canSubmit, escape, main, showErrors } from "./shared.js";

export function simulatePage(signal) {
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
