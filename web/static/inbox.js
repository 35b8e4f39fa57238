// prompt-broker inbox: plain JavaScript, no build step, no library, nothing fetched but our API.
// Every piece of text from the server goes into the page through textContent, never as HTML.
"use strict";
(() => {
  const TITLE = "prompt-broker inbox";
  const POLL_MS = 3000; // the fallback poll while the event stream is down
  const SAFETY_MS = 30000; // a slow re-read even while live: the snapshot is the truth
  const THREAD_MS = 4000; // the open thread's items (agent output has no event of its own)
  const $ = (id) => document.getElementById(id);
  const timing = window.pbTiming; // timing.js: deadlines, escalation, reminders

  const state = {
    me: null,
    csrf: "",
    prompts: new Map(), // prompt_id -> Prompt, what waits now
    order: [], // prompt ids as listed (grouped by thread)
    selected: null, // the prompt id the detail pane shows
    view: null, // {pid, threadId, kind, prompt, form, locked}
    sent: new Set(), // prompts this page answered (their retirement is ours, not news)
    reminded: new Set(), // prompts a reminder came for while this page was open
    es: null,
    live: false,
    pollTimer: null,
    safetyTimer: null,
    refreshing: null,
    again: false,
    loaded: false,
    threadTimer: null,
  };

  // -- small helpers -----------------------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (v === true) el.setAttribute(k, "");
      else el.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  // Text with `inline code`, as the agents write their questions.
  function inline(text) {
    const out = [];
    const parts = String(text).split(/(`[^`\n]+`)/);
    for (const p of parts) {
      if (p.length > 2 && p.startsWith("`") && p.endsWith("`")) out.push(h("code", {}, p.slice(1, -1)));
      else if (p) out.push(p);
    }
    return out;
  }

  function paragraphs(text) {
    return String(text)
      .split(/\n{2,}/)
      .filter((p) => p.trim())
      .map((p) => h("p", {}, inline(p)));
  }

  function age(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return "";
    const s = Math.max(0, Math.round((Date.now() - t) / 1000));
    if (s < 10) return "just now";
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }

  function ageWords(iso) {
    const a = age(iso);
    return a === "just now" || a === "" ? a || "" : `${a} ago`;
  }

  function when(iso) {
    const t = Date.parse(iso);
    return Number.isNaN(t) ? "" : new Date(t).toLocaleString();
  }

  const KIND = { approval: "Approval", ask_user_question: "Question", text: "Reply" };

  function firstLine(text) {
    return String(text || "").split("\n").find((l) => l.trim()) || "";
  }

  function summary(p) {
    const q = (p.questions || [])[0] || {};
    if (p.kind === "approval") {
      const a = parseApproval(q.question || "");
      const what = a.commands[0] || a.files[0] || "";
      return what ? `${q.subject || q.header || "Run"}: ${what}` : firstLine(q.question).replace(/`/g, "");
    }
    const n = (p.questions || []).length;
    const head = firstLine(q.question).replace(/`/g, "");
    return n > 1 ? `${head} (+${n - 1} more)` : head;
  }

  function answersText(answers) {
    return (answers || []).map((a) => (a.answer || []).join(", ") || "(no answer)").join("; ");
  }

  function uuid() {
    const b = new Uint8Array(16);
    crypto.getRandomValues(b); // randomUUID needs a secure context; this works over plain http too
    return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  }

  const enc = encodeURIComponent;

  async function api(method, path, body, headers) {
    const hs = { Accept: "application/json", ...(headers || {}) };
    if (body !== undefined) hs["Content-Type"] = "application/json";
    if (method !== "GET" && state.csrf) hs["X-CSRF-Token"] = state.csrf;
    const r = await fetch(path, {
      method,
      headers: hs,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
      cache: "no-store",
    });
    let data = null;
    if (r.status !== 204) {
      try {
        data = await r.json();
      } catch {
        data = null;
      }
    }
    if (r.status === 401 && path !== "/v1/session") signOutLocally("Your session ended. Sign in again.");
    return { status: r.status, ok: r.ok, data };
  }

  function errorMessage(r) {
    const e = r.data && r.data.error;
    if (!e) return `the server answered ${r.status}`;
    return e.field ? `${e.field}: ${e.message}` : e.message;
  }

  // -- approval payloads ---------------------------------------------------------------------
  // The agent's call is in the question's text, shaped by the harness: the intent first, then
  // the command or path in backticks, Codex's "in <folder>", and Codex's file list, one
  // `path` (kind) per line.
  function parseApproval(text) {
    const out = { intent: "", commands: [], files: [], cwd: "", rest: [] };
    const paras = String(text).split(/\n{2,}/);
    out.intent = paras.shift() || "";
    for (const raw of paras) {
      const p = raw.trim();
      if (!p) continue;
      const lines = p.split("\n");
      if (/^in \S/.test(p) && lines.length === 1) out.cwd = p.slice(3).trim();
      else if (lines.length > 1 && lines.every((l) => /^`[^`]+`( \(.+\))?$/.test(l) || /^and \d+ more$/.test(l)))
        out.files.push(...lines.map((l) => l.replace(/^`([^`]+)`/, "$1")));
      else if (p.length > 2 && p.startsWith("`") && p.endsWith("`")) out.commands.push(p.slice(1, -1));
      else out.rest.push(p);
    }
    return out;
  }

  function isFileTool(q) {
    return /^(Edit|Write|MultiEdit|NotebookEdit|Read)$|fileChange|file change/i.test(q.subject || q.header || "");
  }

  // -- sign-in -------------------------------------------------------------------------------

  function showSignIn(message) {
    $("app").hidden = true;
    $("who").hidden = true;
    $("signin").hidden = false;
    $("signin-error").textContent = message || "";
    setConn("offline", "Signed out");
    document.title = TITLE;
    $("token").focus();
  }

  function signOutLocally(message) {
    stopStream();
    state.me = null;
    state.csrf = "";
    state.prompts.clear();
    state.order = [];
    state.selected = null;
    state.view = null;
    state.loaded = false;
    showSignIn(message);
  }

  function signedIn(session) {
    state.me = session;
    state.csrf = session.csrf_token || "";
    $("signin").hidden = true;
    $("app").hidden = false;
    $("who").hidden = false;
    $("who-name").textContent = `Signed in as ${session.name}`;
    refresh();
    connect();
  }

  async function onSignIn(ev) {
    ev.preventDefault();
    const input = $("token");
    const token = input.value.trim();
    if (!token) {
      $("signin-error").textContent = "Paste your token first.";
      return;
    }
    $("signin-error").textContent = "";
    let r;
    try {
      r = await api("POST", "/v1/session", { token });
    } catch {
      $("signin-error").textContent = "The server could not be reached.";
      return;
    }
    if (r.ok) {
      input.value = ""; // the cookie carries the session; the token is not kept in the page
      signedIn(r.data);
    } else if (r.status === 401) {
      $("signin-error").textContent = "That token was not accepted.";
    } else {
      $("signin-error").textContent = `Sign-in failed: ${errorMessage(r)}`;
    }
  }

  async function onSignOut() {
    try {
      await api("DELETE", "/v1/session");
    } catch {
      /* signed out here either way */
    }
    signOutLocally("Signed out.");
  }

  // -- live updates --------------------------------------------------------------------------

  function setConn(kind, text) {
    const words = {
      live: "Live",
      connecting: "Connecting…",
      polling: `Reconnecting; checking every ${POLL_MS / 1000} s`,
      offline: "Offline",
    };
    $("conn").dataset.state = kind;
    $("conn-text").textContent = text || words[kind];
  }

  function stopStream() {
    if (state.es) state.es.close();
    state.es = null;
    state.live = false;
    clearInterval(state.pollTimer);
    clearInterval(state.safetyTimer);
    state.pollTimer = state.safetyTimer = null;
  }

  function startPoll() {
    if (!state.pollTimer) state.pollTimer = setInterval(refresh, POLL_MS);
  }

  function stopPoll() {
    clearInterval(state.pollTimer);
    state.pollTimer = null;
  }

  function connect() {
    if (state.es) state.es.close();
    setConn("connecting");
    const es = new EventSource("/v1/events"); // the session cookie goes along (same origin)
    state.es = es;
    if (!state.safetyTimer) state.safetyTimer = setInterval(refresh, SAFETY_MS);
    es.addEventListener("open", () => {
      state.live = true;
      setConn("live");
      stopPoll();
    });
    es.addEventListener("error", async () => {
      if (state.es !== es) return;
      state.live = false;
      setConn(navigator.onLine === false ? "offline" : "polling");
      startPoll();
      if (es.readyState === EventSource.CLOSED) {
        // The server refused the stream (signed out, or unavailable): check, then try again.
        es.close();
        try {
          const r = await api("GET", "/v1/session");
          if (!r.ok) return;
        } catch {
          /* unreachable: keep polling, try the stream again */
        }
        setTimeout(() => state.me && state.es === es && connect(), POLL_MS);
      }
    });
    es.addEventListener("ready", () => {
      state.live = true;
      setConn("live");
      stopPoll();
      refresh(); // events only say when to look; the snapshot is the truth
    });
    es.addEventListener("reset", () => refresh());
    es.addEventListener("prompt.opened", (e) => {
      refresh();
      threadEvent(parse(e));
    });
    es.addEventListener("prompt.reminder", (e) => {
      const d = parse(e);
      if (!d || !d.prompt_id) return;
      state.reminded.add(d.prompt_id);
      renderList();
      if (state.view && state.view.pid === d.prompt_id) renderFlags(state.view.prompt);
    });
    // Escalated: it may now be ours to answer (a group's), and its card says so.
    es.addEventListener("prompt.escalated", () => refresh());
    for (const name of ["prompt.answered", "prompt.cancelled"]) {
      es.addEventListener(name, (e) => {
        const d = parse(e);
        if (d && d.prompt_id) retire(d.prompt_id, { ...d, state: name === "prompt.answered" ? "answered" : "cancelled" });
        threadEvent(d);
      });
    }
  }

  function parse(e) {
    try {
      return JSON.parse(e.data);
    } catch {
      return null;
    }
  }

  function threadEvent(d) {
    if (!d || !state.view || d.thread_id !== state.view.threadId) return;
    clearTimeout(state.threadTimer);
    state.threadTimer = setTimeout(() => loadThread(d.thread_id), 150);
  }

  // Read the whole list of what waits (every page), then retire what left it.
  function refresh() {
    if (!state.me) return Promise.resolve();
    if (state.refreshing) {
      state.again = true;
      return state.refreshing;
    }
    state.refreshing = (async () => {
      try {
        do {
          state.again = false;
          await refreshOnce();
        } while (state.again);
      } finally {
        state.refreshing = null;
      }
    })();
    return state.refreshing;
  }

  async function refreshOnce() {
    const next = new Map();
    let cursor = "";
    for (let page = 0; page < 50; page++) {
      let r;
      try {
        r = await api("GET", `/v1/prompts?limit=200${cursor ? `&cursor=${enc(cursor)}` : ""}`);
      } catch {
        if (!state.live) setConn("offline");
        return;
      }
      if (!r.ok) return;
      for (const p of r.data.prompts) next.set(p.prompt_id, p);
      cursor = r.data.next_cursor;
      if (!cursor) break;
    }
    if (!state.live && state.es && state.es.readyState !== EventSource.OPEN) setConn("polling");
    const gone = [...state.prompts.keys()].filter((pid) => !next.has(pid));
    state.prompts = next;
    renderList();
    if (state.view && next.has(state.view.pid)) renderFlags(next.get(state.view.pid)); // escalated since
    for (const pid of gone) retire(pid, null);
    // The bell of a supersede can come before the snapshot holds the newer prompt: once it
    // does, the locked form's note gains its way to the newer one.
    const v = state.view;
    if (v && v.locked && v.why) showNote(v, explain(v, v.why.real, v.why.hint), v.why);
    if (!state.loaded) {
      state.loaded = true;
      const wide = window.matchMedia("(min-width: 761px)").matches;
      if (wide && !state.selected && state.order.length) select(state.order[0], false);
    }
  }

  // -- the list ------------------------------------------------------------------------------

  function renderList() {
    const groups = new Map();
    for (const p of state.prompts.values()) {
      if (!groups.has(p.thread_id)) groups.set(p.thread_id, []);
      groups.get(p.thread_id).push(p);
    }
    const root = $("groups");
    root.replaceChildren();
    state.order = [];
    let i = 0;
    for (const [threadId, ps] of groups) {
      const gid = `g-${i++}`;
      const harness = ps[0].harness ? ` · ${ps[0].harness}` : "";
      const list = h("ul", { "aria-labelledby": gid });
      for (const p of ps) {
        state.order.push(p.prompt_id);
        const current = p.prompt_id === state.selected;
        list.append(
          h(
            "li",
            {},
            h(
              "button",
              {
                type: "button",
                class: "entry",
                "data-pid": p.prompt_id,
                "aria-current": current ? "true" : null,
                "aria-label": `${KIND[p.kind] || p.kind} on ${threadId}: ${summary(p)}; waiting ${age(p.created_at)}${timing.words(p, state.reminded.has(p.prompt_id))}`,
                onclick: () => select(p.prompt_id, true),
              },
              h(
                "span",
                { class: "top" },
                h("span", { class: `badge ${p.kind}` }, KIND[p.kind] || p.kind),
                h("time", { class: "age", datetime: p.created_at, title: when(p.created_at) }, age(p.created_at)),
              ),
              h("span", { class: "what" }, summary(p)),
              h("span", { class: "flags" }, timing.flags(h, p, state.reminded.has(p.prompt_id))),
            ),
          ),
        );
      }
      root.append(h("section", { class: "group" }, h("h3", { id: gid }, threadId + harness), list));
    }
    const n = state.prompts.size;
    $("count").textContent = String(n);
    $("empty").hidden = n > 0;
    document.title = n ? `(${n}) ${TITLE}` : TITLE;
  }

  function tickAges() {
    for (const t of document.querySelectorAll("time.age")) t.textContent = age(t.getAttribute("datetime"));
  }

  function select(pid, focusDetail) {
    const p = state.prompts.get(pid);
    if (!p) return;
    state.selected = pid;
    for (const b of document.querySelectorAll(".entry")) {
      if (b.dataset.pid === pid) b.setAttribute("aria-current", "true");
      else b.removeAttribute("aria-current");
    }
    renderDetail(p);
    $("app").classList.add("show-detail");
    if (focusDetail) {
      const first = state.view.form.querySelector("input, textarea, button");
      if (window.matchMedia("(max-width: 760px)").matches || !first) $("detail").focus();
    }
  }

  function move(step) {
    if (!state.order.length) return;
    let i = state.order.indexOf(state.selected);
    i = i < 0 ? (step > 0 ? 0 : state.order.length - 1) : Math.min(state.order.length - 1, Math.max(0, i + step));
    select(state.order[i], false);
    const b = document.querySelector(`.entry[data-pid="${CSS.escape(state.order[i])}"]`);
    if (b) {
      b.focus();
      b.scrollIntoView({ block: "nearest" });
    }
  }

  // -- the detail pane -----------------------------------------------------------------------

  function renderDetail(p) {
    const body = $("detail-body");
    const note = h("div", { id: "note", role: "status", "aria-live": "polite" });
    const form = h("form", { id: "answer-form", class: `answer ${p.kind}`, "data-pid": p.prompt_id, novalidate: true });
    const head = h(
      "div",
      { class: "prompt-head" },
      h("span", { class: `badge ${p.kind}` }, KIND[p.kind] || p.kind),
      h("h2", { id: "prompt-title" }, p.thread_id),
      h(
        "span",
        { class: "muted" },
        `asked `,
        h("time", { class: "age-words", datetime: p.created_at, title: when(p.created_at) }, ageWords(p.created_at)),
        p.harness ? ` · ${p.harness}` : "",
      ),
      h("span", { id: "prompt-flags", class: "flags" }),
    );
    form.setAttribute("aria-labelledby", "prompt-title");
    state.view = { pid: p.prompt_id, threadId: p.thread_id, kind: p.kind, prompt: p, form, locked: false, key: null };
    if (p.kind === "approval") buildApproval(p, form);
    else if (p.kind === "ask_user_question") buildQuestions(p, form);
    else buildText(p, form);
    body.replaceChildren(head, note, form);
    renderFlags(p);
    loadThread(p.thread_id);
  }

  function renderFlags(p) {
    const el = $("prompt-flags");
    if (el) el.replaceChildren(...timing.flags(h, p, state.reminded.has(p.prompt_id)));
  }

  function buildApproval(p, form) {
    const qs = p.questions || [];
    for (const q of qs) {
      const a = parseApproval(q.question);
      form.append(h("div", { class: "qtext" }, h("p", { class: "intent" }, inline(a.intent))));
      const facts = h("dl", { class: "facts" });
      facts.append(h("dt", {}, "Tool"), h("dd", {}, h("code", {}, q.subject || q.header || "unknown")));
      const label = isFileTool(q) ? "File" : /Bash|commandExecution|shell/i.test(q.subject || q.header || "") ? "Command" : "Input";
      for (const c of a.commands) facts.append(h("dt", {}, label), h("dd", {}, h("pre", { class: "cmd" }, h("code", {}, c))));
      if (a.files.length)
        facts.append(h("dt", {}, "Files"), h("dd", {}, h("ul", { class: "files" }, a.files.map((f) => h("li", {}, f)))));
      const folder = a.cwd || p.work_folder;
      facts.append(h("dt", {}, "Folder"), h("dd", {}, folder ? h("code", { class: "cwd" }, folder) : h("span", { class: "muted" }, "not given")));
      form.append(facts);
      for (const r of a.rest) form.append(h("div", { class: "qtext" }, paragraphs(r)));
    }
    const q = qs[0] || { options: [] };
    form.append(
      h("label", { for: "deny-msg" }, "Message with a denial (optional)"),
      h("textarea", { id: "deny-msg", name: "message", rows: 2, placeholder: "Why not, or what to do instead" }),
    );
    const actions = h("div", { class: "actions" });
    (q.options || []).forEach((o, i) => {
      const approve = /^approve$/i.test(o.label) || (i === 0 && !/^deny$/i.test(o.label));
      const deny = /^deny$/i.test(o.label);
      actions.append(
        h(
          "button",
          {
            type: "button",
            class: approve && i === 0 ? "primary" : deny ? "danger" : "secondary",
            "data-label": o.label,
            "data-role": approve && i === 0 ? "approve" : deny ? "deny" : null,
            title: o.description || null,
            "aria-keyshortcuts": approve && i === 0 ? "A" : deny ? "D" : null,
            onclick: () => approvalAnswer(o.label),
          },
          o.label,
        ),
      );
    });
    form.append(actions);
    form.addEventListener("submit", (e) => e.preventDefault());
  }

  function approvalAnswer(label) {
    const v = state.view;
    if (!v || v.locked) return;
    const msg = v.form.querySelector("#deny-msg").value.trim();
    const denying = /^deny$/i.test(label);
    // The agent's harness reads a denial's words from the answer's extra strings.
    const answer = denying && msg ? [label, msg] : [label];
    const body = {
      content: denying && msg ? [{ type: "text", text: msg }] : [],
      metadata: { prompt_id: v.pid, answers: (v.prompt.questions || []).map((q) => ({ question: q.question, answer })) },
    };
    send(body);
  }

  function buildQuestions(p, form) {
    (p.questions || []).forEach((q, i) => {
      const fs = h("fieldset", { "data-q": i, "aria-describedby": `q${i}-err` });
      fs.append(h("legend", {}, q.header || `Question ${i + 1}`), h("div", { class: "qtext", id: `q${i}-text` }, paragraphs(q.question)));
      const opts = q.options || [];
      if (opts.length) {
        const type = q.multiSelect ? "checkbox" : "radio";
        fs.setAttribute("role", q.multiSelect ? "group" : "radiogroup");
        opts.forEach((o, j) => {
          const id = `q${i}-o${j}`;
          const desc = o.description ? h("span", { class: "desc", id: `${id}-d` }, o.description) : null;
          fs.append(
            h(
              "label",
              { class: "option", for: id },
              h("input", { type, id, name: `q${i}`, value: String(j), "aria-describedby": desc ? `${id}-d` : null }),
              h("span", {}, h("span", { class: "num", "aria-hidden": "true" }, `${j + 1}`), o.label),
              desc,
            ),
          );
        });
        const oid = `q${i}-other`;
        const text = h("input", {
          type: "text",
          class: "other-text",
          id: `${oid}-text`,
          "aria-label": `Other answer to: ${q.header || firstLine(q.question)}`,
          placeholder: "Your own answer",
        });
        const box = h("input", { type, id: oid, name: `q${i}`, value: "other" });
        text.addEventListener("input", () => {
          if (text.value.trim()) box.checked = true; // typing an answer picks Other
        });
        fs.append(
          h(
            "div",
            { class: "option other" },
            box,
            h("label", { for: oid }, h("span", { class: "num", "aria-hidden": "true" }, `${opts.length + 1}`), "Other"),
            text,
          ),
        );
        if (q.multiSelect) fs.append(h("p", { class: "muted" }, "Pick any number."));
      } else {
        fs.append(
          h("label", { for: `q${i}-free`, class: "muted" }, "Your answer"),
          h("textarea", { id: `q${i}-free`, name: `q${i}-free`, rows: 3 }),
        );
      }
      fs.append(h("p", { class: "field-error", id: `q${i}-err` }));
      form.append(fs);
    });
    form.append(
      h(
        "div",
        { class: "actions" },
        h("button", { type: "submit", class: "primary", "aria-keyshortcuts": "Control+Enter Meta+Enter" }, "Submit answers"),
        h("span", { class: "muted" }, "Ctrl/⌘+Enter"),
      ),
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      submitQuestions();
    });
  }

  function submitQuestions() {
    const v = state.view;
    if (!v || v.locked) return;
    const answers = [];
    let bad = null;
    (v.prompt.questions || []).forEach((q, i) => {
      const fs = v.form.querySelector(`fieldset[data-q="${i}"]`);
      const err = fs.querySelector(".field-error");
      err.textContent = "";
      const opts = q.options || [];
      const answer = [];
      if (opts.length) {
        for (const input of fs.querySelectorAll(`input[name="q${i}"]:checked`)) {
          if (input.value === "other") {
            const t = fs.querySelector(".other-text").value.trim();
            if (!t) {
              err.textContent = "Write your answer next to Other, or unpick it.";
              bad = bad || fs.querySelector(".other-text");
            } else answer.push(t);
          } else answer.push(opts[Number(input.value)].label);
        }
        if (!q.multiSelect && !answer.length && !err.textContent) {
          err.textContent = "Pick one, or write your own under Other.";
          bad = bad || fs.querySelector("input");
        }
      } else {
        const t = fs.querySelector("textarea").value.trim();
        if (!t) {
          err.textContent = "Write an answer.";
          bad = bad || fs.querySelector("textarea");
        } else answer.push(t);
      }
      answers.push({ question: q.question, answer });
    });
    if (bad) {
      bad.focus();
      return;
    }
    // Structured answers, one per question; never flattened to text.
    send({ content: [], metadata: { prompt_id: v.pid, answers } });
  }

  function buildText(p, form) {
    for (const q of p.questions || []) form.append(h("div", { class: "qtext", id: "text-q" }, paragraphs(q.question)));
    form.append(
      h("label", { for: "reply" }, "Your reply"),
      h("textarea", { id: "reply", name: "reply", rows: 5, "aria-describedby": "text-q reply-err" }),
      h("p", { class: "field-error", id: "reply-err" }),
      h(
        "div",
        { class: "actions" },
        h("button", { type: "submit", class: "primary", "aria-keyshortcuts": "Control+Enter Meta+Enter" }, "Send reply"),
        h("span", { class: "muted" }, "Ctrl/⌘+Enter"),
      ),
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const v = state.view;
      if (!v || v.locked) return;
      const t = form.querySelector("#reply").value;
      if (!t.trim()) {
        form.querySelector("#reply-err").textContent = "Write a reply.";
        form.querySelector("#reply").focus();
        return;
      }
      send({ content: [{ type: "text", text: t }], metadata: { prompt_id: v.pid } });
    });
  }

  function setBusy(v, busy) {
    for (const el of v.form.querySelectorAll("button")) el.disabled = busy || v.locked;
  }

  function noteEl(kind, title, ...lines) {
    return h("div", { class: `note ${kind}` }, h("strong", {}, title), ...lines.filter(Boolean).map((l) => h("div", {}, l)));
  }

  function showNote(v, el, why) {
    if (state.view !== v) return;
    v.why = why || null; // what the note explains, so a later snapshot can say it better
    const note = $("note");
    if (note) note.replaceChildren(el);
  }

  function lock(v) {
    v.locked = true;
    v.form.classList.add("locked");
    v.form.setAttribute("aria-disabled", "true");
    // Disabled, not cleared: the draft stays readable (and copyable) where it was.
    for (const el of v.form.querySelectorAll("input, textarea, button")) {
      if (el.tagName === "BUTTON") el.disabled = true;
      else el.readOnly = true;
      if (el.type === "radio" || el.type === "checkbox") el.disabled = true;
    }
  }

  function answersList(answers, questions) {
    const qs = questions || [];
    return h(
      "ul",
      { class: "answers" },
      (answers || []).map((a, i) => {
        const q = qs.find((x) => x.question === a.question) || qs[i] || {};
        return h("li", {}, h("span", { class: "muted" }, `${q.header || firstLine(a.question)}: `), (a.answer || []).join(", ") || "(no answer)");
      }),
    );
  }

  // What a prompt that left the list became, said in the pane if it is the one on screen.
  function explain(v, real, hint) {
    const st = (real && real.state) || (hint && hint.state);
    if (st === "answered") {
      const by = (real && real.answered_by) || (hint && hint.answered_by) || "someone";
      const mine = state.sent.has(v.pid);
      if (mine) return noteEl("ok", "Sent.", "The agent has your answer.", real && real.answers ? answersList(real.answers, v.prompt.questions) : null);
      const at = real && real.resolved_at ? ` ${ageWords(real.resolved_at)}` : " a moment ago";
      return noteEl(
        "info",
        `Already answered by ${by}${at}.`,
        real && real.answers ? answersList(real.answers, v.prompt.questions) : null,
        "Nothing of yours was sent; your draft is kept below, read-only.",
      );
    }
    if (st === "cancelled") {
      const reason = (real && real.reason) || (hint && hint.reason) || "";
      if (reason === "superseded") {
        const newer = [...state.prompts.values()].find((p) => p.thread_id === v.threadId);
        return noteEl(
          "warn",
          "Superseded: the agent asked something newer on this thread.",
          "This form is locked so it cannot answer the wrong question. Your draft is kept below, read-only.",
          newer ? h("button", { type: "button", class: "link", onclick: () => select(newer.prompt_id, true) }, "Open the newer prompt") : null,
        );
      }
      return noteEl("warn", "Cancelled.", reason ? `Reason: ${reason}` : null, "This form is locked; your draft is kept below, read-only.");
    }
    return noteEl("warn", "No longer waiting.", "This prompt left the list; the form is locked and your draft kept.");
  }

  async function retire(pid, hint) {
    const had = state.prompts.delete(pid);
    if (had) renderList();
    const v = state.view;
    if (!v || v.pid !== pid || v.locked) return;
    lock(v);
    showNote(v, explain(v, null, hint), { real: null, hint });
    try {
      const r = await api("GET", `/v1/threads/${enc(v.threadId)}/prompts/${enc(pid)}`);
      if (r.ok && r.data.state !== "pending") showNote(v, explain(v, r.data, hint), { real: r.data, hint });
    } catch {
      /* the note from the event stands */
    }
    loadThread(v.threadId);
  }

  async function send(body) {
    const v = state.view;
    if (!v || v.locked) return;
    const json = JSON.stringify(body);
    if (!v.key || v.keyBody !== json) {
      v.key = uuid(); // a retry of the same answer is the same request: written once
      v.keyBody = json;
    }
    setBusy(v, true);
    showNote(v, noteEl("info", "Sending…"));
    let r = null;
    for (let attempt = 0; attempt < 2 && !r; attempt++) {
      try {
        r = await api("POST", `/v1/threads/${enc(v.threadId)}/items`, body, { "Idempotency-Key": v.key });
      } catch {
        await new Promise((res) => setTimeout(res, 1000));
      }
    }
    if (!r) {
      setBusy(v, false);
      showNote(v, noteEl("bad", "Not sent: the server could not be reached.", "Try again; a retry is not sent twice."));
      return;
    }
    if (r.ok) {
      state.sent.add(v.pid);
      lock(v);
      const d = r.data;
      if (d.outcome === "answered") {
        showNote(
          v,
          noteEl(
            "ok",
            "Sent.",
            "The agent has your answer.",
            d.answers ? answersList(d.answers, v.prompt.questions) : null,
            d.refused_answers ? `The structured answer was not used (${d.refused_answers}); your text was.` : null,
          ),
        );
      } else {
        showNote(v, noteEl("warn", "Sent as a message.", "No prompt was waiting any more; the agent reads it on its next turn."));
      }
      state.prompts.delete(v.pid);
      renderList();
      refresh();
      loadThread(v.threadId);
      return;
    }
    const e = (r.data && r.data.error) || {};
    if (r.status === 409 && e.code === "stale_answer") {
      lock(v);
      const real = e.prompt || { state: e.state };
      if (real.state === "pending") {
        showNote(v, noteEl("warn", "Not the active prompt any more.", "Another prompt is active on this thread. Your draft is kept below, read-only."));
      } else showNote(v, explain(v, real, null));
      state.prompts.delete(v.pid);
      renderList();
      refresh();
      loadThread(v.threadId);
      return;
    }
    if (r.status === 401) return; // the sign-in form is showing
    setBusy(v, false);
    if (r.status === 409 && e.code === "thread_closed") {
      lock(v);
      showNote(v, noteEl("bad", "The thread is closed.", "Nothing was sent."));
    } else if (r.status === 403) {
      showNote(v, noteEl("bad", "Not allowed.", `${errorMessage(r)}. Nothing was sent.`));
    } else if (r.status === 422) {
      showNote(v, noteEl("bad", "The server refused the answer.", errorMessage(r)));
    } else {
      showNote(v, noteEl("bad", "Not sent.", `${errorMessage(r)}. Try again; a retry is not sent twice.`));
    }
  }

  // -- the thread view -----------------------------------------------------------------------

  async function loadThread(threadId) {
    let r;
    try {
      r = await api("GET", `/v1/threads/${enc(threadId)}`);
    } catch {
      return;
    }
    if (!r.ok || !state.view || state.view.threadId !== threadId) return;
    const list = $("thread-items");
    const asked = new Map(); // prompt id -> its questions, so an answer card can name the headers
    for (const it of r.data.items) {
      const p = (it.metadata || {}).prompt;
      if ((it.metadata || {}).type === "pending_prompt" && p) asked.set(p.prompt_id, p.questions);
    }
    list.replaceChildren(...r.data.items.map((it) => itemCard(it, asked)));
    $("thread-title").textContent = `Thread ${threadId}${r.data.truncated ? " (the last 1,000 items)" : ""}`;
    $("thread").hidden = false;
  }

  function itemCard(item, asked) {
    const md = item.metadata || {};
    const type = md.type || "";
    const text = (item.content || [])
      .filter((b) => b && b.type === "text" && b.text)
      .map((b) => b.text)
      .join("\n");
    const via = md.via && md.via.surface ? ` via ${md.via.surface}` : "";
    const meta = (label) =>
      h("div", { class: "meta" }, h("span", {}, label), h("span", {}, `${item.author}${via}`), h("time", { datetime: item.created_at, title: when(item.created_at) }, ageWords(item.created_at)));
    if (type === "pending_prompt") {
      const p = md.prompt || {};
      return h(
        "li",
        { class: "item prompt" },
        meta(`Asked (${KIND[p.kind] || p.kind})`),
        h(
          "div",
          { class: "body" },
          (p.questions || []).map((q) =>
            h("div", {}, inline(q.question), (q.options || []).length ? h("div", { class: "muted" }, q.options.map((o) => o.label).join(" · ")) : null),
          ),
        ),
      );
    }
    if (type === "pending_prompt_resolved") {
      const p = md.prompt || {};
      if (p.prompt_state === "answered")
        return h("li", { class: "item answered" }, meta("Answered"), h("div", { class: "body" }, answersList(p.answers, asked.get(p.prompt_id))));
      return h("li", { class: "item cancelled" }, meta("Cancelled"), h("div", { class: "body" }, p.reason || text));
    }
    const person = md.via || md.prompt_id || md.answers;
    return h(
      "li",
      { class: `item${person ? " person" : ""}` },
      meta(type ? type.replace(/_/g, " ") : md.prompt_id || md.answers ? "Answer" : "Message"),
      Array.isArray(md.answers) ? h("div", { class: "body" }, answersList(md.answers, asked.get(md.prompt_id))) : null,
      text ? h("div", { class: "body" }, text) : null,
    );
  }

  // -- keyboard ------------------------------------------------------------------------------

  function typing(el) {
    if (!el) return false;
    if (el.isContentEditable || el.tagName === "TEXTAREA") return true;
    return el.tagName === "INPUT" && !["radio", "checkbox", "button", "submit"].includes(el.type);
  }

  function currentQuestion(form) {
    const inside = document.activeElement && document.activeElement.closest("fieldset[data-q]");
    if (inside && form.contains(inside)) return inside;
    const all = [...form.querySelectorAll("fieldset[data-q]")];
    return all.find((fs) => !fs.querySelector("input:checked")) || all[0] || null;
  }

  function pick(n) {
    const v = state.view;
    if (!v || v.locked) return;
    if (v.kind === "approval") {
      const b = v.form.querySelectorAll(".actions button")[n - 1];
      if (b) b.focus(); // a number only points at a button; a and d, or Enter, act
      return;
    }
    const fs = currentQuestion(v.form);
    if (!fs) return;
    const inputs = [...fs.querySelectorAll(`input[name="q${fs.dataset.q}"]`)];
    const input = inputs[n - 1];
    if (!input) return;
    if (input.type === "checkbox") input.checked = !input.checked;
    else input.checked = true;
    if (input.value === "other") {
      fs.querySelector(".other-text").focus();
      return;
    }
    if (input.type === "radio") {
      // One pick per single-select question: go on to the next question.
      const nextFs = fs.nextElementSibling && fs.nextElementSibling.matches("fieldset[data-q]") ? fs.nextElementSibling : null;
      const target = nextFs ? nextFs.querySelector("input, textarea") : v.form.querySelector("button[type=submit]");
      (target || input).focus();
    } else input.focus();
  }

  function onKey(e) {
    if ($("app").hidden) return;
    const v = state.view;
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      if (!v || v.locked) return;
      e.preventDefault();
      if (v.kind === "approval") {
        if (document.activeElement && document.activeElement.id === "deny-msg") approvalAnswer(denyLabel(v));
        return;
      }
      v.form.requestSubmit();
      return;
    }
    if (e.ctrlKey || e.metaKey || e.altKey || typing(document.activeElement)) return;
    if (e.key === "j") {
      e.preventDefault();
      move(1);
    } else if (e.key === "k") {
      e.preventDefault();
      move(-1);
    } else if (/^[1-9]$/.test(e.key)) {
      e.preventDefault();
      pick(Number(e.key));
    } else if ((e.key === "a" || e.key === "d") && v && v.kind === "approval" && !v.locked) {
      e.preventDefault();
      const b = v.form.querySelector(`button[data-role="${e.key === "a" ? "approve" : "deny"}"]`);
      if (b && !b.disabled) b.click();
    } else if (e.key === "Escape" && $("app").classList.contains("show-detail")) {
      $("app").classList.remove("show-detail");
      const b = document.querySelector(`.entry[data-pid="${CSS.escape(state.selected || "")}"]`);
      if (b) b.focus();
    }
  }

  function denyLabel(v) {
    const b = v.form.querySelector('button[data-role="deny"]');
    return b ? b.dataset.label : "Deny";
  }

  // -- start ---------------------------------------------------------------------------------

  async function boot() {
    $("signin-form").addEventListener("submit", onSignIn);
    $("sign-out").addEventListener("click", onSignOut);
    $("back").addEventListener("click", () => {
      $("app").classList.remove("show-detail");
      const b = document.querySelector(`.entry[data-pid="${CSS.escape(state.selected || "")}"]`);
      if (b) b.focus();
    });
    document.addEventListener("keydown", onKey);
    document.addEventListener("visibilitychange", () => document.visibilityState === "visible" && refresh());
    window.addEventListener("online", () => state.me && connect());
    setInterval(() => {
      if (state.view && document.visibilityState === "visible") loadThread(state.view.threadId);
    }, THREAD_MS);
    setInterval(() => {
      tickAges();
      for (const t of document.querySelectorAll("time.age-words")) t.textContent = ageWords(t.getAttribute("datetime"));
    }, 10000);
    setInterval(timing.tick, 1000);
    let r = null;
    try {
      r = await api("GET", "/v1/session");
    } catch {
      r = null;
    }
    if (r && r.ok) signedIn(r.data);
    else showSignIn(r ? "" : "The server could not be reached.");
  }

  boot();
})();
