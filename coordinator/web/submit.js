// Submitting a job (#/submit): a form built from the kind's description in /v1/kinds
// (its parameters and spec fields), the API's refusals shown beside their fields.

import { SignInNeeded, activate, api, canSubmit, escape, kindOptions, kinds, main, showErrors } from "./shared.js";

const LAUNCHERS = ["local", "docker", "agents", "kubernetes"];

export function submitPage(signal) {
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
