// llmkit serve's web page: a chat over /v1/chat/completions and a view of the engine over /metrics.json.
// Plain JavaScript, no library and no build step (see serve/webpage.py). Text from the model is only ever
// inserted as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);

// ---- the key: asked for when the server answers 401, kept in this tab's session storage only

const KEY = "llmkit.key";
const keys = { asking: null, refused: false }; // the open dialog's promise; the user cancelled it

function askForKey(why) {
  if (keys.asking) return keys.asking;
  keys.asking = new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-why").textContent = why;
    $("key-input").value = "";
    const done = (given) => {
      dialog.close();
      keys.asking = null;
      keys.refused = !given;
      $("key-again").hidden = given;
      resolve(given);
    };
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, $("key-input").value);
      done(true);
    };
    $("key-cancel").onclick = () => done(false);
    dialog.oncancel = (event) => {
      event.preventDefault();
      done(false);
    };
    dialog.showModal();
    $("key-input").focus();
  });
  return keys.asking;
}

// fetch with the key; on a 401, ask for a key and try again, until the user cancels (then a 401 is answered as
// it is, without asking, until the user asks to give a key again)
async function call(path, options = {}) {
  for (;;) {
    const headers = Object.assign({}, options.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401 || keys.refused) return response;
    const message = await errorText(response);
    const why = key ? "The key was not accepted: " + message : message;
    if (!(await askForKey(why))) return response;
    if (!$("model").options.length && path !== "/v1/models") loadModels();
  }
}

async function errorText(response) {
  try {
    const body = await response.clone().json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return "HTTP " + response.status;
  }
}

$("key-again").addEventListener("click", async () => {
  keys.refused = false;
  if (await askForKey("Give the server's API key (or its metrics key, for the engine view only).")) {
    loadModels();
    if (!views.engine.panel.hidden) engine.poll();
  }
});

// ---- tabs (the arrow keys move between them, as the ARIA tabs pattern has it)

const views = {
  chat: { tab: $("tab-chat"), panel: $("view-chat") },
  engine: { tab: $("tab-engine"), panel: $("view-engine") },
};

function show(name) {
  for (const [key, v] of Object.entries(views)) {
    const on = key === name;
    v.tab.setAttribute("aria-selected", String(on));
    v.tab.tabIndex = on ? 0 : -1;
    v.panel.hidden = !on;
  }
  hideTip();
  if (name === "engine") engine.start();
  else engine.stop();
}

for (const [name, v] of Object.entries(views)) {
  v.tab.addEventListener("click", () => show(name));
  v.tab.addEventListener("keydown", (event) => {
    if (!["ArrowRight", "ArrowLeft", "Home", "End"].includes(event.key)) return;
    event.preventDefault();
    const next = event.key === "Home" ? "chat" : event.key === "End" ? "engine" : name === "chat" ? "engine" : "chat";
    show(next);
    views[next].tab.focus();
  });
}

// ---- chat

const chat = {
  // {role, content, toolCallId?, toolCalls?, reasoning?, tokens?: [{token, logprob, bytes, top, piece}], finish?}
  messages: [],
  controller: null,
};

// a number field's value, or undefined where it is empty or not a number (the server's default then applies)
function number(id) {
  const text = $(id).value.trim();
  const value = Number(text);
  return text === "" || !Number.isFinite(value) ? undefined : value;
}

function requestBody() {
  const k = number("top-k");
  const body = {
    model: $("model").value || undefined,
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
    logprobs: true,
    top_logprobs: k === undefined ? 5 : k,
  };
  const system = $("system").value;
  if (system.trim()) body.messages.push({ role: "system", content: system });
  for (const m of chat.messages) {
    const turn = { role: m.role, content: m.content };
    if (m.toolCalls && m.toolCalls.length) turn.tool_calls = m.toolCalls;
    if (m.toolCallId) turn.tool_call_id = m.toolCallId;
    body.messages.push(turn);
  }
  const stop = $("stop-words").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  if ($("use-schema").checked) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse($("schema").value) } };
  }
  if ($("use-tools").checked) {
    body.tools = JSON.parse($("tools").value);
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

function showError(text) {
  const p = $("chat-error");
  p.textContent = text;
  p.hidden = !text;
}

function busy(on) {
  $("messages").setAttribute("aria-busy", String(on)); // a screen reader reads the answer once it is whole
  const focused = document.activeElement;
  $("send").disabled = on;
  $("stop").disabled = !on;
  const last = chat.messages[chat.messages.length - 1];
  $("regenerate").disabled = on || !last || (last.role === "assistant" && !chat.messages.some((m) => m.role === "user"));
  // a control disabled under the focus would drop it to the page: move it where the next action is
  if (on && (focused === $("send") || focused === $("regenerate"))) $("stop").focus();
  if (!on && focused === $("stop")) $("prompt").focus();
  updateComposer();
}

// the tool calls of the last answer that have no result yet: the message box gives their results, one by one
function pendingCalls() {
  const results = new Set();
  for (let i = chat.messages.length - 1; i >= 0; i--) {
    const m = chat.messages[i];
    if (m.role === "tool") results.add(m.toolCallId);
    else if (m.role === "assistant") return (m.toolCalls || []).filter((c) => !results.has(c.id));
    else return [];
  }
  return [];
}

function updateComposer() {
  const pending = pendingCalls();
  $("prompt-label").textContent = pending.length
    ? "Result of " + pending[0].function.name + "(" + pending[0].function.arguments + ")"
    : "Message";
}

async function complete() {
  showError("");
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError("The schema or the tools are not valid JSON: " + e.message);
    busy(false);
    return;
  }
  const reply = { role: "assistant", content: "", tokens: [], reasoning: "", toolCalls: [], finish: null };
  reply.decoder = new TextDecoder();
  chat.messages.push(reply);
  const item = renderMessage(reply);
  const controller = (chat.controller = new AbortController());
  busy(true);
  let events = 0;
  try {
    const response = await call("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const done = await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      for (const choice of event.choices || []) absorb(reply, choice);
      item.dataset.events = String(++events);
      fillMessage(item, reply);
    });
    if (!done) throw new Error("the stream ended before its last event");
  } catch (e) {
    if (e.name !== "AbortError") {
      showError(e.message);
      reply.finish = "error";
    }
    controller.abort(); // whatever went wrong here, the server stops the request
  } finally {
    if (!reply.content && !reply.toolCalls.length && !reply.reasoning) {
      chat.messages.pop();
      item.remove();
    } else {
      reply.finish = reply.finish || "stopped";
      fillMessage(item, reply);
    }
    chat.controller = null;
    busy(false);
  }
}

// server-sent events (the parts of the format a server uses: `data:` lines, blank lines between events, LF or
// CRLF); true when the stream ended with `data: [DONE]`
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop(); // an unfinished line waits for the rest
      for (const line of lines) {
        if (line === "") {
          if (data.length) {
            const text = data.join("\n");
            data = [];
            if (text === "[DONE]") return true;
            onEvent(JSON.parse(text));
          }
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function absorb(reply, choice) {
  const delta = choice.delta || {};
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const c of delta.tool_calls || []) {
    const known = reply.toolCalls[c.index];
    const fn = c.function || {};
    if (!known) {
      reply.toolCalls[c.index] = { id: c.id, type: "function", function: { name: fn.name || "", arguments: fn.arguments || "" } };
    } else if (fn.arguments) {
      known.function.arguments += fn.arguments;
    }
  }
  const logprobs = choice.logprobs && choice.logprobs.content;
  for (const t of logprobs || []) {
    // a token's text from its bytes, decoded in stream: a character split over two tokens comes whole with the
    // second ("" for the first), where the tokens' names would show U+FFFD twice
    const piece = t.bytes ? reply.decoder.decode(new Uint8Array(t.bytes), { stream: true }) : t.token;
    reply.tokens.push({ token: t.token, logprob: t.logprob, bytes: t.bytes, top: t.top_logprobs || [], piece });
  }
  if (choice.finish_reason) reply.finish = choice.finish_reason;
}

function renderMessage(m) {
  const item = document.createElement("li");
  item.className = "message " + m.role;
  const who = document.createElement("h3");
  who.textContent = m.role === "user" ? "You" : m.role === "tool" ? "Tool result" : "Model";
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thought = document.createElement("div");
  reasoning.append(summary, thought);
  const text = document.createElement("div");
  text.className = "text";
  const calls = document.createElement("pre");
  calls.className = "tool-calls";
  calls.hidden = true;
  const foot = document.createElement("div");
  foot.className = "foot";
  item.append(who, reasoning, text, calls, foot);
  if (m.role === "assistant") {
    const note = document.createElement("span");
    note.className = "muted finish";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy this answer");
    copy.addEventListener("click", () => copyText(m.content, copy));
    foot.append(note, copy);
    text.addEventListener("keydown", moveAmongTokens);
  }
  $("messages").append(item);
  fillMessage(item, m);
  return item;
}

// Where the answer's text lies in its tokens' text: after the reasoning (a thinking model's tokens hold its
// thoughts first), up to the end of the content; the rest (a stop token, a stop sequence, a tool call) is shown
// apart. null where the tokens' text does not hold the content (then the plain text is shown).
function answerSpan(m) {
  const all = m.tokens.map((t) => t.piece).join("");
  let from = 0;
  if (m.reasoning) {
    const at = all.indexOf(m.reasoning);
    from = at < 0 ? 0 : at + m.reasoning.length;
  }
  if (!m.content) return [all.length, all.length];
  const start = all.indexOf(m.content, from);
  return start < 0 ? null : [start, start + m.content.length];
}

function fillMessage(item, m) {
  const atBottom = window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 48;
  const text = item.querySelector(".text");
  const span = m.role === "assistant" && $("show-probs").checked && m.tokens && m.tokens.length ? answerSpan(m) : null;
  if (span === null) {
    text.textContent = m.content;
  } else {
    if (text.querySelectorAll(".token").length > m.tokens.length || text.firstChild?.nodeType === Node.TEXT_NODE) {
      text.replaceChildren();
    }
    const shown = text.children.length;
    for (let i = shown; i < m.tokens.length; i++) text.append(tokenSpan(m.tokens[i], i === 0));
    let offset = 0;
    [...text.children].forEach((el, i) => {
      const inside = offset >= span[0] && offset < span[1] && offset + m.tokens[i].piece.length <= span[1];
      el.classList.toggle("beyond", !inside && offset >= span[1]);
      el.classList.toggle("before", !inside && offset < span[0]);
      el.title = inside ? "" : "not part of the answer's text (a thought, a stop token, a stop sequence or a tool call)";
      offset += m.tokens[i].piece.length;
    });
  }
  const reasoning = item.querySelector(".reasoning");
  reasoning.hidden = !m.reasoning;
  reasoning.querySelector("div").textContent = m.reasoning || "";
  const calls = item.querySelector(".tool-calls");
  calls.hidden = !(m.toolCalls && m.toolCalls.length);
  calls.textContent = (m.toolCalls || []).map((c) => "tool call: " + c.function.name + "(" + c.function.arguments + ")").join("\n");
  const finish = item.querySelector(".finish");
  if (finish) finish.textContent = m.finish ? "finish: " + m.finish + ", " + m.tokens.length + " tokens" : "";
  if (atBottom) item.scrollIntoView({ block: "end" });
}

// a token coloured by its probability, red (unlikely) to green (certain); one tab stop per answer (its first
// token), the arrow keys move among its tokens, and the focused one shows its alternatives
function tokenSpan(t, first) {
  const span = document.createElement("span");
  const p = Math.exp(t.logprob);
  span.className = "token";
  span.textContent = t.piece;
  span.dataset.logprob = String(t.logprob);
  span.style.backgroundColor = "hsl(" + Math.round(120 * p) + " 70% 50% / 0.28)";
  span.tabIndex = first ? 0 : -1;
  const open = () => showTip(span, t);
  span.addEventListener("mouseenter", open);
  span.addEventListener("focus", open);
  span.addEventListener("click", open);
  span.addEventListener("mouseleave", () => document.activeElement !== span && hideTip());
  span.addEventListener("blur", hideTip);
  return span;
}

function moveAmongTokens(event) {
  const tokens = [...event.currentTarget.querySelectorAll(".token")];
  const at = tokens.indexOf(document.activeElement);
  if (at < 0) return;
  const to = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tokens.length - 1 }[event.key];
  if (to === undefined || to < 0 || to >= tokens.length) return;
  event.preventDefault();
  tokens[at].tabIndex = -1;
  tokens[to].tabIndex = 0;
  tokens[to].focus();
}

// a token's name for the list of alternatives: its text, or its bytes where they are part of a character
function tokenName(t) {
  if (t.token.includes("\ufffd") && t.bytes) return "bytes " + t.bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ");
  return JSON.stringify(t.token);
}

function showTip(anchor, t) {
  const tip = $("token-tip");
  tip.replaceChildren();
  const title = document.createElement("p");
  title.textContent = tokenName(t) + "  " + percent(Math.exp(t.logprob));
  const list = document.createElement("ol");
  for (const alt of t.top) {
    const row = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.max(2, Math.round(80 * Math.exp(alt.logprob))) + "px";
    const label = document.createElement("span");
    label.textContent = tokenName(alt) + " " + percent(Math.exp(alt.logprob));
    if (alt.token === t.token) row.className = "chosen";
    row.append(bar, label);
    list.append(row);
  }
  tip.append(title, list);
  tip.hidden = false;
  for (const other of document.querySelectorAll("[aria-describedby='token-tip']")) other.removeAttribute("aria-describedby");
  anchor.setAttribute("aria-describedby", "token-tip");
  const box = anchor.getBoundingClientRect();
  const width = tip.offsetWidth, height = tip.offsetHeight;
  const left = Math.min(box.left, document.documentElement.clientWidth - width - 4);
  const below = box.bottom + 4 + height <= window.innerHeight || box.top - 4 - height < 0;
  tip.style.left = Math.max(4, left) + window.scrollX + "px";
  tip.style.top = (below ? box.bottom + 4 : box.top - 4 - height) + window.scrollY + "px";
}

function hideTip() {
  $("token-tip").hidden = true;
}

function percent(p) {
  return (100 * p).toFixed(p >= 0.995 || p < 0.001 ? 2 : 1) + "%";
}

async function copyText(text, button) {
  let copied = false;
  try {
    await navigator.clipboard.writeText(text);
    copied = true;
  } catch (e) {
    // (the clipboard API needs a secure context: a page reached over plain HTTP from another machine has none)
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.append(area);
    area.select();
    copied = document.execCommand("copy");
    area.remove();
  }
  button.textContent = copied ? "Copied" : "Copy failed";
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.controller) return;
  const pending = pendingCalls();
  const turn = pending.length ? { role: "tool", content: text, toolCallId: pending[0].id } : { role: "user", content: text };
  chat.messages.push(turn);
  renderMessage(turn);
  $("prompt").value = "";
  if (pendingCalls().length) return busy(false); // more results to give before the model answers
  complete();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
});
$("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
$("regenerate").addEventListener("click", () => {
  // the last answer again (or an answer to the last message, where the last attempt failed)
  if (chat.controller || !chat.messages.length) return;
  if (chat.messages[chat.messages.length - 1].role === "assistant") {
    chat.messages.pop();
    $("messages").lastElementChild.remove();
  }
  complete();
});
$("clear").addEventListener("click", () => {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  $("messages").replaceChildren();
  hideTip();
  showError("");
  busy(false);
});
$("show-probs").addEventListener("change", () => {
  const items = $("messages").children;
  chat.messages.forEach((m, i) => fillMessage(items[i], m));
});
for (const [box, area] of [["use-schema", "schema"], ["use-tools", "tool-settings"]]) {
  $(box).addEventListener("change", () => ($(area).hidden = !$(box).checked));
}
document.addEventListener("keydown", (event) => event.key === "Escape" && hideTip());

async function loadModels() {
  const response = await call("/v1/models");
  if (!response.ok) return showError(await errorText(response));
  const models = (await response.json()).data;
  const select = $("model");
  select.replaceChildren();
  for (const m of models) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.parent ? m.id + " (adapter)" : m.id;
    select.append(option);
  }
  $("model-name").textContent = models.length ? models[0].id : "";
  showError("");
}

// ---- engine: /metrics.json once a second while the view is shown (and the browser tab is visible)

const POLL_MS = 1000;
const WINDOW_S = 60; // latency percentiles and the charts: the last minute
const RATE_S = 5; // tokens/s and the fractions of the limits: the last 5 s
const SHORTEST_S = 2; // ... once the readings span this much (over less, one step more or less is a large share)

const engine = {
  timer: null,
  busy: false,
  history: [], // {time, samples}, the last minute's readings
  start() {
    if (this.timer === null) {
      this.poll();
      this.timer = setInterval(() => this.poll(), POLL_MS);
    }
  },
  stop() {
    clearInterval(this.timer);
    this.timer = null;
    this.history = []; // a window must not span the time the view was closed
  },
  async poll() {
    if (document.hidden || this.busy) return;
    this.busy = true;
    const panel = views.engine.panel;
    panel.dataset.polls = String(Number(panel.dataset.polls || 0) + 1); // (how many readings were asked for)
    try {
      const response = await call("/metrics.json");
      if (!response.ok) return engineError("/metrics.json: " + (await errorText(response)));
      const snap = await response.json();
      const last = this.history[this.history.length - 1];
      const generated = sum(snap.samples, "llmkit_generated_tokens_total");
      // a gap (the browser tab was hidden) or counters gone back (the server restarted): start the window again
      if (last && (snap.time - last.time > 3 * (POLL_MS / 1000) || generated < sum(last.samples, "llmkit_generated_tokens_total"))) {
        this.history = [];
      }
      this.history.push({ time: snap.time, samples: snap.samples });
      while (this.history.length > 2 && this.history[1].time <= snap.time - WINDOW_S) this.history.shift();
      drawEngine(snap, this.history);
      engineError("");
      $("engine-status").textContent = "Read /metrics.json at " + new Date(snap.time * 1000).toLocaleTimeString() +
        " (once a second while this view is open)";
    } catch (e) {
      engineError("/metrics.json: " + e.message);
    } finally {
      this.busy = false;
    }
  },
};

function engineError(text) {
  $("engine-error").textContent = text;
  $("engine-error").hidden = !text;
}

document.addEventListener("visibilitychange", () => !document.hidden && !views.engine.panel.hidden && engine.poll());

function sum(samples, name) {
  let total = 0;
  for (const [key, value] of Object.entries(samples)) {
    if (key === name || key.startsWith(name + "{")) total += value || 0;
  }
  return total;
}

// A histogram's quantile from its cumulative buckets over a window, as Prometheus' histogram_quantile reads
// them: linear within the bucket it falls in; the largest finite bound where it falls in +Inf.
function quantile(q, now, then, name) {
  const buckets = [];
  for (const [key, value] of Object.entries(now)) {
    const m = key.match(new RegExp("^" + name + '_bucket\\{le="([^"]+)"\\}$'));
    if (m) buckets.push([m[1] === "+Inf" ? Infinity : Number(m[1]), value - ((then && then[key]) || 0)]);
  }
  buckets.sort((a, b) => a[0] - b[0]);
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0, below = 0;
  for (const [bound, count] of buckets) {
    if (count >= rank) {
      if (bound === Infinity) return lower;
      return lower + ((bound - lower) * (rank - below)) / Math.max(count - below, 1e-12);
    }
    lower = bound;
    below = count;
  }
  return lower;
}

// over the window where it saw any; else since the server started, and said so
function latencies(name, now, then) {
  const qs = [0.5, 0.9, 0.99];
  const recent = then ? qs.map((q) => quantile(q, now, then, name)) : [null];
  if (recent[0] !== null) return recent.map(seconds).join(" / ");
  const all = qs.map((q) => quantile(q, now, null, name));
  return all[0] === null ? "none yet" : all.map(seconds).join(" / ") + " (since start)";
}

function seconds(s) {
  return s < 1 ? (1000 * s).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s";
}

function human(x, unit) {
  const steps = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [size, prefix] of steps) if (Math.abs(x) >= size) return (x / size).toFixed(1) + " " + prefix + unit;
  return x.toFixed(0) + " " + unit;
}

function drawEngine(snap, history) {
  const s = snap.samples;
  const then = history.length > 1 ? history[0].samples : null;
  const base = history.find((h) => h.time >= snap.time - RATE_S - 0.5) || history[0];
  const span = snap.time - base.time >= SHORTEST_S ? snap.time - base.time : 0; // 0: not yet measurable
  const delta = (name) => sum(s, name) - sum(base.samples, name);
  $("m-tps").textContent = span > 0 ? (delta("llmkit_generated_tokens_total") / span).toFixed(1) : "-";
  $("m-generated").textContent = String(sum(s, "llmkit_generated_tokens_total"));
  $("m-running").textContent = String(s.llmkit_requests_running);
  $("m-waiting").textContent = String(s.llmkit_requests_waiting);
  $("m-ttft").textContent = latencies("llmkit_time_to_first_token_seconds", s, then);
  $("m-itl").textContent = latencies("llmkit_inter_token_latency_seconds", s, then);
  const used = s.llmkit_kv_blocks_used, cached = s.llmkit_kv_blocks_cached, total = s.llmkit_kv_blocks_total;
  $("m-blocks").textContent = used + " / " + cached + " / " + (total - used - cached) + " of " + total;
  const queried = s.llmkit_prefix_cache_queried_blocks_total, hit = s.llmkit_prefix_cache_hit_blocks_total;
  $("m-hit").textContent = queried ? ((100 * hit) / queried).toFixed(1) + "% of " + queried + " blocks" : "no prompts yet";
  const drafted = s.llmkit_spec_draft_tokens_total, accepted = s.llmkit_spec_accepted_tokens_total;
  $("m-accept").textContent = drafted ? ((100 * accepted) / drafted).toFixed(1) + "% of " + drafted : "no drafts";
  $("m-requests").textContent = sum(s, "llmkit_requests_finished_total") + " / " + s.llmkit_preemptions_total;
  drawLimits(snap, span, delta);
}

// the speed of light over the last RATE_S seconds, from /metrics' counters: the steps' bytes read and FLOPs over
// the seconds they took, over the limits measured at start-up
function drawLimits(snap, span, delta) {
  const s = snap.samples;
  const bandwidth = s.llmkit_machine_memory_bandwidth_bytes_per_second;
  const peak = s.llmkit_machine_matmul_flops_per_second;
  $("m-machine").textContent = bandwidth
    ? "Measured at start-up: memory read " + human(bandwidth, "B/s") + ", matmul " + human(peak, "FLOP/s") +
      ". A step reads the weights once and each row's cache; its bytes a second over the bandwidth is how near it " +
      "runs to the memory's limit, its FLOPs a second over the peak how near to the arithmetic's."
    : "The machine's limits were not measured (a model split across processes counts no step costs).";
  const busy = delta("llmkit_step_time_seconds_total");
  const read = delta("llmkit_weight_read_bytes_total") + delta("llmkit_kv_cache_read_bytes_total");
  // "-" until the readings span SHORTEST_S; "idle" when no step ran in the window; "-" without measured limits
  const share = (amount, limit) => (!(span > 0) || !limit ? "-" : busy > 0 ? ((100 * amount) / busy / limit).toFixed(1) + "%" : "idle");
  // (a step that began before the window counts whole: the share can pass 100% by a step's length over the window)
  $("m-busy").textContent = span > 0 ? Math.min(100, (100 * busy) / span).toFixed(0) + "%" : "-";
  $("m-bw").textContent = share(read, bandwidth);
  $("m-mm").textContent = share(delta("llmkit_flops_total"), peak);
  const stepped = s.llmkit_steps_total > 0;
  $("m-bytes").textContent = stepped
    ? human(s.llmkit_step_weight_read_bytes, "B") + " + " + human(s.llmkit_step_kv_cache_read_bytes, "B")
    : "-";
  $("m-flops").textContent = stepped ? human(s.llmkit_step_flops, "FLOP") + ", " + seconds(s.llmkit_step_seconds) : "-";
  const steps = snap.steps.filter((st) => st.time >= snap.time - WINDOW_S);
  const rows = steps.length ? steps.reduce((a, st) => a + st.decode_rows, 0) / steps.length : 0;
  const prompt = steps.length ? steps.reduce((a, st) => a + st.prompt_tokens, 0) / steps.length : 0;
  $("m-composition").textContent = steps.length
    ? "The last minute's last " + steps.length + " steps: " + rows.toFixed(1) + " decoding rows and " +
      prompt.toFixed(1) + " prompt tokens a step on average"
    : "No steps in the last minute.";
  const percents = { least: 100, unit: "%" }, counts = { least: 1, unit: "" };
  chart($("chart-sol"), steps, (st) => 100 * (st.bandwidth_ratio || 0), percents, (st) => 100 * (st.matmul_ratio || 0), percents);
  chart($("chart-rows"), steps, (st) => st.decode_rows, counts, (st) => st.prompt_tokens, counts);
}

// a bar a step (the newest on the right) and a line, each scaled to its own largest value (at least `least`);
// the caption says where the top of each is
function chart(svg, steps, bar, barScale, line, lineScale) {
  const NS = "http://www.w3.org/2000/svg", W = 480, H = 120, n = 120;
  const shown = steps.slice(-n);
  const heights = shown.map(bar), points = shown.map(line);
  const barTop = Math.max(barScale.least, ...heights), lineTop = Math.max(lineScale.least, ...points);
  svg.replaceChildren();
  const w = W / n;
  shown.forEach((st, i) => {
    const h = (H * heights[i]) / barTop;
    if (h <= 0) return;
    const rect = document.createElementNS(NS, "rect");
    rect.setAttribute("x", String(W - (shown.length - i) * w));
    rect.setAttribute("width", String(Math.max(w - 0.5, 0.5)));
    rect.setAttribute("y", String(H - h));
    rect.setAttribute("height", String(h));
    rect.setAttribute("class", "bar");
    svg.append(rect);
  });
  if (shown.length) {
    const path = document.createElementNS(NS, "polyline");
    path.setAttribute("points", points.map((v, i) => W - (shown.length - i - 0.5) * w + "," + (H - (H * v) / lineTop)).join(" "));
    path.setAttribute("class", "line");
    svg.append(path);
  }
  const round = (x) => (Number.isInteger(x) ? x : x.toFixed(1));
  svg.parentElement.querySelector(".scale").textContent = barTop === lineTop && barScale.unit === lineScale.unit
    ? " (the top of the chart: " + round(barTop) + barScale.unit + ")"
    : " (the top of the chart: " + round(barTop) + barScale.unit + " for the bars, " + round(lineTop) + lineScale.unit + " for the line)";
}

// ---- start

if (window.matchMedia("(max-width: 760px)").matches) $("settings").open = false;
busy(false);
loadModels();
