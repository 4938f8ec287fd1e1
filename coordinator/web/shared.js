// What every view shares: the session (token and role), the API with the token (and its
// Server-Sent Events, read with fetch: EventSource cannot send a token), the job kinds,
// the current page's lifetime, and small formatting and DOM helpers.

export const FINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

// The token (set at start: from the link or the tab's storage) and what it may do.
export const session = { token: null, role: "none", auth: false };
// The job kinds, as `GET /v1/kinds` describes them: this page names none of its own.
export const kinds = { list: [], byName: new Map() };
let page = null; // the current page's AbortController: its requests and timers stop with it
let signInNeeded = () => {}; // what a 401 does (ask for a token): set by the entry module

export class SignInNeeded extends Error {}

// The entry module's answer to a 401: here, so this module needs no view's.
export function onSignInNeeded(handler) {
  signInNeeded = handler;
}

// -- talking to the API --------------------------------------------------------------

export async function api(path, { method = "GET", json, signal, accept } = {}) {
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
    signInNeeded();
    throw new SignInNeeded();
  }
  return response;
}

// Server-Sent Events over fetch: calls onEvent(name, data) until the stream ends.
export async function stream(path, onEvent, signal) {
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

export async function loadKinds() {
  if (kinds.list.length) return;
  const response = await api("/v1/kinds");
  if (!response.ok) throw new Error(`/v1/kinds: ${response.status}`);
  const body = await response.json();
  kinds.list = body.kinds;
  kinds.byName = new Map(body.kinds.map((kind) => [kind.name, kind]));
}

// The kinds this token may submit (all of them, to filter or read).
export function kindOptions(forSubmit = false) {
  return kinds.list
    .filter((kind) => !forSubmit || !kind.needs_exec || session.role === "exec")
    .map((kind) => `<option value="${escape(kind.name)}">${escape(kind.name)}</option>`).join("");
}

export function quietly(promise) {
  return promise.catch((error) => {
    if (error.name !== "AbortError" && !(error instanceof SignInNeeded)) console.warn(error.message);
  });
}

// `exec` includes `submit`: both may submit and cancel (only `exec` may submit a command job).
export function canSubmit() {
  return session.role === "submit" || session.role === "exec";
}

// Ends the current page (its requests and timers) and starts the next: its signal.
export function stopPage() {
  if (page) page.abort();
  page = new AbortController();
  return page.signal;
}

// -- small helpers ---------------------------------------------------------------------

export function escape(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

export function age(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function clockTime(unix) {
  return new Date(unix * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

export function badge(state) {
  return `<span class="badge state-${escape(state).toLowerCase()}">${escape(state)}</span>`;
}

export function progressCell(record) {
  const { step, total } = record.progress || {};
  if (step == null) return `<span class="muted">–</span>`;
  const fraction = total ? Math.min(1, step / total) : 0;
  const text = total ? `${step} / ${total}` : `${step}`;
  return `<div class="bar"><div style="width:${(fraction * 100).toFixed(1)}%"></div></div><span class="bar-text">${escape(text)}</span>`;
}

export function main() {
  return document.getElementById("main");
}

// Marks the top bar's link of the page shown.
export function activate(name) {
  document.querySelector(`[data-nav="${name}"]`)?.classList.add("active");
}

// The API's refusal (422 details, or one message) beside the fields it names.
export function showErrors(form, detail) {
  const items = Array.isArray(detail) ? detail : [{ loc: ["body", "form"], msg: String(detail) }];
  for (const item of items) {
    const field = item.loc && item.loc.length > 1 ? item.loc[1] : "form";
    const slot = form.querySelector(`.field-error[data-field="${field}"]`) || form.querySelector('.field-error[data-field="form"]');
    slot.textContent = slot.textContent ? `${slot.textContent} ${item.msg}` : item.msg;
  }
}
