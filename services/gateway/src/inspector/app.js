// The memory inspector: reads the gateway's /v1 API with the API key pasted into the page.
//
// Rules this file keeps:
// - Data from the API is only ever rendered as text (textContent, text nodes); no HTML is
//   built from strings, so a memory that holds markup shows the markup.
// - The key lives in sessionStorage (this tab only) and goes nowhere but this origin, in
//   the Authorization header.
// - Every failed request shows the API's own error (`{"error": {"code", "message"}}`) in the
//   section that asked, and a route this gateway does not have yet says "not available".

const KEY_STORE = "engram.inspector.key";
const SCOPE_STORE = "engram.inspector.scope";
// Widest first: a grant must be of a strictly wider kind than the scope it reads with.
const SCOPE_KINDS = ["org", "team", "user", "agent", "task", "session"];

const state = {
  key: null,
  whoami: null,
  scope: null, // {kind, id}
  scopes: [], // from /v1/scopes, when the gateway has it
  section: "welcome",
  generation: 0, // bumped on every connect: answers to an older key are dropped
};

// ---------------------------------------------------------------------------------------
// DOM helpers

const $ = (selector, root = document) => root.querySelector(selector);

/** An element with attributes and children; strings become text nodes, never markup. */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      node.addEventListener(name.slice(2), value);
    } else if (name === "text") {
      node.textContent = String(value);
    } else {
      node.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function clear(node) {
  node.replaceChildren();
}

/** Fills `table` (with a thead and a tbody) with `columns` and one row per item. */
function fillTable(table, columns, items, { onRow } = {}) {
  const head = el("tr", {}, columns.map((c) => el("th", { class: c.class }, c.title)));
  $("thead", table).replaceChildren(head);
  const body = $("tbody", table);
  clear(body);
  for (const [index, item] of items.entries()) {
    const row = el("tr");
    for (const column of columns) {
      const value = column.render(item, index);
      row.append(el("td", { class: column.class }, value));
    }
    if (onRow) onRow(row, item);
    body.append(row);
  }
  table.hidden = items.length === 0;
}

function chip(text, kind) {
  return el("span", { class: kind ? `chip ${kind}` : "chip" }, text);
}

function mono(text) {
  return el("code", {}, text);
}

function num(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  return value.toFixed(digits);
}

/** RFC 3339 as `2026-12-02 10:47:18Z`: compact, sortable and unambiguous. */
function time(iso) {
  if (!iso) return "–";
  return String(iso).replace("T", " ").replace(/\.\d+/, "").replace("+00:00", "Z");
}

function json(value) {
  if (value === undefined) return "";
  if (typeof value === "string") return value;
  return JSON.stringify(value);
}

/** `3 facts`, `1 fact`. */
function count(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function bytes(n) {
  if (typeof n !== "number") return "–";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

function scopeText(scope) {
  return scope ? `${scope.kind}:${scope.id}` : "";
}

function parseScope(text) {
  const match = /^\s*([a-z]+)\s*:\s*([A-Za-z0-9_-]+)\s*$/.exec(text || "");
  if (!match || !SCOPE_KINDS.includes(match[1])) return null;
  return { kind: match[1], id: match[2] };
}

/** Scrolls `panel` into view when it opened below the fold, and not otherwise. */
function reveal(panel) {
  if (panel.getBoundingClientRect().top > window.innerHeight - 120) {
    panel.scrollIntoView({ block: "start", behavior: "smooth" });
  }
}

// ---------------------------------------------------------------------------------------
// The API

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** POSTs (or GETs, without a body) `path` with the key; the JSON answer, or an ApiError. */
async function api(path, body) {
  const generation = state.generation;
  const headers = { Authorization: `Bearer ${state.key}` };
  const init = { method: body === undefined ? "GET" : "POST", headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, "unreachable", `the gateway did not answer: ${e.message}`);
  }
  const text = await response.text();
  let payload = null;
  try {
    payload = text ? JSON.parse(text) : null;
  } catch {
    payload = null;
  }
  if (generation !== state.generation) throw new ApiError(0, "stale", "the key changed");
  if (response.ok) return payload;
  if (payload && payload.error && payload.error.code) {
    throw new ApiError(response.status, payload.error.code, payload.error.message || "");
  }
  if (response.status === 404 || response.status === 405) {
    throw new ApiError(
      response.status,
      "not_available",
      `${path} is not available on this gateway yet`,
    );
  }
  throw new ApiError(response.status, "http_" + response.status, text.slice(0, 300));
}

/** The scope part of a request: the picked scope, plus the key's wider grants if asked. */
function scopeRequest({ grants = true } = {}) {
  const request = { scope: state.scope };
  if (grants && $("#use-grants").checked) {
    const rank = SCOPE_KINDS.indexOf(state.scope.kind);
    const wider = grantScopes().filter((g) => SCOPE_KINDS.indexOf(g.kind) < rank);
    if (wider.length) request.grants = wider;
  }
  return request;
}

function grantScopes() {
  const grants = (state.whoami && state.whoami.grants) || [];
  return grants.map((g) => (typeof g === "string" ? parseScope(g) : g)).filter(Boolean);
}

// ---------------------------------------------------------------------------------------
// Errors and status lines

function showError(node, error) {
  if (!node) return;
  if (!error) {
    node.hidden = true;
    clear(node);
    return;
  }
  if (error.code === "stale") return;
  clear(node);
  node.classList.toggle("unavailable", error.code === "not_available");
  if (error.code === "not_available") {
    append(node, [el("strong", {}, "Not available"), " ", error.message]);
  } else {
    append(node, [
      el("strong", { class: "code" }, error.code || "error"),
      error.status ? el("span", { class: "http" }, ` HTTP ${error.status}`) : null,
      ": ",
      error.message || String(error),
    ]);
  }
  node.dataset.code = error.code || "";
  node.hidden = false;
}

function sectionNode(name) {
  return $(`#section-${name}`);
}

function status(section, ...parts) {
  const node = $(":scope > .status", sectionNode(section));
  clear(node);
  append(node, parts);
}

const tickets = {};

/**
 * Runs `load` for a section with its error line and a busy marker kept right. `load` asks
 * the API through the `call` it is given, which drops the answer (a "stale" error, never
 * shown) once a newer load of the same section has started, so the last one asked wins.
 */
async function run(section, load) {
  const node = sectionNode(section);
  const error = $(":scope > .error", node);
  const ticket = (tickets[section] = (tickets[section] || 0) + 1);
  const fresh = () => tickets[section] === ticket;
  const call = async (path, body) => {
    const answer = await api(path, body);
    if (!fresh()) throw new ApiError(0, "stale", "a newer request replaced this one");
    return answer;
  };
  showError(error, null);
  node.classList.add("busy");
  try {
    await load(call);
  } catch (e) {
    if (!(e instanceof ApiError)) console.error(e);
    if (fresh()) showError(error, e);
  } finally {
    if (fresh()) node.classList.remove("busy");
  }
}

function needScope(section) {
  if (state.scope) return true;
  status(section, "Pick a scope on the left first.");
  return false;
}

// ---------------------------------------------------------------------------------------
// Connecting

async function connect(key) {
  // Another key may read other scopes: start it from its own list.
  if (sessionStorage.getItem(KEY_STORE) !== key) {
    state.scope = null;
    sessionStorage.removeItem(SCOPE_STORE);
  }
  state.generation += 1;
  state.key = key;
  state.whoami = null;
  state.scopes = [];
  const globalError = $("#global-error");
  showError(globalError, null);
  const identity = $("#identity");
  identity.textContent = "connecting…";
  try {
    state.whoami = await api("/v1/whoami");
  } catch (e) {
    if (e.code === "stale") return;
    disconnect();
    $("#key").value = key;
    showError(globalError, e);
    return;
  }
  sessionStorage.setItem(KEY_STORE, key);
  $("#use-grants-label").hidden = grantScopes().length === 0;
  $("#disconnect").hidden = false;
  document.body.classList.add("connected");
  renderIdentity();
  await loadScopes();
  const saved = parseScope(sessionStorage.getItem(SCOPE_STORE));
  const first = state.scopes.length ? state.scopes[0].scope : null;
  const keep = state.scope || saved || first;
  if (keep) setScope(keep, { show: false });
  show(state.section === "welcome" ? (state.scopes.length ? "scopes" : "timeline") : state.section);
}

function renderIdentity() {
  const who = state.whoami;
  const identity = $("#identity");
  clear(identity);
  append(identity, [el("span", { class: "who" }, `${who.tenant} / ${who.agent}`)]);
  const panel = $("#whoami-panel");
  clear(panel);
  append(panel, [
    el("div", {}, el("span", { class: "label" }, "tenant "), mono(who.tenant)),
    el("div", {}, el("span", { class: "label" }, "agent "), mono(who.agent)),
    el(
      "div",
      {},
      el("span", { class: "label" }, "may write "),
      who.scopes ? who.scopes.map((s) => chip(String(s))) : "–",
    ),
    el(
      "div",
      {},
      el("span", { class: "label" }, "grants (read-only) "),
      who.grants && who.grants.length ? who.grants.map((g) => chip(String(g), "grant")) : "none",
    ),
  ]);
}

function disconnect() {
  state.generation += 1;
  state.key = null;
  state.whoami = null;
  state.scopes = [];
  state.scope = null;
  sessionStorage.removeItem(KEY_STORE);
  sessionStorage.removeItem(SCOPE_STORE);
  for (const label of document.querySelectorAll(".scope-label")) label.textContent = "";
  $("#scope-note").textContent = "";
  clear($("#whoami-panel"));
  resetViews();
  $("#key").value = "";
  $("#identity").textContent = "";
  $("#disconnect").hidden = true;
  $("#use-grants-label").hidden = true;
  document.body.classList.remove("connected");
  showError($("#global-error"), null);
  renderScopeSelect();
  show("welcome");
}

// ---------------------------------------------------------------------------------------
// Scopes and the scope picker

async function loadScopes() {
  await run("scopes", async (call) => {
    let answer;
    try {
      answer = await call("/v1/scopes", {});
    } catch (e) {
      if (e.code === "stale") throw e;
      state.scopes = [];
      renderScopeSelect();
      fillTable($("#scopes-table"), [], []);
      status("scopes", "Type a scope on the left (kind:id) to inspect it.");
      throw e;
    }
    state.scopes = answer.scopes || [];
    renderScopeSelect();
    fillTable(
      $("#scopes-table"),
      [
        { title: "Scope", render: (s) => mono(scopeText(s.scope)) },
        { title: "Events", class: "num", render: (s) => num(s.events) },
        {
          // Counted per stream subject, whose last token is the layer.
          title: "By layer",
          render: (s) =>
            Object.entries(s.layers || {})
              .sort((a, b) => b[1] - a[1])
              .map(([layer, n]) => chip(`${layer} ${n}`, `layer-${layer}`)),
        },
        {
          title: "",
          render: (s) =>
            el("button", {
              type: "button",
              class: "small",
              text: "Timeline",
              onclick: () => {
                setScope(s.scope, { show: false });
                show("timeline");
              },
            }),
        },
      ],
      state.scopes,
    );
    status(
      "scopes",
      count(state.scopes.length, "scope"),
      answer.truncated ? " (the list was cut short: type a scope on the left to open another)" : "",
    );
  });
}

function renderScopeSelect() {
  const select = $("#scope-select");
  clear(select);
  if (!state.key) {
    select.append(el("option", { value: "" }, "(connect first)"));
    select.disabled = true;
    return;
  }
  select.disabled = false;
  select.append(el("option", { value: "" }, state.scopes.length ? "— pick a scope —" : "(type one below)"));
  const current = scopeText(state.scope);
  let found = false;
  for (const s of state.scopes) {
    const value = scopeText(s.scope);
    found ||= value === current;
    select.append(el("option", { value, selected: value === current }, `${value} (${s.events})`));
  }
  if (current && !found) select.append(el("option", { value: current, selected: true }, current));
}

function setScope(scope, { show: reload = true } = {}) {
  state.scope = scope;
  sessionStorage.setItem(SCOPE_STORE, scopeText(scope));
  renderScopeSelect();
  $("#scope-input").value = "";
  for (const label of document.querySelectorAll(".scope-label")) label.textContent = scopeText(scope);
  const grants = scopeRequest().grants || [];
  $("#scope-note").textContent = grants.length
    ? `reads with ${grants.map(scopeText).join(", ")}`
    : "";
  resetViews();
  if (reload && state.section !== "welcome") show(state.section);
}

/** Drops what the sections show of the previous scope. */
function resetViews() {
  timeline.stack = [];
  timeline.cursor = null;
  for (const id of ["fact-history", "doc-detail"]) $(`#${id}`).hidden = true;
  for (const name of ["timeline", "search", "facts", "skills", "docs"]) {
    const node = sectionNode(name);
    for (const table of node.querySelectorAll(":scope > table")) {
      fillTable(table, [], []);
    }
    status(name);
    showError($(":scope > .error", node), null);
  }
  clear($("#search-summaries"));
}

// ---------------------------------------------------------------------------------------
// Sections

const loaders = {
  scopes: () => loadScopes(),
  timeline: () => loadTimeline(),
  search: () => {
    if ($("#search-query").value.trim()) return search();
    needScope("search");
  },
  facts: () => loadFacts(),
  skills: () => loadSkills(),
  docs: () => loadDocs(),
  snapshots: () => loadSnapshots(),
  "dead-letters": () => loadDeadLetters(),
};

function show(name) {
  state.section = name;
  for (const node of document.querySelectorAll("main > section")) {
    node.hidden = node.id !== `section-${name}`;
  }
  for (const button of document.querySelectorAll("nav button[data-section]")) {
    button.classList.toggle("active", button.dataset.section === name);
    button.disabled = !state.key;
  }
  if (state.key && loaders[name]) loaders[name]();
}

// --- Timeline ---------------------------------------------------------------------------

// Stream order pages forward from `after_seq`. Newest first pages back from a cursor (an
// exclusive upper bound): replay only reads forward, so a page is read from a window
// before the cursor that widens until it holds a page or reaches the stream's start.
const timeline = { cursor: null, stack: [], page: [] };

async function replayRange(call, after, before, keep) {
  const events = [];
  for (;;) {
    const page = await call("/v1/replay", { ...scopeRequest({ grants: false }), after_seq: after, limit: 1000 });
    for (const e of page.events) {
      if (before === null || e.seq < before) events.push(e);
    }
    if (keep && events.length > keep) events.splice(0, events.length - keep);
    const last = page.events.length ? page.events[page.events.length - 1].seq : page.next_after;
    if (page.done || page.events.length === 0 || (before !== null && last >= before - 1)) {
      return { events, last_seq: page.last_seq, first_seq: page.first_seq };
    }
    after = page.next_after;
  }
}

async function newestPage(call, before, size) {
  let window = size * 4;
  for (;;) {
    const after = Math.max(0, before - 1 - window);
    const range = await replayRange(call, after, before, size);
    if (range.events.length >= size || after === 0) {
      return { ...range, events: range.events.slice(-size).reverse() };
    }
    window *= 8;
  }
}

async function loadTimeline(direction) {
  if (!needScope("timeline")) return;
  await run("timeline", async (call) => {
    const size = Number($("#timeline-size").value);
    const newest = $("#timeline-order").value === "newest";
    if (direction === "next") {
      timeline.stack.push(timeline.cursor);
      // Newest first: older than the oldest shown; stream order: after the last shown.
      timeline.cursor = timeline.page[timeline.page.length - 1].seq;
    } else if (direction === "prev") {
      timeline.cursor = timeline.stack.pop() ?? null;
    }
    let result;
    if (newest) {
      let before = timeline.cursor;
      if (before === null) {
        const probe = await call("/v1/replay", { ...scopeRequest({ grants: false }), after_seq: 0, limit: 1 });
        before = probe.last_seq + 1;
      }
      result = await newestPage(call, before, size);
    } else {
      const page = await call("/v1/replay", {
        ...scopeRequest({ grants: false }),
        after_seq: timeline.cursor ?? 0,
        limit: size,
      });
      result = page;
      result.more = !page.done;
    }
    timeline.page = result.events;
    renderTimeline(result, newest, size);
  });
}

function describe(event) {
  const content = event.content || {};
  if (content.text) return content.text;
  const data = content.data;
  if (!data) return "";
  switch (event.kind) {
    case "fact_asserted":
      return `${data.subject} · ${data.predicate} · ${json(data.object)}`;
    case "fact_retracted":
      return `retracted ${json(data.fact_id ?? data)}`;
    case "skill_recorded":
      return `skill ${data.name}: ${data.description ?? ""}`;
    case "doc_changed":
      return `document ${data.doc_type ?? ""}/${data.name ?? ""}`;
    case "forgotten":
      return `forgot ${(data.event_ids || []).length} memories: ${data.reason ?? ""}`;
    default: {
      const text = json(data);
      return text.length > 200 ? text.slice(0, 200) + "…" : text;
    }
  }
}

function renderTimeline(result, newest, size) {
  const table = $("#timeline-table");
  const events = result.events;
  fillTable(
    table,
    [
      { title: "Seq", class: "num", render: (r) => String(r.seq) },
      { title: "Time", class: "time", render: (r) => time(r.event.occurred_at) },
      { title: "Kind", render: (r) => chip(r.event.kind, `kind-${r.event.kind}`) },
      { title: "Layer", render: (r) => r.event.layer },
      {
        title: "Agent",
        render: (r) => [r.event.agent_id, el("span", { class: "sub" }, r.event.instance_id)],
      },
      {
        title: "Memory",
        class: "text",
        render: (r) => [
          describe(r.event),
          (r.event.tags || []).length ? el("span", { class: "tags" }, r.event.tags.map((t) => chip(t, "tag"))) : null,
        ],
      },
    ],
    events,
    {
      onRow: (row, r) => {
        row.classList.add("expandable");
        row.title = "Show the stored event";
        row.addEventListener("click", () => toggleDetail(row, r));
      },
    },
  );
  const prev = $("#timeline-prev");
  const next = $("#timeline-next");
  $("span", prev).textContent = newest ? "newer" : "previous";
  $("span", next).textContent = newest ? "older" : "next";
  prev.disabled = timeline.stack.length === 0;
  next.disabled = newest
    ? events.length < size || events[events.length - 1].seq <= 1
    : !result.more;
  if (!events.length) {
    status("timeline", `No events in ${scopeText(state.scope)}.`);
    return;
  }
  const seqs = events.map((e) => e.seq);
  status(
    "timeline",
    `${count(events.length, "event")}, seq ${Math.min(...seqs)}–${Math.max(...seqs)}`,
    ` · stream ${result.first_seq}–${result.last_seq}`,
    newest ? " · newest first" : " · stream order",
    " · click a row for the stored event",
  );
}

function toggleDetail(row, replayed) {
  const next = row.nextElementSibling;
  if (next && next.classList.contains("detail")) {
    next.remove();
    return;
  }
  const event = { ...replayed.event };
  if (event.embedding && Array.isArray(event.embedding.vector)) {
    event.embedding = { ...event.embedding, vector: `[${event.embedding.vector.length} numbers]` };
  }
  const pre = el("pre", { class: "json" }, JSON.stringify({ seq: replayed.seq, stored_at: replayed.stored_at, event }, null, 2));
  row.after(el("tr", { class: "detail" }, el("td", { colspan: row.children.length }, pre)));
}

// --- Search -----------------------------------------------------------------------------

async function search() {
  if (!needScope("search")) return;
  const query = $("#search-query").value.trim();
  if (!query) {
    status("search", "Type something to look for.");
    return;
  }
  await run("search", async (call) => {
    const request = {
      ...scopeRequest(),
      query,
      mode: $("#search-mode").value,
      top_k: Number($("#search-top").value) || 10,
    };
    const confidence = $("#search-confidence").value;
    if (confidence !== "") request.filter = { min_confidence: Number(confidence) };
    const answer = await call("/v1/retrieve", request);
    renderResults($("#search-table"), answer.results);
    const visible = (answer.visible || []).map(([projector, seq]) => `${projector} @ ${seq}`).join(", ");
    status(
      "search",
      answer.results.length ? count(answer.results.length, "result") : "Nothing matched.",
      visible ? ` · as of ${visible}` : "",
    );
    const summaries = $("#search-summaries");
    clear(summaries);
    if ((answer.summaries || []).length) {
      const table = el("table", { class: "data", id: "search-summaries-table" }, el("thead"), el("tbody"));
      summaries.append(el("h3", {}, "Session summaries"), table);
      renderResults(table, answer.summaries);
    }
  });
}

function scoreParts(result) {
  const p = result.parts || {};
  const side = (name, score, rank) =>
    score === null || score === undefined
      ? el("span", { class: "part missing", title: `not found by the ${name} side` }, `${name} –`)
      : el("span", { class: "part" }, `${name} ${num(score)}`, rank ? el("span", { class: "rank" }, ` #${rank}`) : null);
  return el(
    "div",
    { class: "parts" },
    side("dense", p.dense, p.dense_rank),
    side("keyword", p.keyword, p.keyword_rank),
    el("span", { class: "part" }, `fused ${num(p.fused, 4)}`),
    el("span", { class: "part boost" }, `recency +${num(p.recency_boost, 4)}`),
    el("span", { class: "part boost" }, `importance +${num(p.importance_boost, 4)}`),
  );
}

function renderResults(table, results) {
  const own = scopeText(state.scope);
  fillTable(
    table,
    [
      { title: "#", class: "num", render: (_, i) => String(i + 1) },
      { title: "Score", class: "num score", render: (r) => num(r.score, 4) },
      {
        title: "Memory",
        class: "text",
        render: (r) => [
          el("div", {}, r.text),
          el(
            "div",
            { class: "sub" },
            chip(r.kind, `kind-${r.kind}`),
            ` ${r.layer} · seq ${r.seq} · ${r.agent_id} · ${time(r.occurred_at)}`,
            scopeText(r.scope) !== own ? el("span", { class: "chip grant" }, scopeText(r.scope)) : null,
          ),
        ],
      },
      { title: "Score parts", render: (r) => scoreParts(r) },
      {
        title: "Importance / confidence",
        class: "num",
        render: (r) => `${num(r.importance, 2)} / ${num(r.confidence, 2)}`,
      },
    ],
    results,
  );
}

// --- Facts ------------------------------------------------------------------------------

function factStatus(fact) {
  if (fact.retracted_at) return chip("retracted", "bad");
  if (fact.superseded_by) return chip("superseded", "old");
  if (fact.valid_to && Date.parse(fact.valid_to) <= Date.now()) return chip("ended", "old");
  return chip("current", "good");
}

function factColumns({ history }) {
  const columns = [
    { title: "Object", class: history ? "object" : "text", render: (f) => el("strong", {}, json(f.object)) },
    { title: "Status", render: (f) => factStatus(f) },
    {
      title: "Valid",
      class: "time",
      render: (f) => [time(f.valid_from), el("span", { class: "to" }, `→ ${f.valid_to ? time(f.valid_to) : "open"}`)],
    },
    { title: "Recorded", class: "time", render: (f) => time(f.recorded_at) },
    { title: "Confidence", class: "num", render: (f) => num(f.confidence, 2) },
    {
      title: "Sources",
      render: (f) =>
        (f.sources || []).map((s) =>
          chip(`seq ${s.provenance?.seq} · ${s.provenance?.agent_id}`, "source"),
        ),
    },
  ];
  if (history) {
    columns.splice(3, 0, {
      title: "Retracted",
      class: "time",
      render: (f) => (f.retracted_at ? time(f.retracted_at) : "–"),
    });
  } else {
    const own = scopeText(state.scope);
    columns.unshift(
      {
        title: "Subject",
        render: (f) => [
          f.subject,
          f.scope && scopeText(f.scope) !== own ? el("span", { class: "sub" }, chip(scopeText(f.scope), "grant")) : null,
        ],
      },
      { title: "Predicate", render: (f) => f.predicate },
    );
    columns.push({
      title: "",
      render: (f) =>
        el("button", {
          type: "button",
          class: "small history",
          text: "History",
          onclick: () => factHistory(f),
        }),
    });
  }
  return columns;
}

async function loadFacts() {
  if (!needScope("facts")) return;
  await run("facts", async (call) => {
    const request = { ...scopeRequest(), limit: 200 };
    for (const [field, id] of [
      ["subject", "#facts-subject"],
      ["predicate", "#facts-predicate"],
      ["text", "#facts-text"],
      ["valid_at", "#facts-valid-at"],
      ["known_at", "#facts-known-at"],
    ]) {
      const value = $(id).value.trim();
      if (value) request[field] = value;
    }
    if ($("#facts-all").checked) request.history = true;
    const answer = await call("/v1/facts", request);
    fillTable($("#facts-table"), factColumns({ history: false }), answer.facts);
    status(
      "facts",
      answer.facts.length ? count(answer.facts.length, "fact") : "No facts.",
      ` · as of seq ${answer.visible_seq}`,
      " · History shows every version of a subject's predicate",
    );
  });
}

async function factHistory(fact) {
  const panel = $("#fact-history");
  const error = $(":scope > .error", panel);
  $("h3", panel).textContent = `History of ${fact.subject} · ${fact.predicate}`;
  panel.hidden = false;
  showError(error, null);
  try {
    const answer = await api("/v1/facts", {
      ...scopeRequest(),
      subject: fact.subject,
      predicate: fact.predicate,
      history: true,
      limit: 1000,
    });
    const versions = [...answer.facts].sort((a, b) =>
      String(a.recorded_at).localeCompare(String(b.recorded_at)),
    );
    fillTable($("#fact-history-table"), factColumns({ history: true }), versions);
    reveal(panel);
  } catch (e) {
    fillTable($("#fact-history-table"), [], []);
    showError(error, e);
  }
}

// --- Skills -----------------------------------------------------------------------------

async function loadSkills() {
  if (!needScope("skills")) return;
  await run("skills", async (call) => {
    const request = { ...scopeRequest(), limit: 100 };
    const task = $("#skills-task").value.trim();
    const name = $("#skills-name").value.trim();
    let answer;
    let note = "";
    if (task || name) {
      if (task) request.task = task;
      if (name) request.name = name;
      answer = await call("/v1/skills", request);
    } else {
      // The registry answers a task or a name, so list the skills the scope recorded.
      const { names, scanned, more } = await recordedSkills(call);
      answer = { skills: [], visible_seq: 0 };
      for (const recorded of names.slice(0, SKILL_NAMES)) {
        const found = await call("/v1/skills", { ...request, name: recorded });
        answer.skills.push(...found.skills);
        answer.visible_seq = Math.max(answer.visible_seq, found.visible_seq);
      }
      note =
        ` · recorded in ${scopeText(state.scope)}` +
        (more ? ` (its first ${scanned} events; describe a task to search them all)` : "") +
        (names.length > SKILL_NAMES ? ` (the first ${SKILL_NAMES} of ${names.length} names)` : "");
    }
    const skill = (s) => s.skill ?? s;
    fillTable(
      $("#skills-table"),
      [
        { title: "Skill", render: (s) => el("strong", {}, skill(s).name) },
        { title: "Version", class: "num", render: (s) => num(skill(s).version) },
        {
          title: "What it does",
          class: "text",
          render: (s) => {
            const k = skill(s);
            return [
              el("div", {}, k.description),
              (k.steps || []).length ? el("ol", { class: "steps" }, k.steps.map((step) => el("li", {}, step))) : null,
              (k.preconditions || []).length ? el("div", { class: "sub" }, `needs: ${k.preconditions.join("; ")}`) : null,
            ];
          },
        },
        {
          title: "Outcomes",
          class: "num",
          render: (s) => {
            const k = skill(s);
            const rate = ((k.successes ?? 0) + 1) / ((k.successes ?? 0) + (k.failures ?? 0) + 2);
            return [`${k.successes ?? 0} ✓ ${k.failures ?? 0} ✗`, el("div", { class: "sub" }, `rate ${num(rate, 2)}`)];
          },
        },
        { title: "Last used", class: "time", render: (s) => time(skill(s).last_used) },
        { title: "Match", class: "num", render: (s) => (task ? num(s.score, 3) : "–") },
      ],
      answer.skills,
    );
    status(
      "skills",
      answer.skills.length ? count(answer.skills.length, "skill") : "No skills.",
      note,
      answer.visible_seq ? ` · as of seq ${answer.visible_seq}` : "",
    );
  });
}

const SKILL_SCAN_PAGES = 10;
// Each name is one request: stay well inside the key's rate limit (gateway.burst).
const SKILL_NAMES = 40;

/** The names of the skills recorded in the scope, from (at most the first pages of) its events. */
async function recordedSkills(call) {
  const names = new Set();
  let after = 0;
  let scanned = 0;
  for (let page = 0; page < SKILL_SCAN_PAGES; page++) {
    const answer = await call("/v1/replay", { ...scopeRequest({ grants: false }), after_seq: after, limit: 1000 });
    scanned += answer.events.length;
    for (const e of answer.events) {
      if (e.event.kind === "skill_recorded" && e.event.content?.data?.name) names.add(e.event.content.data.name);
    }
    if (answer.done || answer.events.length === 0) return { names: [...names], scanned, more: false };
    after = answer.next_after;
  }
  return { names: [...names], scanned, more: true };
}

// --- Documents --------------------------------------------------------------------------

async function loadDocs() {
  if (!needScope("docs")) return;
  await run("docs", async (call) => {
    const request = { ...scopeRequest(), read: "list", limit: 256 };
    const type = $("#docs-type").value.trim();
    if (type) request.doc_type = type;
    const answer = await call("/v1/docs", request);
    fillTable(
      $("#docs-table"),
      [
        { title: "Type", render: (d) => mono(d.doc_type) },
        { title: "Name", render: (d) => el("strong", {}, d.name) },
        { title: "Scope", render: (d) => scopeText(d.scope) },
        { title: "Events", class: "num", render: (d) => num(d.events) },
        { title: "Changes", class: "num", render: (d) => num(d.changes) },
        { title: "Held", class: "num", render: (d) => (d.held ? chip(String(d.held), "bad") : "0") },
        { title: "Last seq", class: "num", render: (d) => num(d.last_seq) },
        { title: "Size", class: "num", render: (d) => bytes(d.bytes) },
        {
          title: "",
          render: (d) => el("button", { type: "button", class: "small", text: "Open", onclick: () => openDoc(d) }),
        },
      ],
      answer.docs,
    );
    status("docs", answer.docs.length ? count(answer.docs.length, "document") : "No documents.", ` · as of seq ${answer.visible_seq}`);
  });
}

async function openDoc(doc) {
  const panel = $("#doc-detail");
  const error = $(":scope > .error", panel);
  $("h3", panel).textContent = `${doc.doc_type} / ${doc.name} in ${scopeText(doc.scope)}`;
  panel.hidden = false;
  showError(error, null);
  // A document is read in its own scope.
  const base = { scope: doc.scope, doc_type: doc.doc_type, name: doc.name };
  try {
    const [current, history] = await Promise.all([
      api("/v1/docs", { ...base, read: "state" }),
      api("/v1/docs", { ...base, read: "history", limit: 50 }),
    ]);
    const summary = current.doc;
    const statusNode = $(":scope > .status", panel);
    statusNode.textContent = summary
      ? `${summary.changes} changes from ${summary.events} events, last seq ${summary.last_seq}, ${bytes(summary.bytes)}` +
        (summary.held ? `, ${summary.held} held for missing dependencies` : "") +
        (current.truncated ? " · the view was cut at its size bound" : "")
      : "The document does not exist (yet).";
    fillTable(
      $("#doc-conflicts-table"),
      [
        { title: "Field", render: (c) => mono(c.path) },
        {
          title: "Values (the one shown first)",
          class: "text",
          render: (c) =>
            el(
              "ol",
              { class: "values" },
              c.values.map((v, i) => el("li", { class: i === 0 ? "winner" : "" }, json(v))),
            ),
        },
      ],
      current.conflicts || [],
    );
    $(".conflicts-note", panel).textContent = (current.conflicts || []).length
      ? `${current.conflicts.length} field${current.conflicts.length === 1 ? " was" : "s were"} written concurrently; every value is kept.`
      : "No field was written concurrently.";
    $("#doc-value").textContent = summary && summary.value !== undefined ? JSON.stringify(summary.value, null, 2) : "";
    fillTable(
      $("#doc-history-table"),
      [
        { title: "Seq", class: "num", render: (h) => String(h.seq) },
        { title: "Time", class: "time", render: (h) => time(h.occurred_at) },
        { title: "Agent", render: (h) => [h.agent_id, el("span", { class: "sub" }, h.instance_id)] },
        { title: "Changes", class: "num", render: (h) => num(h.changes) },
        { title: "Applied", class: "num", render: (h) => num(h.applied) },
        { title: "Held", class: "num", render: (h) => num(h.held) },
      ],
      history.history || [],
    );
    reveal(panel);
  } catch (e) {
    showError(error, e);
  }
}

// --- Snapshots and dead letters -----------------------------------------------------------

async function loadSnapshots() {
  await run("snapshots", async (call) => {
    const answer = await call("/v1/snapshots", {});
    // The index lists them oldest first; the newest matter most.
    const snapshots = [...(answer.snapshots || [])].reverse();
    fillTable(
      $("#snapshots-table"),
      [
        { title: "Projector", render: (s) => el("strong", {}, s.projector) },
        { title: "Version (seq)", class: "num", render: (s) => num(s.version) },
        { title: "Label", render: (s) => (s.label ? chip(s.label, "grant") : "–") },
        { title: "Events", class: "num", render: (s) => num(s.events) },
        { title: "Created", class: "time", render: (s) => time(s.created_at) },
        { title: "Size", class: "num", render: (s) => bytes(s.bytes) },
        {
          title: "State hash",
          render: (s) => (s.state_hash ? mono(String(s.state_hash).slice(0, 16) + "…") : "–"),
        },
      ],
      snapshots,
    );
    status("snapshots", snapshots.length ? `${count(snapshots.length, "snapshot")}, newest first` : "No snapshots yet.");
  });
}

async function loadDeadLetters() {
  await run("dead-letters", async (call) => {
    const limit = Math.min(500, Number($("#dead-letters-limit").value) || 100);
    const answer = await call("/v1/dead_letters", { limit });
    const letters = answer.dead_letters || [];
    fillTable(
      $("#dead-letters-table"),
      [
        { title: "DLQ seq", class: "num", render: (d) => num(d.dlq_seq) },
        { title: "Projector", render: (d) => el("strong", {}, d.projector) },
        { title: "Event seq", class: "num", render: (d) => num(d.event_seq) },
        { title: "Scope", render: (d) => (d.scope ? scopeText(d.scope) : mono(d.subject)) },
        {
          title: "Why, and the event",
          class: "text",
          render: (d) => [
            el("div", {}, d.reason),
            d.kind || d.text || d.event_id
              ? el(
                  "div",
                  { class: "sub" },
                  d.kind ? chip(d.kind, `kind-${d.kind}`) : null,
                  d.text ?? "",
                  d.event_id ? ` · ${d.event_id}` : "",
                )
              : el("div", { class: "sub" }, "(its bytes do not decode)"),
          ],
        },
        { title: "Stored", class: "time", render: (d) => time(d.stored_at) },
      ],
      letters,
    );
    status(
      "dead-letters",
      letters.length ? `${count(letters.length, "dead letter")}, newest first` : "No dead letters.",
      answer.total > letters.length ? ` · ${answer.total} in all` : "",
    );
  });
}

// ---------------------------------------------------------------------------------------
// Wiring

function onSubmit(id, handler) {
  $(id).addEventListener("submit", (event) => {
    event.preventDefault();
    handler();
  });
}

function start() {
  onSubmit("#key-form", () => {
    const key = $("#key").value.trim();
    if (!key) {
      showError($("#global-error"), new ApiError(0, "unauthenticated", "paste an API key first"));
      return;
    }
    connect(key);
  });
  $("#disconnect").addEventListener("click", disconnect);
  onSubmit("#scope-form", () => {
    const text = $("#scope-input").value;
    const scope = parseScope(text);
    if (!scope) {
      $("#scope-note").textContent = `"${text}" is not kind:id (kinds: ${SCOPE_KINDS.join(", ")})`;
      return;
    }
    setScope(scope);
  });
  $("#scope-select").addEventListener("change", (event) => {
    const scope = parseScope(event.target.value);
    if (scope) setScope(scope);
  });
  $("#use-grants").addEventListener("change", () => state.scope && setScope(state.scope));
  for (const button of document.querySelectorAll("nav button[data-section]")) {
    button.addEventListener("click", () => show(button.dataset.section));
  }
  onSubmit("#timeline-form", () => {
    timeline.stack = [];
    timeline.cursor = null;
    loadTimeline();
  });
  for (const id of ["#timeline-order", "#timeline-size"]) {
    $(id).addEventListener("change", () => {
      timeline.stack = [];
      timeline.cursor = null;
      loadTimeline();
    });
  }
  $("#timeline-prev").addEventListener("click", () => loadTimeline("prev"));
  $("#timeline-next").addEventListener("click", () => loadTimeline("next"));
  onSubmit("#search-form", search);
  onSubmit("#facts-form", loadFacts);
  onSubmit("#skills-form", loadSkills);
  onSubmit("#docs-form", loadDocs);
  onSubmit("#snapshots-form", loadSnapshots);
  onSubmit("#dead-letters-form", loadDeadLetters);

  show("welcome");
  const saved = sessionStorage.getItem(KEY_STORE);
  if (saved) {
    $("#key").value = saved;
    connect(saved);
  }
}

start();
