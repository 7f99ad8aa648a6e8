// Sidequest inspector (SPEC §12). Plain browser JavaScript, no dependencies, no build step.
// Every call goes to this origin's /v1 routes with the pasted token; the token lives in
// sessionStorage only (gone when the tab closes). Streams use EventSource with a stream token
// (an EventSource cannot send Authorization, SPEC §4).
"use strict";

(() => {
  const TOKEN_KEY = "sidequest.token";
  const SEGMENTS = ["system", "tools", "context", "qa_summary", "qa_raw", "question", "envelope"];
  const SEGMENT_LABEL = {
    system: "system prompt", tools: "tool schemas", context: "main context", qa_summary: "Q&A summary",
    qa_raw: "replayed Q&A", question: "question", envelope: "envelope",
  };
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const STREAM_TYPES = ["status", "progress", "delta", "usage", "done", "error"];

  const $ = (id) => document.getElementById(id);
  const state = {
    parentId: null, sessionsBefore: null, historyBefore: null, history: new Map(),
    requestId: null, record: null, events: [], streamed: "", deltas: 0, source: null, lastEventId: null, terminal: false,
    pollTimer: null, tickTimer: null, recordTimer: null, connected: false, known: new Set(), listComplete: false,
    clearVersion: null,
  };

  // ------------------------------------------------------------------ small helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const SVG_NS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(key, String(value));
    }
    for (const child of children) node.append(child);
    return node;
  }

  function num(value) {
    return typeof value === "number" && Number.isFinite(value) ? value : 0;
  }
  function fmt(value) {
    return typeof value === "number" ? value.toLocaleString("en-US") : value === null || value === undefined ? "—" : String(value);
  }
  function pct(part, whole) {
    return whole > 0 ? `${((100 * part) / whole).toFixed(1)} %` : "—";
  }
  function when(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    return Number.isNaN(d.getTime()) ? iso : d.toLocaleString();
  }
  function duration(ms) {
    if (!Number.isFinite(ms)) return "—";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
    return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
  }
  function short(text) {
    return typeof text === "string" && text.length > 24 ? `${text.slice(0, 12)}…` : fmt(text);
  }
  function range(pair) {
    if (!Array.isArray(pair) || pair.length !== 2) return "none";
    return pair[0] === pair[1] ? `#${pair[0]}` : `#${pair[0]}–#${pair[1]}`;
  }
  function facts(dl, rows) {
    dl.replaceChildren();
    for (const [term, value] of rows) {
      if (value === undefined) continue;
      dl.append(el("dt", { text: term }), el("dd", {}, value instanceof Node ? value : fmt(value)));
    }
  }
  function table(head, rows, foot) {
    const cls = (i) => (head[i] && head[i].num ? "num" : null);
    return el("div", { class: "table-wrap" },
      el("table", {},
        el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { class: cls(i), scope: "col", text: h.label })))),
        el("tbody", {}, rows.map((row) => el("tr", { class: row.cls || null },
          row.cells.map((c, i) => el("td", { class: cls(i) }, c instanceof Node ? c : fmt(c)))))),
        foot ? el("tfoot", {}, el("tr", {}, foot.map((c, i) => el("td", { class: cls(i) }, fmt(c))))) : null));
  }
  function notice(text, bad) {
    const node = $("notice");
    node.textContent = text || "";
    node.classList.toggle("bad", Boolean(bad));
  }

  // ------------------------------------------------------------------ the API

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  class ApiFailure extends Error {
    constructor(status, error) {
      super(error && error.message ? `${error.code}: ${error.message}` : `HTTP ${status}`);
      this.status = status;
      this.error = error || null;
    }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (token()) headers.Authorization = `Bearer ${token()}`;
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    if (!response.ok) {
      let error = null;
      try { error = (await response.json()).error; } catch (_) { /* not SPEC's error body */ }
      throw new ApiFailure(response.status, error);
    }
    if (response.status === 204) return null;
    return response.json();
  }

  const enc = encodeURIComponent;
  function failed(what) {
    return (err) => notice(`${what} failed: ${err.message}`, true);
  }

  // ------------------------------------------------------------------ sessions

  async function loadSessions(more) {
    const params = new URLSearchParams({ limit: "20" });
    if (more && state.sessionsBefore) params.set("before", state.sessionsBefore);
    const page = await api("GET", `/v1/sessions?${params}`);
    state.connected = true;
    const list = $("session-list");
    if (!more) {
      list.replaceChildren();
      state.known = new Set();
      state.listedBusy = new Set(); // sessions the list shows with work in progress
    }
    for (const item of page.items) {
      list.append(sessionEntry(item));
      state.known.add(item.parent_id);
      const counts = item.counts || {};
      if (num(counts.queued) + num(counts.running)) state.listedBusy.add(item.parent_id);
    }
    state.listComplete = !page.has_more;
    state.sessionsBefore = page.next_before;
    $("sessions-more").hidden = !page.has_more;
    $("sessions-empty").hidden = list.children.length > 0;
    $("sessions-empty").textContent = "No sessions yet for this token: open one by its parent id to ask a first question.";
    markCurrentSession();
  }

  function sessionEntry(item) {
    const counts = item.counts || {};
    const busy = num(counts.queued) + num(counts.running);
    const total = Object.values(counts).reduce((a, b) => a + num(b), 0);
    return el("li", {},
      el("button", { type: "button", class: "session", "data-parent-id": item.parent_id, onclick: () => openSession(item.parent_id, true).catch(failed("opening the session")) },
        el("span", { class: "pid", text: item.parent_id }),
        el("span", { class: "meta", text: `${total} question${total === 1 ? "" : "s"}${busy ? ` · ${busy} in progress` : ""} · ${when(item.updated_at)}` })));
  }

  function markCurrentSession() {
    for (const button of document.querySelectorAll("#session-list button")) {
      button.setAttribute("aria-current", String(button.dataset.parentId === state.parentId));
    }
  }

  async function openSession(parentId, reveal) {
    if (state.parentId !== parentId) closeRequest();
    state.parentId = parentId;
    setHash();
    markCurrentSession();
    $("session").hidden = false;
    $("session-title").textContent = parentId;
    $("handoff-result").hidden = true;
    // On a narrow screen the session opens below the list, out of sight: bring it into view, or a
    // tap on a session seems to do nothing.
    if (reveal && window.matchMedia("(max-width: 1100px)").matches) $("session").scrollIntoView({ block: "start" });
    await loadSession();
  }

  async function loadSession() {
    const parentId = state.parentId;
    let overview = null;
    // A parent id missing from a complete list is a new session: nothing to fetch (and no 404).
    const surelyNew = state.connected && state.listComplete && !state.known.has(parentId);
    if (!surelyNew) {
      try {
        overview = await api("GET", `/v1/sessions/${enc(parentId)}`);
      } catch (err) {
        if (err.status !== 404) throw err;
      }
    }
    if (parentId !== state.parentId) return;
    renderOverview(overview);
    state.history = new Map();
    state.historyBefore = null;
    $("history").replaceChildren();
    if (overview) await loadHistory(false);
    else {
      $("history-empty").hidden = false;
      $("history-empty").textContent = "No such session yet: ask a first question to create it.";
      $("history-more").hidden = true;
    }
  }

  function renderOverview(overview) {
    const dl = $("session-overview");
    const memoryBox = $("session-memory");
    memoryBox.replaceChildren();
    for (const id of ["clear", "archive", "handoff"]) $(id).disabled = !overview;
    state.clearVersion = overview ? overview.clear_version : null;
    if (!overview) {
      facts(dl, [["status", "new (no questions yet)"]]);
      return;
    }
    const counts = overview.counts || {};
    const countText = ["queued", "running", "succeeded", "failed", "cancelled"]
      .filter((k) => num(counts[k]) > 0).map((k) => `${counts[k]} ${k}`).join(", ") || "none";
    const rows = [
      ["requests", countText],
      ["next ordinal", overview.next_ordinal],
      ["clear version", overview.clear_version],
    ];
    if ("handed_off_through" in overview) rows.push(["handed off through", overview.handed_off_through ? `#${overview.handed_off_through}` : "nothing yet"]);
    rows.push(["last activity", when(overview.updated_at)]);
    const settings = overview.settings;
    if (settings && typeof settings === "object") {
      const set = Object.entries(settings).filter(([, v]) => v !== null && v !== undefined);
      rows.push(["settings", set.length ? set.map(([k, v]) => `${k}: ${typeof v === "string" && v.length > 60 ? `${v.slice(0, 60)}…` : v}`).join("; ") : "defaults"]);
    }
    const background = overview.background;
    if (background && background.jobs) {
      const jobs = Object.entries(background.jobs).filter(([, v]) => num(v) > 0).map(([k, v]) => `${v} ${k}`).join(", ") || "none";
      const usage = background.usage || {};
      rows.push(["background jobs", `${jobs}${usage.calls && usage.calls.length ? ` · ${usage.calls.length} calls, in ${fmt(usage.input_tokens)} / out ${fmt(usage.output_tokens)} tokens` : ""}`]);
    }
    facts(dl, rows);

    const memory = overview.memory || {};
    const qa = memory.qa_summary;
    const summaries = memory.context_summaries || [];
    memoryBox.append(el("h3", { text: "Memory" }));
    memoryBox.append(el("p", { class: "hint", text: qa
      ? `Rolling Q&A summary covers #${qa.first_ordinal ?? 1}–#${qa.covered_through_ordinal} (${fmt(qa.tokens)} tokens, updated ${when(qa.updated_at)}).`
      : "No rolling Q&A summary yet (every earlier answer still fits the replay window)." }));
    if (summaries.length) {
      memoryBox.append(table(
        [{ label: "cached context summary" }, { label: "snapshot" }, { label: "messages", num: true }, { label: "tokens", num: true }],
        summaries.map((s) => ({ cells: [el("code", { title: s.key, text: String(s.key || "").slice(0, 12) }), el("span", { title: s.snapshot_id, text: short(s.snapshot_id) }), s.covered_messages, s.tokens] }))));
    } else {
      memoryBox.append(el("p", { class: "hint", text: "No cached context summaries." }));
    }
  }

  async function loadHistory(older) {
    const parentId = state.parentId;
    const params = new URLSearchParams({ limit: "20" });
    if (older && state.historyBefore) params.set("before", String(state.historyBefore));
    const page = await api("GET", `/v1/sessions/${enc(parentId)}/questions?${params}`);
    if (parentId !== state.parentId) return;
    for (const record of page.items) state.history.set(record.id, record);
    state.historyBefore = page.next_before;
    $("history-more").hidden = !page.has_more;
    renderHistory();
    schedulePoll();
  }

  function renderHistory() {
    const list = $("history");
    const records = [...state.history.values()].sort((a, b) => b.ordinal - a.ordinal);
    list.replaceChildren(...records.map((r) => el("li", {},
      el("button", { type: "button", class: "request", "data-request-id": r.id, "aria-current": String(r.id === state.requestId), onclick: () => openRequest(r.id, true).catch(failed("opening the request")) },
        el("span", { class: "q", text: `#${r.ordinal} ${r.question}` }),
        el("span", { class: `meta status-${r.status}`, text: `${r.status}${r.stage && !TERMINAL.has(r.status) ? ` · ${r.stage}` : ""}${r.pinned ? " · pinned" : ""} · ${when(r.created_at)}` })))));
    $("history-empty").hidden = records.length > 0;
    $("history-empty").textContent = "No questions in this session.";
  }

  // Keep the history current while something in it is still queued or running.
  function schedulePoll() {
    clearTimeout(state.pollTimer);
    const busy = [...state.history.values()].some((r) => !TERMINAL.has(r.status));
    if (!busy || !state.parentId) return;
    const parentId = state.parentId;
    state.pollTimer = setTimeout(() => {
      if (parentId !== state.parentId) return;
      refreshSession().catch(failed("refreshing the session"));
    }, 2500);
  }

  async function refreshSession() {
    const parentId = state.parentId;
    const overview = await api("GET", `/v1/sessions/${enc(parentId)}`);
    if (parentId !== state.parentId) return;
    if (state.clearVersion !== null && overview.clear_version !== state.clearVersion) {
      // Cleared (or restored) since it was loaded, perhaps elsewhere: its history is another one now.
      if (state.record && state.record.clear_version !== overview.clear_version) closeRequest();
      await loadSession();
      return;
    }
    renderOverview(overview);
    const page = await api("GET", `/v1/sessions/${enc(parentId)}/questions?limit=20`);
    if (parentId !== state.parentId) return;
    for (const record of page.items) state.history.set(record.id, record);
    // A hand-off unpins what it carried; show that on the open request too.
    const open = state.record && page.items.find((r) => r.id === state.record.id);
    if (open && TERMINAL.has(open.status) && Boolean(open.pinned) !== Boolean(state.record.pinned)) {
      state.record.pinned = open.pinned;
      renderRequest();
    }
    if (state.historyBefore === null) {
      state.historyBefore = page.next_before;
      $("history-more").hidden = !page.has_more;
    }
    renderHistory();
    schedulePoll();
  }

  // ------------------------------------------------------------------ one request

  function closeRequest() {
    if (state.source) state.source.close();
    state.source = null;
    clearInterval(state.tickTimer);
    clearTimeout(state.recordTimer);
    state.requestId = null;
    state.record = null;
    $("request").hidden = true;
  }

  async function openRequest(requestId, reveal) {
    closeRequest();
    state.requestId = requestId;
    state.events = [];
    state.streamed = "";
    state.deltas = 0;
    state.lastEventId = null;
    state.terminal = false;
    setHash();
    renderHistory();
    const record = await api("GET", `/v1/questions/${enc(requestId)}`);
    if (requestId !== state.requestId) return;
    state.record = record;
    $("request").hidden = false;
    renderRequest();
    if (reveal && window.matchMedia("(max-width: 1100px)").matches) $("request").scrollIntoView({ block: "start" });
    await openStream(requestId, null);
  }

  // The request's own stream: replays every event of a finished request (for the timeline) and
  // follows a running one live. EventSource resumes by itself after a drop (Last-Event-ID); if the
  // server refuses a reconnect (the 10-minute token expired), a fresh token resumes with ?after=.
  async function openStream(requestId, after) {
    const grant = await api("POST", `/v1/questions/${enc(requestId)}/stream-token`);
    if (requestId !== state.requestId) return;
    const url = new URL(grant.url, location.href);
    // Opened while it still ran: its end changes the session's counts (a finished one's replay does not).
    const live = Boolean(state.record) && !TERMINAL.has(state.record.status);
    const source = new EventSource(url.pathname + url.search + (after !== null ? `&after=${enc(after)}` : ""));
    state.source = source;
    for (const type of STREAM_TYPES) {
      source.addEventListener(type, (event) => {
        if (!(event instanceof MessageEvent) || state.source !== source) return; // a transport error
        let data;
        try { data = JSON.parse(event.data); } catch (_) { return; }
        state.lastEventId = event.lastEventId;
        onEvent(type, data);
        if (type === "done" || type === "error") {
          source.close();
          state.terminal = true;
          refreshSession().catch(failed("refreshing the session"));
          // Its end changes the session's entry in the list — also when it had ended before the
          // stream opened, while the list (loaded at admission) still shows it in progress.
          if (live || (state.listedBusy && state.listedBusy.has(state.parentId))) {
            loadSessions(false).catch(failed("listing sessions"));
          }
          if (live) refreshRecord(requestId, 1500); // a cancelled call's usage lands just after the end
        }
      });
    }
    source.onerror = () => {
      if (state.source !== source || state.terminal) return;
      if (source.readyState === EventSource.CLOSED) {
        notice("the stream was refused; resuming with a new stream token");
        setTimeout(() => {
          if (state.source === source && !state.terminal) {
            openStream(requestId, state.lastEventId || 0).catch(failed("resuming the stream"));
          }
        }, 1000);
      }
    };
  }

  function onEvent(type, data) {
    state.events.push({ type, data });
    const record = state.record;
    if (type === "delta") {
      state.streamed += data.text || "";
      state.deltas += 1;
      renderAnswer();
      return;
    }
    if (type === "progress" && data.discard_streamed_text) state.streamed = "";
    if (type === "status") {
      record.status = data.status;
      record.stage = data.stage;
      // The budget and what was summarised are the record's context_info, written with each stage
      // change: read it again, or the page shows the budget from before compaction while answering.
      if (!TERMINAL.has(data.status)) refreshRecord(record.id, 300);
    }
    if (type === "usage" && data.usage) record.usage = data.usage;
    if (type === "done" && data.record) Object.assign(record, data.record);
    if (type === "error") {
      record.status = record.status === "running" || record.status === "queued" ? (data.code === "cancelled" ? "cancelled" : "failed") : record.status;
      record.error = { code: data.code, message: data.message, detail: data.detail };
    }
    if (state.history.has(record.id)) state.history.set(record.id, { ...state.history.get(record.id), status: record.status, stage: record.stage });
    renderRequest();
  }

  // Re-read the open request's record after ``delay`` ms and take its context_info, usage and model
  // (never its answer: the stream owns that while it runs). One pending read at a time.
  function refreshRecord(requestId, delay) {
    clearTimeout(state.recordTimer);
    state.recordTimer = setTimeout(async () => {
      if (requestId !== state.requestId || !state.record) return;
      try {
        const fresh = await api("GET", `/v1/questions/${enc(requestId)}`);
        if (requestId !== state.requestId || !state.record) return;
        const calls = (u) => (u && Array.isArray(u.calls) ? u.calls.length : 0);
        // Never back: a usage event may have brought a newer object than this read.
        const usage = calls(fresh.usage) >= calls(state.record.usage) ? fresh.usage : state.record.usage;
        Object.assign(state.record, { context_info: fresh.context_info, usage, model: fresh.model || state.record.model });
        if (TERMINAL.has(fresh.status)) Object.assign(state.record, fresh);
        renderRequest();
      } catch (_) {
        // A cleared request (404) or a passing outage: the next refresh says what is wrong.
      }
    }, delay);
  }

  function renderRequest() {
    const r = state.record;
    if (!r) return;
    $("request-title").textContent = `Request #${r.ordinal}`;
    const info = r.context_info || {};
    facts($("request-facts"), [
      ["status", el("span", { class: `status-${r.status}`, text: `${r.status}${r.stage && !TERMINAL.has(r.status) ? ` · ${r.stage}` : ""}` })],
      ["id", el("code", { text: r.id })],
      ["model", r.model],
      ["snapshot", r.snapshot_id ? el("span", { title: r.snapshot_id, text: short(r.snapshot_id) }) : "none (answered from the side Q&A alone)"],
      ["attempt", r.attempt],
      ["created", when(r.created_at)],
      ["finished", r.finished_at ? when(r.finished_at) : "—"],
      ["stop reason", r.stop_reason ? `${r.stop_reason}${r.truncated ? " (answer truncated by its output cap)" : ""}` : undefined],
      ["pressure", info.pressure],
    ]);
    $("request-question").textContent = r.question;
    renderAnswer();
    const live = !TERMINAL.has(r.status);
    $("cancel").disabled = !live;
    $("pin").disabled = r.status !== "succeeded";
    $("pin").setAttribute("aria-pressed", String(Boolean(r.pinned)));
    $("pin").textContent = r.pinned ? "Unpin" : "Pin";
    const err = $("request-error");
    err.hidden = !r.error;
    err.replaceChildren();
    if (r.error) {
      err.append(el("strong", { text: r.error.code }), ` ${r.error.message || ""}`);
      if (r.error.detail && Object.keys(r.error.detail).length) err.append(el("pre", { class: "mono", text: JSON.stringify(r.error.detail, null, 2) }));
    }
    renderTimeline();
    renderBudget(info);
    renderMemory(info);
    renderUsage(r.usage || {});
    clearInterval(state.tickTimer);
    if (live) state.tickTimer = setInterval(renderTimeline, 1000);
  }

  // The answer as it streams (from delta events), then the record's final answer once it is known.
  function renderAnswer() {
    const r = state.record;
    const done = TERMINAL.has(r.status);
    const text = done && typeof r.answer === "string" ? r.answer : state.streamed;
    const node = $("answer");
    if (node.textContent !== text) node.textContent = text;
    node.dataset.deltas = String(state.deltas);
    $("answer-state").textContent = done
      ? (r.status === "succeeded" ? (r.truncated ? "truncated" : "") : r.status)
      : (state.streamed ? "streaming" : r.status);
  }

  // ------------------------------------------------------------------ stage timeline

  function phases() {
    const marks = [];
    for (const { type, data } of state.events) {
      if (type !== "status" || !data.at) continue;
      const name = data.status === "running" || (data.stage && !TERMINAL.has(data.status)) ? data.stage || "running" : data.status;
      marks.push({ name, at: Date.parse(data.at), iso: data.at, terminal: TERMINAL.has(data.status) });
    }
    const list = [];
    for (let i = 0; i < marks.length; i += 1) {
      const mark = marks[i];
      if (mark.terminal) {
        list.push({ ...mark, ms: 0 });
        break;
      }
      const next = marks[i + 1];
      const end = next ? next.at : Date.now();
      list.push({ ...mark, ms: Math.max(0, end - mark.at), open: !next });
    }
    return list;
  }

  function renderTimeline() {
    const box = $("timeline");
    const list = phases();
    box.replaceChildren();
    if (!list.length) {
      box.append(el("p", { class: "hint", text: "No stage events yet." }));
      return;
    }
    const total = list.reduce((a, p) => a + p.ms, 0);
    const bar = svg("svg", { class: "bar strip", viewBox: "0 0 1000 10", preserveAspectRatio: "none", role: "img", "aria-label": `stage timeline, ${duration(total)} in all`, id: "timeline-bar" });
    let x = 0;
    for (const p of list) {
      if (p.ms <= 0 || total <= 0) continue;
      const w = (1000 * p.ms) / total;
      bar.append(svg("rect", { x: x.toFixed(3), y: 0, width: w.toFixed(3), height: 10, class: `phase-${p.name}`, "data-phase": p.name },
        svg("title", {}, document.createTextNode(`${p.name}: ${duration(p.ms)}`))));
      x += w;
    }
    box.append(bar);
    // A progress line goes under the stage it names (its own `stage` field): several events can share a
    // moment, so time alone would put one under the next stage. Without a stage, by time.
    const progress = state.events.filter((e) => e.type === "progress");
    const phaseOf = (e) => {
      const at = Date.parse(e.data.at);
      const named = list.filter((p) => p.name === e.data.stage);
      if (named.length) return named.filter((p) => p.at <= at).pop() || named[0];
      return list.find((p, i) => at >= p.at && (!list[i + 1] || at < list[i + 1].at));
    };
    const rows = [];
    for (const p of list) {
      rows.push({ cells: [el("span", {}, el("span", { class: `swatch phase-${p.name}` }), p.name), new Date(p.at).toLocaleTimeString(), p.terminal ? "" : `${duration(p.ms)}${p.open ? " (so far)" : ""}`] });
      for (const e of progress) {
        if (phaseOf(e) === p) rows.push({ cls: "sub", cells: [`↳ ${describeProgress(e.data)}`, new Date(Date.parse(e.data.at)).toLocaleTimeString(), ""] });
      }
    }
    box.append(table([{ label: "stage" }, { label: "at" }, { label: "took", num: true }], rows));
  }

  function describeProgress(d) {
    const what = d.what || d.kind;
    if (what === "replay" && !d.replayed_groups && !d.folded_groups) return "no earlier Q&A to replay";
    if (what === "replay") return `replaying ${fmt(d.replayed_groups || 0)} Q&A groups ${range(d.replayed_ordinals)}${d.folded_groups ? `, folding ${d.folded_groups}` : ""}`;
    if (what === "summary_chunk") return `${String(d.purpose || "summary").replace("_", " ")} chunk ${d.chunk}/${d.chunks}`;
    if (what === "context_summary_cache") return `context summary cache ${d.cache}`;
    if (what === "waiting_for_background") return "waiting for a background summary job";
    if (what === "context_masked") return `masked the tool output of ${fmt(num(d.masked_messages))} older messages (${bytes(num(d.payload_bytes))} elided) for tier ${d.tier}`;
    if (what === "overflow_retry") return "context overflow: retrying once, smaller";
    const rest = Object.entries(d).filter(([k]) => !["request_id", "ordinal", "seq", "at", "stage", "what"].includes(k));
    return [what ? String(what).replace(/_/g, " ") : "progress", ...rest.map(([k, v]) => `${k}=${JSON.stringify(v)}`)].join(" ");
  }

  // ------------------------------------------------------------------ context budget

  // One stacked bar: the estimate's segments, then what is left of the input budget, then the
  // output cap and the safety margin — together the model's window. Widths are proportional to
  // tokens (a request over its budget makes the bar longer than the window, and the line shows
  // where the input budget ends).
  // Why a request has no context_info: not prepared yet, or it ended before (or was restored from an
  // archive without one: a v1 or v2 archive carries none).
  function unprepared(what) {
    const r = state.record;
    if (r && TERMINAL.has(r.status)) return `${what}: it ended before it was prepared, or was restored from an archive that does not carry one.`;
    return `${what} yet: the request has not been prepared.`;
  }

  function renderBudget(info) {
    const box = $("budget");
    box.replaceChildren();
    const estimate = info.estimate;
    if (!estimate || typeof info.input_budget !== "number") {
      box.append(el("p", { class: "hint", text: unprepared("No budget") }));
      return;
    }
    const budget = num(info.input_budget);
    const output = num(info.max_output_tokens);
    const margin = num(info.safety_margin);
    const used = SEGMENTS.reduce((a, s) => a + num(estimate[s]), 0);
    const total = num(estimate.total) || used;
    const free = Math.max(0, budget - used);
    const full = Math.max(num(info.window), budget + output + margin, used + output + margin);
    const scale = full > 0 ? 1000 / full : 0;
    const bar = svg("svg", { id: "budget-bar", class: "bar", viewBox: "0 0 1000 20", preserveAspectRatio: "none", role: "img",
      "aria-label": `context budget: ${fmt(total)} of ${fmt(budget)} input tokens estimated, output cap ${fmt(output)}, margin ${fmt(margin)}`,
      "data-scale": scale });
    let x = 0;
    const part = (name, tokens, label) => {
      const w = tokens * scale;
      bar.append(svg("rect", { x: x.toFixed(4), y: 0, width: w.toFixed(4), height: 20, class: `seg-${name}`, "data-segment": name, "data-tokens": tokens },
        svg("title", {}, document.createTextNode(`${label}: ${fmt(tokens)} tokens`))));
      x += w;
    };
    for (const s of SEGMENTS) part(s, num(estimate[s]), SEGMENT_LABEL[s]);
    part("free", free, "unused input budget");
    part("output", output, "output cap");
    part("margin", margin, "safety margin");
    const line = budget * scale;
    bar.append(svg("line", { x1: line.toFixed(4), x2: line.toFixed(4), y1: 0, y2: 20, class: "budget-line", "vector-effect": "non-scaling-stroke" }));
    box.append(bar);
    box.append(el("p", { class: "caption", text: `${fmt(total)} of ${fmt(budget)} input tokens (${pct(total, budget)}) · window ${fmt(info.window)} = input budget + output cap ${fmt(output)} + margin ${fmt(margin)}${total > budget ? " · over budget" : ""}` }));
    const rows = SEGMENTS.map((s) => ({ cells: [el("span", {}, el("span", { class: `swatch seg-${s}` }), SEGMENT_LABEL[s]), num(estimate[s]), pct(num(estimate[s]), budget)] }));
    rows.push({ cls: "sub", cells: [el("span", {}, el("span", { class: "swatch seg-free" }), "unused input budget"), free, pct(free, budget)] });
    rows.push({ cls: "sub", cells: [el("span", {}, el("span", { class: "swatch seg-output" }), "output cap (not input)"), output, ""] });
    rows.push({ cls: "sub", cells: [el("span", {}, el("span", { class: "swatch seg-margin" }), "safety margin (not input)"), margin, ""] });
    box.append(table([{ label: "segment" }, { label: "tokens", num: true }, { label: "of budget", num: true }], rows, ["estimate total", total, pct(total, budget)]));
    const extra = [];
    if (typeof info.provider_prompt_tokens === "number") extra.push(`provider counted ${fmt(info.provider_prompt_tokens)} prompt tokens (drift ${info.drift === null || info.drift === undefined ? "—" : info.drift})`);
    const cal = info.calibration;
    if (cal && typeof cal === "object") extra.push(`calibration ratio ${typeof cal.ratio === "number" ? Number(cal.ratio.toPrecision(6)) : cal.ratio} from ${fmt(cal.samples)} samples${cal.applied ? " (applied)" : " (not applied)"}`);
    if (extra.length) box.append(el("p", { class: "caption", text: extra.join(" · ") }));
  }

  // ------------------------------------------------------------------ summarised and kept

  function madeBy(part) {
    if (!part || !("made_by" in part)) return "";
    const who = part.made_by === null ? "no summary used" : `made by ${part.made_by === "background" ? "a background job" : "a request"}`;
    return `${who}${num(part.waited_ms) > 0 ? `, waited ${duration(part.waited_ms)}` : ""}`;
  }

  function renderMemory(info) {
    const box = $("memory");
    box.replaceChildren();
    if (!info || !Object.keys(info).length) {
      box.append(el("p", { class: "hint", text: unprepared("Nothing recorded") }));
      return;
    }
    const qa = info.qa_summary || {};
    const cs = info.context_summary || {};
    const fidelity = info.fidelity && typeof info.fidelity === "object" ? info.fidelity : null;
    const dl = el("dl", { class: "facts", id: "memory-facts" });
    facts(dl, [
      ["replayed Q&A", `${fmt(info.replayed_groups ?? 0)} groups verbatim, ordinals ${range(info.replayed_ordinals)}`],
      ["Q&A summary", qa.used
        ? `used, covers #${qa.first_ordinal ?? 1}–#${qa.covered_through_ordinal}${qa.updated ? " (updated by this request)" : ""}${num(qa.calls) ? `, ${qa.calls} calls` : ""}${madeBy(qa) ? `; ${madeBy(qa)}` : ""}`
        : "not used"],
      ["main context", mainContext(cs, fidelity)],
      ["context summary", cs.used
        ? `cache ${cs.cache}, ${fmt(cs.chunks ?? 0)} chunks, ${fmt(cs.calls ?? 0)} calls${madeBy(cs) ? `; ${madeBy(cs)}` : ""}`
        : cs.cache && cs.cache !== "none" ? `cache ${cs.cache}` : undefined],
      ["summary calls", info.summary_calls],
      ["overflow retries", info.overflow_retries],
    ]);
    box.append(dl);
    if (fidelity) {
      box.append(fidelityBlock(fidelity));
      return;
    }
    if (state.record && !state.record.snapshot_id) {
      box.append(el("p", { class: "hint", id: "fidelity-none", text: "Snapshot fidelity: no snapshot." }));
      return;
    }
    // No fidelity yet (the answer request is not built) or from a server before SPEC 6.10: the
    // context summary's own split of summarised and kept messages.
    const summarized = num(cs.summarized_messages);
    const kept = num(cs.kept_messages);
    if (summarized + kept > 0) {
      const all = summarized + kept;
      const strip = svg("svg", { id: "messages-bar", class: "bar strip", viewBox: "0 0 1000 10", preserveAspectRatio: "none", role: "img", "aria-label": `${summarized} messages summarised, ${kept} kept verbatim` });
      strip.append(svg("rect", { x: 0, y: 0, width: ((1000 * summarized) / all).toFixed(3), height: 10, class: "seg-summarized", "data-part": "summarized" }));
      strip.append(svg("rect", { x: ((1000 * summarized) / all).toFixed(3), y: 0, width: ((1000 * kept) / all).toFixed(3), height: 10, class: "seg-kept", "data-part": "kept" }));
      box.append(strip);
      box.append(el("p", { class: "caption" }, el("span", { class: "swatch seg-summarized" }), `summarised (oldest ${summarized})  `, el("span", { class: "swatch seg-kept" }), `verbatim (newest ${kept})`));
    }
  }

  // The main context in one line. Kept messages are verbatim only when nothing was masked: with
  // masking (SPEC 6.8) some of them went with their tool output elided, and fidelity says how many.
  function mainContext(cs, fidelity) {
    const masked = fidelity ? num(fidelity.masked_messages) : 0;
    const thinned = `${fmt(masked)} with their tool output masked`;
    if (cs.used) {
      return masked
        ? `${fmt(cs.summarized_messages)} older messages summarised, ${fmt(cs.kept_messages)} later kept (${thinned})`
        : `${fmt(cs.summarized_messages)} older messages summarised, ${fmt(cs.kept_messages)} recent kept verbatim`;
    }
    if (num(cs.kept_messages) > 0) {
      return masked ? `sent without a summary (${fmt(cs.kept_messages)} messages, ${thinned})` : `sent verbatim (${fmt(cs.kept_messages)} messages)`;
    }
    return "no snapshot messages";
  }

  // ------------------------------------------------------------------ snapshot fidelity (SPEC 6.10)

  // Oldest first, as the ladder works: the summarised groups, then the masked ones, then the
  // verbatim recent part (a masked group's tool call is unchanged and counts as verbatim).
  const FIDELITY_PARTS = [
    { part: "summarized", label: "summarised", field: "summarized_messages" },
    { part: "masked", label: "masked", field: "masked_messages" },
    { part: "verbatim", label: "verbatim", field: "verbatim_messages" },
  ];
  const TIER_TEXT = {
    none: "the whole snapshot went to the model verbatim",
    masked: "the oldest tool output was elided (masked); nothing was summarised",
    summary: "the oldest messages went into a summary with their artifact trail; later tool output masked as needed",
  };

  // Decimal units, as `sidequest ask` writes them: 950 bytes, 4.2 KB, 310 KB, 1.2 MB.
  function bytes(n) {
    if (n < 1000) return `${n} byte${n === 1 ? "" : "s"}`;
    let value = n / 1000;
    let unit = "KB";
    for (const larger of ["MB", "GB"]) {
      if (Math.round(value) < 1000) break;
      value /= 1000;
      unit = larger;
    }
    return `${value < 9.95 ? value.toFixed(1) : value.toFixed(0)} ${unit}`;
  }

  // The tier, ONE stacked bar of summarised / masked / verbatim messages (widths proportional to
  // their counts, in the budget bar's visual language) with a legend of counts, and the artifacts
  // (what a person names a tool call by) the answer request carries of all in the snapshot.
  function fidelityBlock(f) {
    const counts = FIDELITY_PARTS.map((p) => ({ ...p, n: num(f[p.field]) }));
    const all = counts.reduce((a, p) => a + p.n, 0);
    const payload = num(f.masked_payload_bytes);
    const note = (p) => (p.part === "masked" && p.n > 0 ? ` (${bytes(payload)} of tool output elided)` : "");
    const said = counts.map((p) => `${fmt(p.n)} ${p.label}${note(p)}`).join(", ");
    const wrap = el("div", { id: "fidelity", class: "fidelity", "data-tier": f.tier });
    wrap.append(el("h4", { text: "Snapshot fidelity" }));
    wrap.append(el("p", { id: "fidelity-tier", class: "fidelity-tier" },
      el("span", { class: "badge tier", text: `tier ${f.tier}` }), ` ${TIER_TEXT[f.tier] || ""}`));
    if (all > 0) {
      const bar = svg("svg", { id: "fidelity-bar", class: "bar strip", viewBox: "0 0 1000 10", preserveAspectRatio: "none", role: "img",
        "aria-label": `${fmt(all)} snapshot messages: ${said}` });
      let x = 0;
      for (const p of counts) {
        const w = (1000 * p.n) / all;
        bar.append(svg("rect", { x: x.toFixed(3), y: 0, width: w.toFixed(3), height: 10, class: `seg-${p.part}`, "data-part": p.part, "data-messages": p.n },
          svg("title", {}, document.createTextNode(`${p.label}: ${fmt(p.n)} message${p.n === 1 ? "" : "s"}${note(p)}`))));
        x += w;
      }
      wrap.append(bar);
    }
    // The legend repeats the bar in words, so nothing depends on telling the colours apart.
    wrap.append(el("ul", { id: "fidelity-legend", class: "legend" }, counts.map((p) =>
      el("li", { "data-part": p.part }, el("span", { class: `swatch seg-${p.part}` }), `${p.label} ${fmt(p.n)}${note(p)}`))));
    const artifacts = f.artifacts && typeof f.artifacts === "object" ? f.artifacts : {};
    wrap.append(el("p", { id: "fidelity-artifacts", class: "caption", text: num(artifacts.total) > 0
      ? `artifacts in the prompt: ${fmt(num(artifacts.in_prompt))} of ${fmt(num(artifacts.total))}`
      : "artifacts in the prompt: none (the snapshot has no tool calls)" }));
    return wrap;
  }

  // ------------------------------------------------------------------ usage

  function renderUsage(usage) {
    const box = $("usage");
    box.replaceChildren();
    const calls = Array.isArray(usage.calls) ? usage.calls : [];
    if (!calls.length) {
      box.append(el("p", { class: "hint", text: "No provider calls yet." }));
      return;
    }
    // One model for every call (the usual case): say it once instead of in a column.
    const models = new Set(calls.map((c) => c.model));
    const oneModel = models.size === 1;
    const head = [{ label: "#" }, { label: "purpose" }, ...(oneModel ? [] : [{ label: "model" }]), { label: "status" },
      { label: "input", num: true }, { label: "cached", num: true }, { label: "output", num: true }, { label: "reasoning", num: true }];
    const rows = calls.map((c, i) => ({ cells: [i + 1, c.purpose, ...(oneModel ? [] : [c.model]), `${c.status}${c.reported === false ? " (unreported)" : ""}`,
      c.input_tokens, c.cached_tokens, c.output_tokens, c.reasoning_tokens] }));
    const foot = ["", "total", ...(oneModel ? [] : [""]), "", usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens];
    if (oneModel) box.append(el("p", { class: "caption", text: `every call to ${[...models][0]}` }));
    box.append(table(head, rows, foot));
  }

  // ------------------------------------------------------------------ actions

  async function ask(event) {
    event.preventDefault();
    const question = $("question").value;
    if (!question.trim()) return notice("write a question first", true);
    const body = { question };
    const file = $("snapshot-file").files[0];
    if (file) {
      try {
        body.snapshot = JSON.parse(await file.text());
      } catch (err) {
        return notice(`${file.name} is not valid JSON: ${err.message}`, true);
      }
    }
    $("ask").disabled = true;
    try {
      const record = await api("POST", `/v1/sessions/${enc(state.parentId)}/questions`, body);
      $("question").value = "";
      notice(`question #${record.ordinal} admitted`);
      await loadSessions(false);
      await loadSession();
      await openRequest(record.id);
    } finally {
      $("ask").disabled = false;
    }
  }

  async function cancel() {
    const record = await api("POST", `/v1/questions/${enc(state.requestId)}/cancel`);
    notice(`request #${record.ordinal} is ${record.status}`);
    Object.assign(state.record, record);
    renderRequest();
    refreshRecord(record.id, 1500); // the stopped call's usage and model land just after the cancel
    await refreshSession();
  }

  async function pin() {
    const pinned = Boolean(state.record.pinned);
    const record = await api(pinned ? "DELETE" : "POST", `/v1/questions/${enc(state.requestId)}/pin`);
    state.record.pinned = record && typeof record.pinned === "boolean" ? record.pinned : !pinned;
    notice(`request #${state.record.ordinal} ${state.record.pinned ? "pinned for the next hand-off" : "unpinned"}`);
    renderRequest();
    await refreshSession();
  }

  function confirmClear() {
    $("confirm-text").textContent = `This cancels what is queued or running in ${state.parentId} and deletes its history and memory (ordinals keep counting). It cannot be undone.`;
    $("confirm-clear").showModal();
    $("confirm-no").focus();
  }

  async function clear() {
    $("confirm-clear").close();
    const result = await api("DELETE", `/v1/sessions/${enc(state.parentId)}/questions`);
    notice(`cleared ${result.cleared_requests} requests (${result.cancelled_requests} cancelled); clear version ${result.clear_version}`);
    closeRequest();
    await loadSession();
    await loadSessions(false);
  }

  // Q&A left out to fit are not carried; those not handed off before are pinned for the next
  // (docs/handoff.md): say which were left out.
  // Runs of consecutive ordinals as ranges, as the block itself writes them (#1–#3, #7).
  function leftOut(omitted) {
    if (!omitted || !omitted.length) return "";
    const runs = [];
    for (const o of [...new Set(omitted)].sort((a, b) => a - b)) {
      if (runs.length && o === runs[runs.length - 1][1] + 1) runs[runs.length - 1][1] = o;
      else runs.push([o, o]);
    }
    const named = runs.map(([a, b]) => (a === b ? `#${a}` : `#${a}–#${b}`)).join(", ");
    return ` · left out to fit: ${named} (pinned for the next hand-off unless handed off before)`;
  }

  async function handoff(event) {
    event.preventDefault();
    const body = { format: $("handoff-format").value };
    if ($("handoff-all").checked) body.include = "all";
    const result = await api("POST", `/v1/sessions/${enc(state.parentId)}/handoffs`, body);
    $("handoff-result").hidden = false;
    const ordinals = result.ordinals || [];
    $("handoff-meta").textContent = ordinals.length
      ? `ordinals ${ordinals.map((o) => `#${o}`).join(", ")} · ~${fmt(result.estimate_tokens)} tokens${(result.summarized_ordinals || []).length ? ` · summarised: ${result.summarized_ordinals.map((o) => `#${o}`).join(", ")}` : ""}${(result.shortened_ordinals || []).length ? " · shortened to fit" : ""}${leftOut(result.omitted_ordinals)}`
      : "nothing new to hand off";
    $("handoff-text").textContent = result.message && body.format !== "text" ? JSON.stringify(result.message, null, 2) : result.text || "";
    notice(ordinals.length ? `handed off ${ordinals.length} answers` : "nothing to hand off");
    await refreshSession();
  }

  async function downloadArchive() {
    const version = $("archive-version").value;
    const document_ = await api("GET", `/v1/sessions/${enc(state.parentId)}/archive?version=${enc(version)}`);
    const blob = new Blob([`${JSON.stringify(document_, null, 2)}\n`], { type: "application/json" });
    const link = el("a", { href: URL.createObjectURL(blob), download: `${state.parentId.replace(/[^\w.-]+/g, "_")}-archive-v${version}.json` });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
    const n = (document_.questions || []).length;
    notice(`archive v${version} of ${state.parentId} downloaded (${n} request${n === 1 ? "" : "s"})`);
  }

  // ------------------------------------------------------------------ wiring

  function setHash() {
    const params = new URLSearchParams();
    if (state.parentId) params.set("session", state.parentId);
    if (state.requestId) params.set("request", state.requestId);
    history.replaceState(null, "", `#${params}`);
  }

  const CONNECT_HINT = "Paste a token and press Connect to list this tenant's sessions.";

  async function connect() {
    notice("");
    try {
      await loadSessions(false);
    } catch (err) {
      if (err.status === 401) {
        // A token the server refuses is not kept, and the list says what to do instead of "no sessions".
        sessionStorage.removeItem(TOKEN_KEY);
        $("session-list").replaceChildren();
        $("sessions-empty").hidden = false;
        $("sessions-empty").textContent = CONNECT_HINT;
      }
      throw err;
    }
    const params = new URLSearchParams(location.hash.slice(1));
    const parentId = params.get("session");
    if (parentId && !state.parentId) {
      await openSession(parentId);
      const requestId = params.get("request");
      if (requestId) {
        try {
          await openRequest(requestId);
        } catch (err) {
          if (err.status !== 404) throw err;
          // The address named a request this token cannot see (another tenant's, or cleared): drop it.
          closeRequest();
          setHash();
          notice("the request in the address is not one of this token's requests", true);
        }
      }
    }
  }

  function on(id, type, handler, what) {
    $(id).addEventListener(type, (event) => {
      Promise.resolve(handler(event)).catch(failed(what));
    });
  }

  // Nothing of the last token's tenant stays on screen: no session, request, answer or hand-off.
  function resetView() {
    closeRequest();
    state.parentId = null;
    state.requestId = null;
    setHash(); // the address no longer names the session (the next token may be another tenant's)
    $("session").hidden = true;
    $("session-list").replaceChildren();
    $("sessions-more").hidden = true;
    $("sessions-empty").hidden = false;
    $("sessions-empty").textContent = CONNECT_HINT;
    // The Ask form too: a draft question and a chosen snapshot file are the last tenant's, and would
    // otherwise be sent into the next tenant's session.
    $("question").value = "";
    $("snapshot-file").value = "";
    $("open-parent").value = "";
    $("handoff-result").hidden = true;
  }

  $("token").value = token();
  on("token-form", "submit", (event) => {
    event.preventDefault();
    const next = $("token").value.trim();
    // Another token may be another tenant's: start clean, as after Forget, so no session or answer
    // of the last tenant stays on screen.
    if (sessionStorage.getItem(TOKEN_KEY) !== next) resetView();
    // An empty token is kept too: it means "this server has no auth", and a reload reconnects.
    sessionStorage.setItem(TOKEN_KEY, next);
    return connect();
  }, "listing sessions");
  on("forget", "click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    resetView();
    notice("token forgotten");
  }, "forgetting the token");
  on("open-form", "submit", (event) => {
    event.preventDefault();
    const value = $("open-parent").value.trim();
    return value ? openSession(value) : undefined;
  }, "opening the session");
  on("sessions-more", "click", () => loadSessions(true), "listing sessions");
  on("history-more", "click", () => loadHistory(true), "loading history");
  on("refresh", "click", async () => {
    await refreshSession();
    await loadSessions(false);
  }, "refreshing the session");
  on("ask-form", "submit", ask, "asking");
  on("cancel", "click", cancel, "cancelling");
  on("pin", "click", pin, "pinning");
  on("clear", "click", confirmClear, "clearing");
  on("confirm-yes", "click", clear, "clearing");
  on("confirm-no", "click", () => $("confirm-clear").close(), "closing the dialog");
  on("handoff-form", "submit", handoff, "the hand-off");
  on("archive", "click", downloadArchive, "the archive download");

  // Connected earlier in this tab (with a token, or with none for a server without auth):
  // reconnect at once; otherwise wait for Connect.
  if (sessionStorage.getItem(TOKEN_KEY) !== null) connect().catch(failed("listing sessions"));
})();
