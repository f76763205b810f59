// The miaohui console: chat, models, live metrics. Reads only the server's own API:
//   GET  /v1/console/models, /v1/console/summary, /v2/health/ready
//   POST /v1/dialogue/{pipeline}, /v1/chat/completions (stream), /v2/repository/models/{m}/load|unload
// A server started with --api-keys answers these with 401 unless a key comes with them: the key pasted in the header
// is kept in this tab's sessionStorage (never in the URL, cookies or the log) and sent as Authorization: Bearer.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node[k] = v;
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// ------------------------------------------------------------------------------------------- API key

const KEY_ITEM = "miaohui.apiKey";

function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

// fetch with the tab's key (when one is set) as Authorization: Bearer; a 401 asks for a key
async function authFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("authorization", `Bearer ${key}`);
  const resp = await fetch(path, { ...options, headers });
  if (resp.status === 401) {
    const body = await resp.clone().json().catch(() => null);
    const err = body && body.error;
    askForKey((err && (err.message || err)) || "401 Unauthorized");
  }
  return resp;
}

function askForKey(message) {
  const note = $("#key-needed");
  note.textContent = `${message} — this server asks for an API key: paste yours in the box at the top and press Use key.`;
  note.hidden = false;
  $("#api-key").classList.add("needed");
}

function showKeyState() {
  const set = apiKey() !== "";
  $("#key-state").textContent = set ? "key set (this tab)" : "no key";
  $("#key-state").className = "pill" + (set ? " ok" : "");
  $("#key-forget").disabled = !set;
}

function useKey() {
  const input = $("#api-key");
  const key = input.value.trim();
  input.value = "";
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  input.classList.remove("needed");
  $("#key-needed").hidden = true;
  showKeyState();
  loadChatTargets().catch((err) => addMessage("error", String(err.message || err)));
  show(current);
}

$("#key-use").addEventListener("click", useKey);
$("#api-key").addEventListener("keydown", (e) => {
  if (e.key === "Enter") {
    e.preventDefault();
    useKey();
  }
});
$("#key-forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  showKeyState();
  loadChatTargets().catch((err) => addMessage("error", String(err.message || err)));
});

async function api(path, options) {
  const resp = await authFetch(path, options);
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    body = null;
  }
  if (!resp.ok) {
    throw new Error((body && body.error) || `${resp.status} ${resp.statusText}`);
  }
  return body;
}

function postJSON(path, doc) {
  return api(path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(doc) });
}

// ------------------------------------------------------------------------------------------- pages

const pages = ["chat", "models", "metrics"];
let current = null;

function show(page) {
  if (!pages.includes(page)) page = "chat";
  current = page;
  for (const p of pages) $(`#page-${p}`).hidden = p !== page;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  if (page === "models") refreshModels();
  if (page === "metrics") refreshMetrics();
}

window.addEventListener("hashchange", () => show(location.hash.slice(1)));

async function refreshReady() {
  const pill = $("#server-ready");
  try {
    const resp = await authFetch("/v2/health/ready");
    pill.textContent = resp.ok ? "ready" : "not ready";
    pill.className = "pill " + (resp.ok ? "ok" : "bad");
  } catch (_) {
    pill.textContent = "unreachable";
    pill.className = "pill bad";
  }
}

// ------------------------------------------------------------------------------------------- chat

const chat = {
  sessions: {},   // pipeline name -> session id the API keeps
  histories: {},  // chat model name -> OpenAI messages so far
  busy: false,
};

async function loadChatTargets() {
  const view = await api("/v1/console/models");
  const select = $("#chat-model");
  const previous = select.value;
  select.replaceChildren();
  if (view.pipelines.length) {
    select.append(el("optgroup", { label: "Dialogue pipelines" },
      view.pipelines.map((p) => el("option", { value: "pipeline:" + p.name, title: p.description }, p.name))));
  }
  const llms = view.llms.filter((m) => m.chat);
  if (llms.length) {
    select.append(el("optgroup", { label: "Chat models" },
      llms.map((m) => el("option", { value: "llm:" + m.name }, `${m.name} (v${m.version}, ${m.backend} ${m.precision})`))));
  }
  if (previous && [...select.options].some((o) => o.value === previous)) select.value = previous;
  showSession();
}

function target() {
  const [kind, ...rest] = $("#chat-model").value.split(":");
  return { kind, name: rest.join(":") };
}

function showSession() {
  const t = target();
  const sid = t.kind === "pipeline" ? chat.sessions[t.name] : null;
  $("#chat-session").textContent = sid ? `session ${sid}` : t.kind === "llm" ? "streamed (SSE)" : "new session";
}

function addMessage(who, text) {
  const bubble = el("div", { class: "bubble" }, text);
  const node = el("div", { class: `msg ${who}` }, bubble);
  const log = $("#chat-log");
  log.append(node);
  log.scrollTop = log.scrollHeight;
  return node;
}

function detailRow(label, ...content) {
  return el("div", { class: "row" }, el("span", { class: "label" }, label), ...content);
}

function dialogueDetails(resp) {
  const slots = resp.slots.length
    ? resp.slots.map((s) => el("span", { class: "tag", "data-slot": s.name }, `${s.name}=${s.value}${s.unit && s.unit !== "%" ? " " + s.unit : s.unit || ""}`))
    : ["none"];
  const interventions = resp.interventions.length
    ? el("ul", { class: "interventions" }, resp.interventions.map((r) =>
        el("li", { "data-rule": r.rule, "data-action": r.action },
          el("span", { class: "tag rule" }, r.rule), ` ${r.action}`, r.detail ? ` — ${r.detail}` : "")))
    : "none";
  const t = resp.timings || {};
  const stages = ["normalize", "intent", "reply", "compliance", "total"]
    .map((s) => `${s} ${(t[s + "_ms"] ?? 0).toFixed(2)}`).join(" · ");
  const intent = resp.intent === resp.classified_intent ? resp.intent : `${resp.intent} (classified ${resp.classified_intent})`;
  return el("div", { class: "details" },
    detailRow("intent", el("span", { class: "tag", "data-intent": resp.intent }, intent),
      ` confidence ${resp.confidence.toFixed(3)} · ${resp.strategy}${resp.variant ? " / " + resp.variant : ""}`),
    resp.candidate
      ? detailRow("out of scope", el("span", { class: "oos", "data-candidate": resp.candidate },
        `below the model's confidence threshold: best candidate ${resp.candidate} (${resp.confidence.toFixed(3)}) ` +
        "rejected, the fallback answered"))
      : null,
    detailRow("slots", ...slots),
    detailRow("compliance", interventions),
    detailRow("timings, ms", el("span", { class: "timings" }, stages)),
    detailRow("session", `${resp.session_id} · turn ${resp.turn}${resp.handoff ? " · handoff to a human" : ""}`));
}

async function sendDialogue(name, text) {
  const body = { text, timings: true };
  if (chat.sessions[name]) body.session_id = chat.sessions[name];
  const resp = await postJSON(`/v1/dialogue/${encodeURIComponent(name)}`, body);
  chat.sessions[name] = resp.session_id;
  const node = addMessage("bot", resp.text);
  node.append(dialogueDetails(resp));
  showSession();
}

async function sendChat(name, text) {
  const history = (chat.histories[name] = chat.histories[name] || []);
  history.push({ role: "user", content: text });
  const node = addMessage("bot", "");
  node.classList.add("streaming");
  const bubble = $(".bubble", node);
  const started = performance.now();
  let firstAt = null;
  let reply = "";
  let chunks = 0;
  let finish = null;
  const resp = await authFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: name, messages: history, stream: true, max_tokens: 128 }),
  });
  if (!resp.ok) {
    history.pop();
    node.remove();
    const body = await resp.json().catch(() => null);
    throw new Error((body && body.error && (body.error.message || body.error)) || `${resp.status} ${resp.statusText}`);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message || String(obj.error));
        const choice = obj.choices && obj.choices[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          if (firstAt === null) firstAt = performance.now();
          reply += choice.delta.content;
          chunks += 1;
          bubble.textContent = reply;
          $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  }
  history.push({ role: "assistant", content: reply });
  node.classList.remove("streaming");
  node.dataset.chunks = String(chunks);
  const total = performance.now() - started;
  node.append(el("div", { class: "details" },
    detailRow("streamed", `${chunks} chunks · finish ${finish || "?"}`),
    detailRow("timings, ms", el("span", { class: "timings" },
      `first token ${firstAt === null ? "-" : (firstAt - started).toFixed(0)} · total ${total.toFixed(0)}`))));
}

async function send(event) {
  if (event) event.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || chat.busy) return;
  const t = target();
  if (!t.name) return;
  input.value = "";
  addMessage("user", text);
  chat.busy = true;
  $("#chat-send").disabled = true;
  try {
    if (t.kind === "pipeline") await sendDialogue(t.name, text);
    else await sendChat(t.name, text);
  } catch (err) {
    addMessage("error", String(err.message || err));
  } finally {
    chat.busy = false;
    $("#chat-send").disabled = false;
    input.focus();
  }
}

$("#chat-form").addEventListener("submit", send);
$("#chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
});
$("#chat-model").addEventListener("change", showSession);
$("#chat-new").addEventListener("click", () => {
  const t = target();
  delete chat.sessions[t.name];
  delete chat.histories[t.name];
  $("#chat-log").replaceChildren();
  showSession();
});

// ------------------------------------------------------------------------------------------- models

const fmt = (v) => (v === null || v === undefined ? "" : Number(v).toFixed(2));

async function control(model, action) {
  $("#models-error").hidden = true;
  try {
    await postJSON(`/v2/repository/models/${encodeURIComponent(model)}/${action}`, {});
  } catch (err) {
    $("#models-error").textContent = `${action} ${model}: ${err.message}`;
    $("#models-error").hidden = false;
  }
  await refreshModels();
}

async function refreshModels() {
  let view;
  try {
    view = await api("/v1/console/models");
  } catch (err) {
    $("#models-error").textContent = String(err.message || err);
    $("#models-error").hidden = false;
    return;
  }
  const allowed = view.control.allowed;
  const why = view.control.reason;
  $("#control-note").textContent = allowed ? "load and unload act on this server" : `load/unload refused: ${why}`;
  const rows = view.models.map((m) => {
    const loaded = m.version !== "";
    const button = loaded
      ? el("button", { class: "unload", type: "button", disabled: !allowed, title: allowed ? "" : why,
          onclick: () => control(m.name, "unload") }, "Unload")
      : el("button", { class: "load primary", type: "button", disabled: !allowed, title: allowed ? "" : why,
          onclick: () => control(m.name, "load") }, "Load");
    return el("tr", { "data-model": m.name, "data-version": m.version, "data-state": m.state },
      el("td", {}, m.name), el("td", {}, m.version || "—"),
      el("td", { class: `state-${m.state}`, title: m.reason || "" }, m.state + (m.ready === false ? " (warming up)" : "")),
      el("td", {}, m.task || ""), el("td", {}, m.backend || ""), el("td", {}, m.precision || ""),
      el("td", { class: "num" }, m.max_batch ?? ""), el("td", { class: "num" }, fmt(m.load_s)),
      el("td", { class: "num" }, fmt(m.warmup_s)), el("td", {}, button));
  });
  $("#models-table tbody").replaceChildren(...rows);
  $("#llms-table tbody").replaceChildren(...(view.llms.length ? view.llms.map((m) =>
    el("tr", { "data-model": m.name }, el("td", {}, m.name), el("td", {}, m.version), el("td", {}, m.backend),
      el("td", {}, m.precision), el("td", {}, m.ready ? "yes" : "no"), el("td", {}, m.chat ? "yes" : "no")))
    : [el("tr", {}, el("td", { colSpan: 6, class: "muted" }, "no causal LM served"))]));
  $("#pipelines-table tbody").replaceChildren(...view.pipelines.map((p) =>
    el("tr", {}, el("td", {}, p.name), el("td", {}, p.model), el("td", {}, p.description))));
}

$("#models-refresh").addEventListener("click", refreshModels);

// ------------------------------------------------------------------------------------------- metrics

async function refreshMetrics() {
  const windowS = Number($("#metrics-window").value);
  let summary;
  try {
    summary = await api(`/v1/console/summary?window_s=${windowS}`);
  } catch (err) {
    $("#metrics-note").textContent = String(err.message || err);
    return;
  }
  const pts = summary.points;
  const now = pts.length ? pts[pts.length - 1].t : Date.now() / 1000;
  const series = (key, color, label) => ({ label, color, points: pts.map((p) => [p.t, p[key]]) });
  const opts = { windowS, now };
  drawPlot($("#plot-rps"), [series("rps", "#c2410c", "req/s")], opts);
  drawPlot($("#plot-latency"), [series("p50_ms", "#2563eb", "p50"), series("p99_ms", "#c2410c", "p99")], { ...opts, log: true });
  drawPlot($("#plot-queue"), [series("queue_depth", "#7c3aed", "queue")], opts);
  drawPlot($("#plot-batch"), [series("batch_size", "#15803d", "batch")], opts);
  drawPlot($("#plot-prefix"), [series("prefix_hit_rate", "#0e7490", "hit rate")], opts);
  const last = pts[pts.length - 1];
  $("#metrics-note").textContent = last
    ? `${summary.requests_total} requests since start · sampled every ${summary.interval_s} s · last: ` +
      `${last.rps.toFixed(1)} req/s, p99 ${last.p99_ms === null ? "-" : last.p99_ms.toFixed(1) + " ms"}` +
      prefixNote(summary.prefix_cache)
    : "waiting for the first samples";
}

function prefixNote(cache) {
  if (!cache || cache.hit_rate === null) return "";
  return ` · prefix cache: ${(100 * cache.hit_rate).toFixed(1)} % of ${cache.queried_tokens} prompt tokens reused`;
}

$("#metrics-window").addEventListener("change", refreshMetrics);
window.addEventListener("resize", () => { if (current === "metrics") refreshMetrics(); });

// ------------------------------------------------------------------------------------------- start

setInterval(() => { if (current === "metrics") refreshMetrics(); }, 2000);
setInterval(refreshReady, 5000);
showKeyState();
refreshReady();
loadChatTargets().catch((err) => addMessage("error", String(err.message || err)));
show(location.hash.slice(1));
