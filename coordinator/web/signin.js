// Signing in: the token from the link `coordinator serve` prints (or the tab's storage),
// the role it carries (shown in the top bar), and the form that asks for a token.

import { SignInNeeded, api, escape, main, session, stopPage } from "./shared.js";

const TOKEN_KEY = "coordinator-token";
let signedIn = () => {}; // what follows a sign-in through the form: set by the entry module

export function afterSignIn(next) {
  signedIn = next;
}

// `coordinator serve` prints a link with its token in the fragment (#token=...), which the
// browser never sends: keep it for this session, and take it out of the address bar and the
// history at once, so it is neither bookmarked nor shown over a shoulder. A link to a page
// carries its route after the token (#token=...&/jobs/<id>), and lands there.
function tokenFromLink() {
  const match = location.hash.match(/^#token=([^&]+)(?:&(\/.*))?$/);
  if (!match) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
  history.replaceState(null, "", `${location.pathname}${location.search}#${match[2] || "/"}`);
}

// The session's token at start: the link's, else the one this tab kept.
export function restoreToken() {
  tokenFromLink();
  session.token = sessionStorage.getItem(TOKEN_KEY);
}

export async function learnRole() {
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

export function showSignIn() {
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
      signedIn();
    } catch (error) {
      if (error instanceof SignInNeeded) {
        document.querySelector('.field-error[data-field="token"]').textContent = "That token is not valid here.";
      }
    }
  });
}
