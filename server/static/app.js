"use strict";
// The page of `kvdb serve`: the sessions, search with highlighted hits, a hit opened in its
// session, and a continuation streamed from the server. Archived text is user data: it enters
// the page only as text nodes (el() appends strings as text), never as HTML.

const KEY = "kvdb.apiKey"; // localStorage: the API key sent as a Bearer token when set
const AROUND_HIT = 160; // tokens of the session shown on each side of an opened hit
const $ = (id) => document.getElementById(id);
let shown = null; // the session view on the page: the body of GET /api/sessions/{id}
let listed = new Map(); // session id -> the session as listed

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function button(label, attrs, onClick) {
  const node = el("button", { type: "button", ...attrs }, label);
  node.addEventListener("click", onClick);
  return node;
}

async function api(path, init = {}) {
  const headers = new Headers(init.headers);
  const key = localStorage.getItem(KEY);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const res = await fetch(path, { ...init, headers });
  if (!res.ok) {
    const body = await res.json().catch(() => ({})); // errors as the OpenAI API sends them
    const hint = res.status === 401 ? " (enter the key in the API key field above)" : "";
    throw new Error(`${res.status}: ${body.error?.message ?? res.statusText}${hint}`);
  }
  return res;
}

const getJSON = async (path) => (await api(path)).json();
function sessionPath(id, range = {}) {
  const query = new URLSearchParams(range).toString();
  return `/api/sessions/${encodeURIComponent(id)}${query && "?" + query}`;
}

function status(message) {
  $("status").textContent = message;
}

async function run(task) {
  status("");
  document.body.classList.add("busy");
  try {
    await task();
  } catch (err) {
    status(err.message);
  } finally {
    document.body.classList.remove("busy");
  }
}

async function loadSessions() {
  const { sessions } = await getJSON("/api/sessions");
  listed = new Map(sessions.map((s) => [s.session_id, s]));
  $("sessions").replaceChildren(
    ...sessions.map((s) => {
      const when = s.created_at.slice(0, 16).replace("T", " ");
      const open = button(el("span", { class: "name" }, s.name), { "data-testid": "session", "data-session-id": s.session_id, title: s.source }, () =>
        run(() => openSession(s.session_id)),
      );
      open.append(el("span", { class: "meta" }, `${s.n_tokens} tokens · ${when}`));
      return el("li", {}, open);
    }),
  );
  if (!sessions.length) status("The archive is empty: ingest transcripts with `kvdb ingest PATH`.");
}

// text split around the part of it that falls in highlight, [from, to) in characters of the
// view's text; offset: where text starts in the view's text
function marked(text, offset, highlight) {
  const lo = Math.max(0, highlight[0] - offset);
  const hi = Math.min(text.length, highlight[1] - offset);
  if (offset < 0 || lo >= hi) return [text];
  return [text.slice(0, lo), el("mark", {}, text.slice(lo, hi)), text.slice(hi)];
}

function renderSession(view, highlight, at) {
  shown = view;
  $("session").hidden = false;
  $("session-title").textContent = view.session.name;
  $("session-range").firstElementChild.textContent = `tokens ${view.start}–${view.end} of ${view.session.n_tokens}`;
  $("session-all").hidden = view.start === 0 && view.end === view.session.n_tokens;
  $("continue-at").max = view.session.n_tokens;
  $("continue-at").value = at;
  $("reply").replaceChildren();
  let cursor = 0; // turns are pieces of the view's text, in order
  $("turns").replaceChildren(
    ...view.turns.map((turn) => {
      const offset = view.text.indexOf(turn.text, cursor);
      if (offset >= 0) cursor = offset + turn.text.length;
      const here = button("continue here", { class: "here", title: `continue after token ${turn.end}` }, () => {
        $("continue-at").value = turn.end;
        $("continue-prompt").focus();
      });
      return el(
        "article",
        { class: "turn", "data-testid": "turn", "data-role": turn.role ?? "text" },
        el("header", {}, turn.role ?? "text", here),
        el("div", { class: "text" }, ...marked(turn.text, offset, highlight)),
      );
    }),
  );
  const mark = $("turns").querySelector("mark");
  if (mark) mark.scrollIntoView({ block: "center" });
  else $("session").scrollIntoView();
}

async function openSession(id) {
  const view = await getJSON(sessionPath(id));
  renderSession(view, [0, 0], view.end);
}

// the hit's session around its position, the match marked: its first character is where the
// text of the tokens before the hit ends; the composer is set to continue after the match
async function openHit(hit) {
  const end = hit.position + hit.match_tokens;
  const start = Math.max(0, hit.position - AROUND_HIT);
  const [view, lead, match] = await Promise.all([
    getJSON(sessionPath(hit.session_id, { start, end: Math.min(end + AROUND_HIT, listed.get(hit.session_id).n_tokens) })),
    getJSON(sessionPath(hit.session_id, { start, end: hit.position })),
    getJSON(sessionPath(hit.session_id, { start: hit.position, end })), // as the view renders it: a chunk's snippet leaves template tokens out
  ]);
  renderSession(view, [lead.text.length, lead.text.length + match.text.length], end);
}

// one click from a hit to the composer: the hit opened, the reply to come after it
async function continueFromHit(hit) {
  await openHit(hit);
  $("continue-prompt").focus();
}

// a hit by meaning has a fused score and no exact match; a phrase hit is exact or partial
function gradeOf(hit, semantic) {
  if (semantic) return `score ${hit.score.toFixed(3)}`;
  return hit.partial ? `partial: ${hit.match_tokens}/${hit.query_tokens} tokens` : "exact";
}

async function search(q, semantic) {
  // the list again too: the hits' sessions are listed, with their lengths, for openHit
  const query = new URLSearchParams({ q, k: 10, semantic: semantic ? 1 : 0 });
  const [{ hits }] = await Promise.all([getJSON(`/api/search?${query}`), loadSessions()]);
  $("hits").replaceChildren(
    ...hits.map((hit) => {
      const grade = gradeOf(hit, semantic);
      return el(
        "li",
        { class: hit.partial ? "hit partial" : "hit", "data-testid": "hit" },
        el(
          "div",
          { class: "meta" },
          el("span", { class: "name" }, hit.name),
          ` @${hit.position} · `,
          el("span", { class: "grade" }, grade),
          button("open", { "data-testid": "hit-open" }, () => run(() => openHit(hit))),
          button("continue from here", { "data-testid": "hit-continue", title: `continue after token ${hit.position + hit.match_tokens}` }, () =>
            run(() => continueFromHit(hit)),
          ),
        ),
        el("p", { class: "snippet" }, hit.before, el("mark", {}, hit.match), hit.after),
      );
    }),
  );
  if (!hits.length) status(semantic ? `nothing found by meaning for “${q}”` : `no match for “${q}”`);
}

// POST /v1/chat/completions with stream: server-sent events, one `data: {chunk}` line each,
// the last `data: [DONE]`; each chunk's delta is appended to the reply as it arrives
async function continueSession(at, prompt) {
  const reply = $("reply");
  reply.replaceChildren();
  const res = await api("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      model: "kvdb",
      messages: [{ role: "user", content: prompt }],
      stream: true,
      max_tokens: 64,
      kvdb: { session: shown.session.session_id, at },
    }),
  });
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const lines = (pending + value).split("\n");
    pending = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return reader.cancel();
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      reply.append(chunk.choices[0]?.delta?.content ?? "");
    }
  }
}

$("api-key").value = localStorage.getItem(KEY) ?? "";
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
  run(loadSessions);
});
$("search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  run(() => search($("search-q").value, $("search-meaning").checked));
});
$("session-all").addEventListener("click", () => run(() => openSession(shown.session.session_id)));
$("continue-form").addEventListener("submit", (event) => {
  event.preventDefault();
  run(() => continueSession(Number($("continue-at").value), $("continue-prompt").value));
});
run(loadSessions);
