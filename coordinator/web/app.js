// The dashboard: a page per route (#/, #/jobs/<id>, #/submit, #/simulate), fed by the
// REST API with the user's token. Nothing is loaded from anywhere but this service.
// This entry module signs in and routes; each view is an ES module of its own, loaded
// by the browser as it is (no build step).

import { jobPage } from "./job.js";
import { jobsPage } from "./jobs.js";
import { loadKinds, onSignInNeeded, quietly, session, stopPage } from "./shared.js";
import { afterSignIn, learnRole, restoreToken, showSignIn } from "./signin.js";
import { simulatePage } from "./simulate.js";
import { submitPage } from "./submit.js";

restoreToken();
window.dashboard = { clocks: {}, clockUpdates: 0 };

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

onSignInNeeded(showSignIn);
afterSignIn(route);
window.addEventListener("hashchange", route);
quietly(learnRole().then(route));
