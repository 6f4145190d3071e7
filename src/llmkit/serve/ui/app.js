// llmkit serve's web page: a chat over /v1/chat/completions and a view of the engine over /metrics.json.
// Plain JavaScript, no library and no build step (see serve/webpage.py). Text from the model is only ever
// inserted as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);

// ---- the key: asked for once when the server answers 401, kept in this tab's session storage only

const KEY = "llmkit.key";
let asking = null; // the open dialog's promise, shared by every call that met a 401

function askForKey(why) {
  if (asking) return asking;
  asking = new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-why").textContent = why;
    $("key-input").value = "";
    const done = (key) => {
      dialog.close();
      asking = null;
      resolve(key);
    };
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, $("key-input").value);
      done(true);
    };
    $("key-cancel").onclick = () => done(false);
    dialog.oncancel = () => done(false);
    dialog.showModal();
    $("key-input").focus();
  });
  return asking;
}

// fetch with the key; on a 401, ask for a key and try again (until the user cancels)
async function call(path, options = {}) {
  for (;;) {
    const headers = Object.assign({}, options.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401) return response;
    const message = await errorText(response);
    if (!(await askForKey(message))) return response;
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

// ---- tabs (arrow keys move between them, as the ARIA tabs pattern has it)

const views = { chat: { tab: $("tab-chat"), panel: $("view-chat") }, engine: { tab: $("tab-engine"), panel: $("view-engine") } };

function show(name) {
  for (const [key, v] of Object.entries(views)) {
    const on = key === name;
    v.tab.setAttribute("aria-selected", String(on));
    v.tab.tabIndex = on ? 0 : -1;
    v.panel.hidden = !on;
  }
  if (name === "engine") engine.start();
  else engine.stop();
}

for (const [name, v] of Object.entries(views)) {
  v.tab.addEventListener("click", () => show(name));
  v.tab.addEventListener("keydown", (event) => {
    if (event.key !== "ArrowRight" && event.key !== "ArrowLeft") return;
    const next = name === "chat" ? "engine" : "chat";
    show(next);
    views[next].tab.focus();
  });
}

// ---- chat

const chat = {
  messages: [], // {role, content, tokens?: [{token, logprob, top: [{token, logprob}]}], reasoning?, toolCalls?}
  controller: null,
};

function setting(id) {
  return $(id).value.trim();
}

function requestBody() {
  const body = {
    model: $("model").value || undefined,
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(setting("temperature")),
    top_p: Number(setting("top-p")),
    max_tokens: Number(setting("max-tokens")),
    logprobs: true,
    top_logprobs: Number(setting("top-k")),
  };
  const system = $("system").value;
  if (system.trim()) body.messages.push({ role: "system", content: system });
  for (const m of chat.messages) {
    const turn = { role: m.role, content: m.content };
    if (m.toolCalls && m.toolCalls.length) turn.tool_calls = m.toolCalls;
    body.messages.push(turn);
  }
  const stop = $("stop-words").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  if ($("use-schema").checked) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse($("schema").value) } };
  }
  if ($("use-tools").checked) body.tools = JSON.parse($("tools").value);
  return body;
}

function showError(text) {
  const p = $("chat-error");
  p.textContent = text;
  p.hidden = !text;
}

function busy(on) {
  $("messages").setAttribute("aria-busy", String(on)); // a screen reader reads the answer once it is whole
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !chat.messages.some((m) => m.role === "assistant");
}

async function complete() {
  showError("");
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError("The schema or the tools are not valid JSON: " + e.message);
    return;
  }
  const reply = { role: "assistant", content: "", tokens: [], reasoning: "", toolCalls: [], finish: null };
  chat.messages.push(reply);
  const item = renderMessage(reply);
  chat.controller = new AbortController();
  busy(true);
  try {
    const response = await call("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      for (const choice of event.choices || []) absorb(reply, choice);
      fillMessage(item, reply);
    });
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
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

// server-sent events: `data: {...}` blocks, until `data: [DONE]`
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

function absorb(reply, choice) {
  const delta = choice.delta || {};
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    const known = reply.toolCalls[call.index];
    if (!known) {
      reply.toolCalls[call.index] = {
        id: call.id, type: "function", function: { name: call.function.name || "", arguments: call.function.arguments || "" },
      };
    } else if (call.function && call.function.arguments) {
      known.function.arguments += call.function.arguments;
    }
  }
  const logprobs = choice.logprobs && choice.logprobs.content;
  for (const t of logprobs || []) {
    reply.tokens.push({ token: t.token, logprob: t.logprob, top: t.top_logprobs || [] });
  }
  if (choice.finish_reason) reply.finish = choice.finish_reason;
}

function renderMessage(m) {
  const item = document.createElement("li");
  item.className = "message " + m.role;
  const who = document.createElement("h3");
  who.textContent = m.role === "user" ? "You" : "Model";
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
  }
  $("messages").append(item);
  fillMessage(item, m);
  return item;
}

function fillMessage(item, m) {
  const text = item.querySelector(".text");
  text.replaceChildren();
  if (m.role === "assistant" && $("show-probs").checked && m.tokens && m.tokens.length) {
    // tokens past the answer's text (a stop token, a stop sequence, a tool call) are shown apart: what the model
    // chose there is part of what it believed, but not of the answer
    let offset = 0;
    for (const t of m.tokens) {
      text.append(tokenSpan(t, offset >= m.content.length));
      offset += t.token.length;
    }
  } else {
    text.textContent = m.content;
  }
  const reasoning = item.querySelector(".reasoning");
  reasoning.hidden = !m.reasoning;
  reasoning.querySelector("div").textContent = m.reasoning || "";
  const calls = item.querySelector(".tool-calls");
  calls.hidden = !(m.toolCalls && m.toolCalls.length);
  calls.textContent = (m.toolCalls || []).map((c) => "tool call: " + c.function.name + "(" + c.function.arguments + ")").join("\n");
  const finish = item.querySelector(".finish");
  if (finish) finish.textContent = m.finish ? "finish: " + m.finish + ", " + m.tokens.length + " tokens" : "";
  item.scrollIntoView({ block: "end" });
}

// a token coloured by its probability: red (unlikely) to green (certain)
function tokenSpan(t, beyond) {
  const span = document.createElement("span");
  const p = Math.exp(t.logprob);
  span.className = beyond ? "token beyond" : "token";
  if (beyond) span.title = "not part of the answer's text (a stop token, a stop sequence or a tool call)";
  span.textContent = t.token;
  span.dataset.logprob = String(t.logprob);
  span.style.backgroundColor = "hsl(" + Math.round(120 * p) + " 70% 50% / 0.28)";
  span.tabIndex = 0;
  span.setAttribute("aria-label", t.token + ": " + percent(p));
  const open = () => showTip(span, t);
  span.addEventListener("mouseenter", open);
  span.addEventListener("focus", open);
  span.addEventListener("click", open);
  span.addEventListener("mouseleave", hideTip);
  span.addEventListener("blur", hideTip);
  return span;
}

function showTip(anchor, t) {
  const tip = $("token-tip");
  tip.replaceChildren();
  const title = document.createElement("p");
  title.textContent = JSON.stringify(t.token) + "  " + percent(Math.exp(t.logprob));
  const list = document.createElement("ol");
  for (const alt of t.top) {
    const row = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.max(2, Math.round(80 * Math.exp(alt.logprob))) + "px";
    const label = document.createElement("span");
    label.textContent = JSON.stringify(alt.token) + " " + percent(Math.exp(alt.logprob));
    if (alt.token === t.token) row.className = "chosen";
    row.append(bar, label);
    list.append(row);
  }
  tip.append(title, list);
  tip.hidden = false;
  const box = anchor.getBoundingClientRect();
  const width = tip.offsetWidth;
  tip.style.left = Math.max(4, Math.min(box.left + window.scrollX, window.scrollX + document.documentElement.clientWidth - width - 4)) + "px";
  tip.style.top = box.bottom + window.scrollY + 4 + "px";
}

function hideTip() {
  $("token-tip").hidden = true;
}

function percent(p) {
  return (100 * p).toFixed(p >= 0.995 || p < 0.001 ? 2 : 1) + "%";
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (e) {
    button.textContent = "Copy failed";
  }
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.controller) return;
  const turn = { role: "user", content: text };
  chat.messages.push(turn);
  renderMessage(turn);
  $("prompt").value = "";
  complete();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
});
$("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
$("regenerate").addEventListener("click", () => {
  const last = chat.messages[chat.messages.length - 1];
  if (chat.controller || !last || last.role !== "assistant") return;
  chat.messages.pop();
  $("messages").lastElementChild.remove();
  complete();
});
$("clear").addEventListener("click", () => {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  $("messages").replaceChildren();
  showError("");
  busy(false);
});
$("show-probs").addEventListener("change", () => {
  const items = $("messages").children;
  chat.messages.forEach((m, i) => fillMessage(items[i], m));
});
for (const [box, area] of [["use-schema", "schema"], ["use-tools", "tools"]]) {
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
}

// ---- engine: /metrics.json once a second while the view is shown (and the tab is visible)

const POLL_MS = 1000;
const WINDOW_S = 60; // latency percentiles over the last minute; tokens/s over the last 5 s
const RATE_S = 5;

const engine = {
  timer: null,
  history: [], // {time, samples}
  start() {
    if (this.timer === null) {
      this.poll();
      this.timer = setInterval(() => this.poll(), POLL_MS);
    }
  },
  stop() {
    clearInterval(this.timer);
    this.timer = null;
  },
  async poll() {
    if (document.hidden || this.busy) return;
    this.busy = true;
    try {
      const response = await call("/metrics.json");
      if (!response.ok) {
        $("engine-status").textContent = "/metrics.json: " + (await errorText(response));
        return;
      }
      const snap = await response.json();
      this.history.push({ time: snap.time, samples: snap.samples });
      while (this.history.length > 2 && this.history[1].time <= snap.time - WINDOW_S) this.history.shift();
      drawEngine(snap, this.history);
      $("engine-status").textContent = "Read /metrics.json at " + new Date(snap.time * 1000).toLocaleTimeString() +
        " (once a second while this view is open)";
    } catch (e) {
      $("engine-status").textContent = "/metrics.json: " + e.message;
    } finally {
      this.busy = false;
    }
  },
};

function sum(samples, name) {
  let total = 0;
  for (const [key, value] of Object.entries(samples)) {
    if (key === name || key.startsWith(name + "{")) total += value || 0;
  }
  return total;
}

// a histogram's quantile from its cumulative buckets over a window (Prometheus' histogram_quantile: linear
// within the bucket; the largest finite bound where it falls in +Inf)
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

// over the last minute; where it had none, since the server started
function latencies(name, now, then) {
  const recent = [0.5, 0.9, 0.99].map((q) => quantile(q, now, then, name));
  if (recent[0] !== null) return recent.map(seconds).join(" / ");
  const all = [0.5, 0.9, 0.99].map((q) => quantile(q, now, null, name));
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
  const first = history[0].samples;
  const rateBase = history.find((h) => h.time >= snap.time - RATE_S - 0.5) || history[0];
  const span = snap.time - rateBase.time;
  const generated = sum(s, "llmkit_generated_tokens_total");
  const tps = span > 0 ? (generated - sum(rateBase.samples, "llmkit_generated_tokens_total")) / span : 0;
  $("m-tps").textContent = span > 0 ? tps.toFixed(1) : "-";
  $("m-generated").textContent = String(generated);
  $("m-running").textContent = String(s.llmkit_requests_running);
  $("m-waiting").textContent = String(s.llmkit_requests_waiting);
  $("m-ttft").textContent = latencies("llmkit_time_to_first_token_seconds", s, history.length > 1 ? first : null);
  $("m-itl").textContent = latencies("llmkit_inter_token_latency_seconds", s, history.length > 1 ? first : null);
  const used = s.llmkit_kv_blocks_used, cached = s.llmkit_kv_blocks_cached, total = s.llmkit_kv_blocks_total;
  $("m-blocks").textContent = used + " / " + cached + " / " + (total - used - cached) + " of " + total;
  const queried = s.llmkit_prefix_cache_queried_blocks_total, hit = s.llmkit_prefix_cache_hit_blocks_total;
  $("m-hit").textContent = queried ? ((100 * hit) / queried).toFixed(1) + "% of " + queried + " blocks" : "no prompts yet";
  const drafted = s.llmkit_spec_draft_tokens_total, accepted = s.llmkit_spec_accepted_tokens_total;
  $("m-accept").textContent = drafted ? ((100 * accepted) / drafted).toFixed(1) + "% of " + drafted : "no drafts";
  $("m-requests").textContent = sum(s, "llmkit_requests_finished_total") + " / " + s.llmkit_preemptions_total;
  drawLimits(snap);
}

function drawLimits(snap) {
  const s = snap.samples, steps = snap.steps;
  const bandwidth = s.llmkit_machine_memory_bandwidth_bytes_per_second;
  const peak = s.llmkit_machine_matmul_flops_per_second;
  $("m-machine").textContent = bandwidth
    ? "Measured at start-up: memory read " + human(bandwidth, "B/s") + ", matmul " + human(peak, "FLOP/s") +
      ". A step reads the weights once and each row's cache; its bytes a second over the bandwidth is how near it " +
      "runs to the memory's limit, its FLOPs a second over the peak how near to the arithmetic's."
    : "The machine's limits were not measured (a model split across processes counts no step costs).";
  const spent = steps.reduce((a, st) => a + st.seconds, 0);
  const read = steps.reduce((a, st) => a + st.weight_bytes + st.kv_bytes, 0);
  const flops = steps.reduce((a, st) => a + st.flops, 0);
  $("m-bw").textContent = bandwidth && spent ? ((100 * read) / spent / bandwidth).toFixed(1) + "%" : "-";
  $("m-mm").textContent = peak && spent ? ((100 * flops) / spent / peak).toFixed(1) + "%" : "-";
  const last = steps[steps.length - 1];
  $("m-bytes").textContent = last ? human(last.weight_bytes, "B") + " + " + human(last.kv_bytes, "B") : "-";
  $("m-flops").textContent = last ? human(last.flops, "FLOP") + ", " + seconds(last.seconds) : "-";
  const rows = steps.length ? steps.reduce((a, st) => a + st.decode_rows, 0) / steps.length : 0;
  const prompt = steps.length ? steps.reduce((a, st) => a + st.prompt_tokens, 0) / steps.length : 0;
  $("m-composition").textContent = steps.length
    ? "The last " + steps.length + " steps: " + rows.toFixed(1) + " decoding rows and " + prompt.toFixed(1) +
      " prompt tokens a step on average"
    : "No steps yet.";
  const percent = { least: 100, unit: "%" };
  chart($("chart-sol"), steps, (st) => 100 * (st.bandwidth_ratio || 0), percent, (st) => 100 * (st.matmul_ratio || 0), percent);
  chart($("chart-rows"), steps, (st) => st.decode_rows, { least: 1, unit: "" }, (st) => st.prompt_tokens, { least: 1, unit: "" });
}

// a bar a step (the newest on the right) and a line, each scaled to its own largest value (at least `least`);
// the caption says where the top of each is
function chart(svg, steps, bar, barScale, line, lineScale) {
  const NS = "http://www.w3.org/2000/svg", W = 480, H = 120, n = 120;
  const shown = steps.slice(-n);
  const heights = shown.map(bar), points = shown.map(line);
  const top = (values, scale) => Math.max(scale.least, ...values);
  const barTop = top(heights, barScale), lineTop = top(points, lineScale);
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
    rect.setAttribute("class", "part0");
    svg.append(rect);
  });
  if (shown.length) {
    const path = document.createElementNS(NS, "polyline");
    path.setAttribute("points", points.map((v, i) => W - (shown.length - i - 0.5) * w + "," + (H - (H * v) / lineTop)).join(" "));
    path.setAttribute("class", "line");
    svg.append(path);
  }
  const round = (x) => (Number.isInteger(x) ? x : x.toFixed(1));
  const scale = svg.parentElement.querySelector(".scale");
  scale.textContent = barTop === lineTop && barScale.unit === lineScale.unit
    ? " (the top of the chart: " + round(barTop) + barScale.unit + ")"
    : " (the top of the chart: " + round(barTop) + barScale.unit + " for the bars, " + round(lineTop) + lineScale.unit + " for the line)";
}

// ---- start

if (window.matchMedia("(max-width: 760px)").matches) $("settings").open = false;
document.addEventListener("visibilitychange", () => !document.hidden && !views.engine.panel.hidden && engine.poll());
busy(false);
loadModels();
