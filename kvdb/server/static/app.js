"use strict";
// The page of `kvdb serve`: a chat over the archive. The conversations (recent first, filtered,
// searched by phrase or by meaning), one conversation's turns as chat turns, a composer whose
// reply is streamed in place, "Continue from here" on any turn (a branch), and under each reply
// how its start was restored. Archived text is user data: it enters the page only as text nodes
// (el() appends strings as text), never as HTML.

const KEY = "kvdb.apiKey"; // localStorage: the API key sent as a Bearer token when set
const MAX_TOKENS = 256; // of a reply
const ARCHIVE_SETTLE_MS = [1500, 5000]; // the server archives an exchange a few seconds after its reply
const PAGE = 100; // conversations asked for at a time: a whole history's tens of thousands only as the reader asks
const NARROW = window.matchMedia("(max-width: 760px)");
const $ = (id) => document.getElementById(id);
const number = new Intl.NumberFormat("en-US");
const BANNER = $("branch-banner"); // shown in the turns, where a branch starts

// The conversation on the page. conv: GET /api/conversations/{id} (null for a new chat not yet
// opened from the list); id: its conversation id (a new chat's comes with its first reply);
// version: the session (version) shown; archived: that version's turns; added: the messages
// sent and replied on the page since it was opened (or since the branch point), which the
// server appends to the version (or to its first fork.at tokens); fork: {at, index} of a branch.
let chat = blankChat();
let listed = []; // the conversations listed
let nextOffset = null; // where the list's next page starts (null: the filters admit no more)
const reports = new WeakMap(); // a reply's message -> the kvdb report of its final chunk
let highlight = null; // {index, from, to}: characters of a turn's text marked (a search hit)
let refreshTimers = [];

function blankChat() {
  return { conv: null, id: null, version: null, archived: [], added: [], fork: null };
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) if (value !== undefined && value !== null) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function button(label, attrs, onClick) {
  const node = el("button", { type: "button", ...attrs }, ...[label].flat());
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
const sendJSON = async (method, path, body) =>
  (await api(path, { method, headers: { "Content-Type": "application/json" }, body: body === undefined ? undefined : JSON.stringify(body) })).json();
const ref = (id) => encodeURIComponent(id);

function status(message, error = false) {
  $("status").textContent = message;
  $("status").classList.toggle("error", error);
}

async function run(task) {
  status("");
  document.body.classList.add("busy");
  try {
    await task();
  } catch (err) {
    status(err.message, true);
  } finally {
    document.body.classList.remove("busy");
  }
}

// a project that is a folder by its last part (the whole path in the filter's list)
const shortProject = (project) => (project ? project.replace(/\/+$/, "").split("/").pop() || project : null);
const when = (iso) => (iso ? iso.slice(0, 16).replace("T", " ") : "");
const plural = (n, word) => `${number.format(n)} ${word}${n === 1 ? "" : "s"}`;

// ---- the list ----

function filters() {
  const params = {};
  for (const name of ["agent", "project", "since", "until"]) {
    const value = $(`filter-${name}`).value.trim();
    if (value) params[name] = value;
  }
  return params;
}

// The list's first page, or (more) the next one after those listed.
async function loadList(more = false) {
  const params = filters();
  const filtered = Object.keys(params).length > 0;
  const offset = more ? nextOffset : 0;
  const query = new URLSearchParams({ ...params, limit: PAGE, offset }).toString();
  const page = await getJSON(`/api/conversations?${query}`);
  listed = more ? [...listed, ...page.conversations] : page.conversations;
  nextOffset = page.next_offset ?? null;
  if (!filtered) {
    // suggestions from the conversations listed so far
    fillOptions("agents", listed.map((c) => c.agent));
    fillOptions("projects", listed.map((c) => c.project));
  }
  renderList();
  const left = nextOffset === null ? 0 : page.total - nextOffset;
  $("more-conversations").hidden = left === 0;
  $("more-conversations").textContent = `Show ${number.format(Math.min(left, PAGE))} more of ${number.format(left)}`;
  if (!listed.length) status(filtered ? "no conversation matches the filters" : "No conversations yet: start one below, or ingest transcripts with `kvdb ingest PATH`.");
}

function fillOptions(id, values) {
  const known = [...new Set(values.filter(Boolean))].sort();
  $(id).replaceChildren(...known.map((v) => el("option", { value: v })));
}

function renderList() {
  $("conversations").replaceChildren(
    ...listed.map((c) => {
      const title = c.title || c.name || c.conversation_id;
      const facts = [c.agent, shortProject(c.project), plural(c.n_tokens, "token"), when(c.updated_at)];
      if (c.versions > 1) facts.push(plural(c.versions, "version"));
      const open = button(
        [el("span", { class: "name" }, title), el("span", { class: "meta" }, facts.filter(Boolean).join(" · "))],
        { class: "open", "data-testid": "conversation", "data-conversation-id": c.conversation_id, "data-session-id": c.session_id },
        () => run(() => openConversation(c.conversation_id)),
      );
      if (c.conversation_id === chat.id) open.setAttribute("aria-current", "true");
      return el("li", {}, open);
    }),
  );
}

function refreshSoon() {
  // the list now, and again as the server archives the exchange (a failure here says nothing:
  // the next action that fails says why)
  for (const timer of refreshTimers) clearTimeout(timer);
  refreshTimers = [0, ...ARCHIVE_SETTLE_MS].map((ms) => setTimeout(() => loadList().catch(() => {}), ms));
}

function setListOpen(open) {
  document.body.classList.toggle("list-open", open);
  $("list-toggle").setAttribute("aria-expanded", String(open));
}

// ---- a conversation ----

async function openConversation(id, { version = null, hit = null } = {}) {
  const conv = await getJSON(`/api/conversations/${ref(id)}`);
  const shown = version ?? conv.session_id;
  const view = await getJSON(`/api/sessions/${ref(shown)}`);
  chat = { conv, id: conv.conversation_id, version: shown, archived: view.turns, added: [], fork: null };
  highlight = hit ? locate(hit, view.turns) : null;
  renderChat();
  renderList();
  if (NARROW.matches) setListOpen(false);
  const target = $("turns").querySelector("mark, .hit-turn");
  if (target) {
    target.scrollIntoView({ block: "center" });
  } else {
    $("turns").lastElementChild?.scrollIntoView({ block: "end" });
  }
  $("turns").focus({ preventScroll: true });
}

// The turn holding a hit's first token, and the hit's match in its text where it is found there
// (a hit by meaning is a chunk, which may cross turns: then the turn is marked whole).
function locate(hit, turns) {
  let index = turns.findIndex((t) => t.start <= hit.position && hit.position < t.end);
  if (index < 0) index = Math.max(0, turns.findLastIndex((t) => t.start <= hit.position));
  const text = turns[index]?.text ?? "";
  const match = hit.match ?? "";
  if (match) {
    const lead = (hit.before ?? "").slice(-40);
    let at = lead ? text.indexOf(lead + match) : -1;
    if (at >= 0) at += lead.length;
    else at = text.indexOf(match);
    if (at < 0) at = text.toLowerCase().indexOf(match.toLowerCase());
    if (at >= 0) return { index, from: at, to: at + match.length };
  }
  return { index, from: 0, to: 0 };
}

// the turns on the page: the version's (up to a branch's point), an empty system turn left out,
// then those added on the page; index: a version's turn's place in it
function turnsShown() {
  const archived = (chat.fork ? chat.archived.slice(0, chat.fork.index + 1) : chat.archived).map((t, index) => ({ role: t.role, text: t.text, end: t.end, index }));
  const added = chat.added.map((m) => ({ role: m.role, text: m.content, message: m }));
  return [...archived.filter((t) => t.role !== "system" || t.text.trim()), ...added];
}

function renderChat() {
  const c = chat.conv;
  const title = c ? c.title || c.name || c.conversation_id : chat.id ? "New chat (being archived)" : "New chat";
  $("chat-title").textContent = title;
  $("chat").dataset.conversationId = chat.id ?? "";
  $("chat").dataset.sessionId = chat.version ?? "";
  for (const id of ["rename", "delete"]) $(id).hidden = !chat.id;
  $("rename-form").hidden = true;
  $("delete-confirm").hidden = true;
  renderVersions();
  if (c) {
    const facts = [c.agent && `agent ${c.agent}`, c.project && `project ${shortProject(c.project)}`, plural(c.n_tokens, "token")];
    facts.push(plural(c.versions ?? 1, "version"));
    const fork = branchPoint(chat.version);
    if (fork) facts.push(fork);
    if (c.branches > 1) facts.push(`${number.format(c.branches)} branches`); // leaves: 1 for a conversation never branched
    facts.push(`updated ${when(c.updated_at)}`);
    $("chat-meta").textContent = facts.filter(Boolean).join(" · ");
  } else {
    $("chat-meta").textContent = chat.id ? "Archived a few seconds after each reply." : "Type a message below to start a conversation.";
  }
  const shown = turnsShown().map((turn, i) => renderTurn(turn, i + 1));
  if (chat.fork) {
    // the banner where the branch starts: after the turn it continues from
    $("branch-text").textContent = `Branch from turn ${chat.fork.number}: the turns after it are replaced by the new branch.`;
    shown.splice(chat.fork.number, 0, BANNER);
  }
  BANNER.hidden = !chat.fork;
  $("turns").replaceChildren(...shown);
}

// "v2 branch of v1 at token 115" for a version that forks, else null: the meta line says where,
// the menu's options only from which (a whole option did not fit a narrow menu)
function branchPoint(sessionId) {
  const history = chat.conv?.history ?? [];
  const version = history.find((v) => v.session_id === sessionId);
  const parent = version?.branch_of && history.find((v) => v.session_id === version.branch_of);
  if (!parent) return null;
  return `v${version.version} branch of v${parent.version}${version.forked_at != null ? ` at token ${number.format(version.forked_at)}` : ""}`;
}

function renderVersions() {
  const history = chat.conv?.history ?? [];
  $("version-label").hidden = history.length < 2;
  const byId = new Map(history.map((v) => [v.session_id, v]));
  $("version").replaceChildren(
    ...[...history]
      .sort((a, b) => a.version - b.version)
      .map((v) => {
        const parts = [`v${v.version}`];
        if (v.latest) parts.push("latest");
        if (v.branch_of && byId.has(v.branch_of)) parts.push(`branch of v${byId.get(v.branch_of).version}`);
        parts.push(plural(v.n_tokens, "token"));
        const option = el("option", { value: v.session_id }, parts.join(" · "));
        option.selected = v.session_id === chat.version;
        return option;
      }),
  );
}

const ROLE_NAMES = { user: "You", assistant: "Assistant", system: "System", tool: "Tool", text: "Text" };

function renderTurn(turn, number) {
  const role = turn.role ?? "text";
  const head = el("div", { class: "turn-head" }, el("span", { class: "role" }, ROLE_NAMES[role] ?? role));
  if (turn.end !== undefined) {
    head.append(
      button("Continue from here", { class: "here", "data-testid": "fork", "aria-label": `Continue from turn ${number}`, title: `a new branch after token ${turn.end}` }, () =>
        startFork(turn.index, number),
      ),
    );
  }
  const mark = highlight && !chat.fork && turn.end !== undefined && highlight.index === turn.index ? highlight : null;
  const node = el("article", { class: "turn", "data-testid": "turn", "data-role": role, "aria-label": `Turn ${number}, ${ROLE_NAMES[role] ?? role}` }, head);
  if (mark) node.classList.add("hit-turn");
  node.append(el("div", { class: "body" }, ...parts(role, turn.text, mark)));
  const report = turn.message && reports.get(turn.message);
  if (report) node.append(el("p", { class: "restored", "data-testid": "restored" }, restoredText(report)));
  return node;
}

// ---- a turn's text: thinking, tool calls and results folded, the rest as text ----

const THINKING = /^<thinking>\n?([\s\S]*?)\n?<\/thinking>\n?/d;
const TOOL_CALL = /<tool_call\b([^>]*)>([\s\S]*?)<\/tool_call>\n?/dg;
const TOOL_RESULT = /^\s*<tool_result\b([^>]*)>\n?([\s\S]*?)\n?<\/tool_result>\s*$/d;

function attributes(text) {
  const found = {};
  for (const m of text.matchAll(/([\w-]+)=(?:"([^"]*)"|'([^']*)'|([^\s>]+))/g)) found[m[1]] = m[2] ?? m[3] ?? m[4];
  return found;
}

// text with the part of it in mark ([from, to) in characters of the turn's text) in a <mark>;
// offset: where text starts in the turn's text
function marked(text, offset, mark) {
  if (!mark || mark.to <= mark.from) return [text];
  const lo = Math.max(0, mark.from - offset);
  const hi = Math.min(text.length, mark.to - offset);
  if (lo >= hi) return [text];
  return [text.slice(0, lo), el("mark", {}, text.slice(lo, hi)), text.slice(hi)];
}

function fold(kind, summary, text, offset, mark, open = false) {
  const details = el("details", { class: kind, "data-testid": kind }, el("summary", {}, summary), el("pre", {}, ...marked(text, offset, mark)));
  details.open = open || (mark && mark.to > mark.from && mark.from < offset + text.length && mark.to > offset);
  return details;
}

function parts(role, text, mark) {
  const out = [];
  if (role === "tool") {
    const m = TOOL_RESULT.exec(text);
    const name = m ? attributes(m[1]).name : null;
    out.push(fold("tool-result", name ? `Tool result: ${name}` : "Tool result", m ? m[2] : text, m ? m.indices[2][0] : 0, mark));
    return out;
  }
  let cursor = 0;
  const thinking = THINKING.exec(text);
  if (thinking) {
    out.push(fold("thinking", "Thinking", thinking[1], thinking.indices[1][0], mark));
    cursor = thinking[0].length;
  }
  const plain = (from, to) => {
    const piece = text.slice(from, to);
    if (piece.trim()) out.push(el("div", { class: "text" }, ...marked(piece, from, mark)));
  };
  TOOL_CALL.lastIndex = cursor;
  for (const m of text.matchAll(TOOL_CALL)) {
    if (m.index < cursor) continue;
    plain(cursor, m.index);
    const name = attributes(m[1]).name;
    out.push(fold("tool-call", name ? `Tool call: ${name}` : "Tool call", m[2], m.indices[2][0], mark));
    cursor = m.index + m[0].length;
  }
  plain(cursor, text.length);
  if (!out.length) out.push(el("div", { class: "text" }, ""));
  return out;
}

function restoredText(k) {
  const tokens = plural(k.cached_tokens ?? 0, "token");
  if (k.restored === "exact") return `Started from ${tokens} already computed (exact).`;
  if (k.restored === "archive") return `Started from ${tokens} restored from the archive (${k.fidelity ?? "approximate"}).`;
  return "Computed the whole prompt: none of it was cached.";
}

// ---- continuing: a branch, the composer, the streamed reply ----

function startFork(index, number) {
  chat.fork = { index, number, at: chat.archived[index].end };
  chat.added = [];
  highlight = null;
  renderChat();
  $("branch-banner").scrollIntoView({ block: "nearest" });
  $("prompt").focus();
}

function cancelFork() {
  chat.fork = null;
  chat.added = [];
  renderChat();
  $("prompt").focus();
}

function newChat() {
  chat = blankChat();
  highlight = null;
  renderChat();
  renderList();
  if (NARROW.matches) setListOpen(false);
  $("prompt").focus();
}

function requestBody() {
  const kvdb = {};
  if (chat.version) kvdb.session = chat.version;
  if (chat.fork) kvdb.at = chat.fork.at;
  if (chat.id) kvdb.conversation = chat.id;
  return { model: "kvdb", messages: chat.added.map((m) => ({ role: m.role, content: m.content })), stream: true, max_tokens: MAX_TOKENS, kvdb };
}

async function send(text) {
  const message = { role: "user", content: text };
  chat.added.push(message);
  highlight = null;
  renderChat();
  const live = el("article", { class: "turn streaming", "data-testid": "turn", "data-role": "assistant", "aria-busy": "true" });
  const body = el("div", { class: "text" });
  live.append(el("div", { class: "turn-head" }, el("span", { class: "role" }, ROLE_NAMES.assistant)), el("div", { class: "body" }, body));
  $("turns").append(live);
  live.scrollIntoView({ block: "end" });
  $("send").disabled = true;
  let reply;
  try {
    reply = await stream(requestBody(), (delta) => {
      body.append(delta);
      live.scrollIntoView({ block: "end" });
    });
  } catch (err) {
    chat.added.pop(); // not sent: back to the composer
    $("prompt").value = text;
    renderChat();
    throw err;
  } finally {
    $("send").disabled = false;
  }
  const answer = { role: "assistant", content: reply.text };
  chat.added.push(answer);
  if (reply.kvdb) {
    reports.set(answer, reply.kvdb);
    chat.id = reply.kvdb.conversation_id ?? chat.id;
  }
  renderChat();
  $("turns").lastElementChild.scrollIntoView({ block: "end" });
  refreshSoon();
}

// POST /v1/chat/completions with stream: server-sent events, one `data: {chunk}` line each, the
// last `data: [DONE]`; each chunk's delta goes to onDelta as it arrives, the last chunk's kvdb
// report is returned with the whole text
async function stream(body, onDelta) {
  const res = await api("/v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  const reply = { text: "", kvdb: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return reply;
    const lines = (pending + value).split("\n");
    pending = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") {
        await reader.cancel();
        return reply;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.kvdb) reply.kvdb = chunk.kvdb;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply.text += delta;
        onDelta(delta);
      }
    }
  }
}

// ---- search ----

function gradeOf(hit, semantic) {
  if (semantic) return `score ${hit.score.toFixed(3)}${hit.weak ? ", weak" : ""}`;
  return hit.partial ? `partial: ${hit.match_tokens}/${hit.query_tokens} tokens` : "exact";
}

// the search's state under its form: searching (a spinner), then how many hits or that none
function searchState(text, busy = false) {
  $("search-state").textContent = text;
  $("search-state").classList.toggle("searching", busy);
  $("hits").setAttribute("aria-busy", String(busy));
  $("search-form").querySelector("button[type=submit]").disabled = busy;
}

async function search(q, semantic) {
  const query = new URLSearchParams({ q, k: 10, semantic: semantic ? 1 : 0 });
  $("hits").replaceChildren();
  searchState(semantic ? "Searching by meaning…" : "Searching…", true);
  let hits;
  try {
    ({ hits } = await getJSON(`/api/search?${query}`));
  } catch (err) {
    searchState("");
    throw err;
  }
  $("search-clear").hidden = false;
  $("hits").replaceChildren(
    ...hits.map((hit) => {
      const title = hit.title || hit.name;
      return el(
        "li",
        { class: hit.partial ? "hit partial" : "hit", "data-testid": "hit", "data-conversation-id": hit.conversation_id },
        el(
          "div",
          { class: "hit-head" },
          el("span", { class: "name" }, title),
          el("span", { class: "meta" }, " · ", el("span", { class: "grade" }, gradeOf(hit, semantic))),
        ),
        el("p", { class: "snippet" }, hit.before, el("mark", {}, hit.match), hit.after),
        button("Open", { "data-testid": "hit-open", "aria-label": `Open “${title}” at this match` }, () =>
          run(() => openConversation(hit.conversation_id, { version: hit.session_id, hit })),
        ),
      );
    }),
  );
  if (hits.length) searchState(plural(hits.length, semantic ? "nearest conversation" : "hit"));
  else searchState(semantic ? `Nothing found by meaning for “${q}”.` : `No match for “${q}”.`);
}

// ---- rename, delete ----

async function rename(title) {
  const conv = await sendJSON("PATCH", `/api/conversations/${ref(chat.id)}`, { title });
  chat.conv = { ...(chat.conv ?? {}), ...conv };
  renderChat();
  await loadList();
  $("rename").focus();
}

async function remove() {
  const { deleted, sessions } = await sendJSON("DELETE", `/api/conversations/${ref(chat.id)}`);
  chat = blankChat();
  renderChat();
  await loadList();
  status(`Deleted “${deleted?.title ?? "the conversation"}” (${plural(sessions ?? 0, "session")}).`);
  $("prompt").focus();
}

// ---- wiring ----

$("api-key").value = localStorage.getItem(KEY) ?? "";
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
  run(loadList);
});
$("list-toggle").addEventListener("click", () => {
  const open = !document.body.classList.contains("list-open");
  setListOpen(open);
  if (open) $("search-q").focus();
});
$("new-chat").addEventListener("click", newChat);
$("search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  run(() => search($("search-q").value, $("search-meaning").checked));
});
$("search-clear").addEventListener("click", () => {
  $("hits").replaceChildren();
  searchState("");
  $("search-clear").hidden = true;
  $("search-q").focus();
});
$("more-conversations").addEventListener("click", () => run(() => loadList(true)));
$("filter-form").addEventListener("submit", (event) => {
  event.preventDefault();
  run(loadList);
});
$("filter-form").addEventListener("reset", () => setTimeout(() => run(loadList)));
$("version").addEventListener("change", () => run(() => openConversation(chat.id, { version: $("version").value })));
$("rename").addEventListener("click", () => {
  $("rename-form").hidden = false;
  $("rename-input").value = $("chat-title").textContent;
  $("rename-input").select();
  $("rename-input").focus();
});
$("rename-cancel").addEventListener("click", () => {
  $("rename-form").hidden = true;
  $("rename").focus();
});
$("rename-form").addEventListener("keydown", (event) => {
  if (event.key === "Escape") $("rename-cancel").click();
});
$("rename-form").addEventListener("submit", (event) => {
  event.preventDefault();
  run(() => rename($("rename-input").value.trim()));
});
$("delete").addEventListener("click", () => {
  $("delete-confirm").hidden = false;
  $("delete-no").focus();
});
$("delete-no").addEventListener("click", () => {
  $("delete-confirm").hidden = true;
  $("delete").focus();
});
$("delete-yes").addEventListener("click", () => run(remove));
$("branch-cancel").addEventListener("click", cancelFork);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || $("send").disabled) return;
  $("prompt").value = "";
  run(() => send(text));
});
NARROW.addEventListener("change", () => setListOpen(false));
renderChat();
run(loadList);
