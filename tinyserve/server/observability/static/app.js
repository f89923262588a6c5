// tinyserve's page: a chat playground over /v1/chat/completions (SSE) and a live view of /engine/stats.
// Plain browser JavaScript, no build step, nothing loaded from the network.
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(100, Number(params.get("poll_ms")) || 1000);
const conversation = [];  // the conversation: {role, content}
let controller = null;  // the AbortController of the reply being streamed

// settings, kept in localStorage so a reload keeps them

const SETTINGS = ["api-key", "temperature", "top-p", "max-tokens", "system"];
for (const id of SETTINGS) {
  const saved = localStorage.getItem("tinyserve:" + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("tinyserve:" + id, $(id).value));
}
$("api-key").addEventListener("change", loadModels);

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

async function loadModels() {
  const select = $("model");
  const previous = select.value || localStorage.getItem("tinyserve:model");
  let models = [];
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    models = (await response.json()).data.map((m) => m.id);
  } catch (e) {
    select.replaceChildren(new Option(`(${e.message})`, ""));
    return;
  }
  select.replaceChildren(...models.map((id) => new Option(id, id)));
  if (models.includes(previous)) select.value = previous;
}
$("model").addEventListener("change", () => localStorage.setItem("tinyserve:model", $("model").value));

// chat

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    div.append(meta);
  }
  meta.textContent = text;
}

function numberOr(id, fallback) {
  const v = Number($(id).value);
  return $(id).value === "" || Number.isNaN(v) ? fallback : v;
}

// Reads an SSE body; calls onEvent(parsed JSON) for each `data:` event until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  const body = {
    model: $("model").value || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(conversation),
    stream: true, stream_options: { include_usage: true },
    // left empty, a sampling field is left out and the model's default applies (GET /v1/models shows it)
    temperature: numberOr("temperature", undefined), top_p: numberOr("top-p", undefined),
    max_tokens: Math.round(numberOr("max-tokens", 256)),
  };
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let first = null, last = null, chunks = 0, usage = null, finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    setMeta(div, "waiting for the first token…");
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          last = performance.now();
          if (first === null) first = last;
          chunks += 1;
          out.textContent += delta;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (first !== null) setMeta(div, replyStats(start, first, last, usage, chunks, finish));
    });
    conversation.push({ role: "assistant", content: out.textContent });
    div.classList.add("done");
    setMeta(div, replyStats(start, first, last ?? performance.now(), usage, chunks, finish));
  } catch (e) {
    conversation.pop();  // not answered: leave it out of the next request
    div.classList.add("error", "done");
    setMeta(div, e.name === "AbortError" ? "stopped" : "error: " + e.message);
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// TTFT from sending to the first text; tok/s over the tokens after the first (the decode rate).
function replyStats(start, first, last, usage, chunks, finish) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const parts = [`TTFT ${(first - start).toFixed(0)} ms`];
  if (tokens > 1 && last > first) parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tok/s`);
  parts.push(`${tokens} tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || controller) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { conversation.length = 0; $("messages").replaceChildren(); });

// the engine view

const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms");

function showModel(m) {
  $("engine-model").textContent = `${m.name} (${m.state})`;
  if (m.num_running === undefined) return;
  $("stat-running").textContent = m.num_running;
  $("stat-waiting").textContent = m.num_waiting + (m.num_paused ? ` (+${m.num_paused} paused)` : "");
  $("stat-preemptions").textContent = m.num_preemptions;
  $("stat-tps").textContent = m.window.tokens_per_s.toFixed(1);
  $("stat-prefix").textContent = m.prefix_cache_hit_rate === null ? "–"
    : (100 * m.prefix_cache_hit_rate).toFixed(1) + " %";
  $("stat-finished").textContent = m.window.num_finished;
  $("stat-kv").textContent = `${m.num_used_blocks} of ${m.num_blocks} used`;
  $("kv-bar").style.width = (100 * m.num_used_blocks / Math.max(1, m.num_blocks)).toFixed(1) + "%";
  for (const name of ["ttft", "tpot"]) {
    for (const p of ["p50", "p95", "p99"]) $(`${name}-${p}`).textContent = ms(m.window[name + "_s"][p]);
  }
  drawTimeline(m.steps);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

// One column per step, newest on the right: prefill tokens stacked on decode tokens, batch size as a line.
function drawTimeline(steps) {
  const box = $("timeline");
  const W = 600, H = 160, n = 120, w = W / n;
  const maxTokens = Math.max(1, ...steps.map((s) => s.num_prefill_tokens + s.num_decode_tokens));
  const maxSeqs = Math.max(1, ...steps.map((s) => s.num_seqs));
  const nodes = [];
  const points = [];
  steps.forEach((s, i) => {
    const x = W - (steps.length - i) * w;
    const hd = (H - 4) * s.num_decode_tokens / maxTokens, hp = (H - 4) * s.num_prefill_tokens / maxTokens;
    nodes.push(svg("rect", { x, y: H - hd, width: Math.max(1, w - 1), height: hd, fill: "var(--decode)" }));
    nodes.push(svg("rect", { x, y: H - hd - hp, width: Math.max(1, w - 1), height: hp, fill: "var(--prefill)" }));
    points.push(`${x + w / 2},${H - 2 - (H - 8) * s.num_seqs / maxSeqs}`);
  });
  if (points.length) {
    nodes.push(svg("polyline", { points: points.join(" "), fill: "none", stroke: "var(--seqs)", "stroke-width": 2 }));
  }
  box.replaceChildren(...nodes);
  const newest = steps[steps.length - 1];
  $("timeline-caption").textContent = steps.length
    ? `${steps.length} steps; tallest ${maxTokens} tokens, largest batch ${maxSeqs}; newest ${newest.age_s.toFixed(1)} s ago, ${newest.duration_ms} ms`
    : "no steps yet";
}

async function poll() {
  try {
    const response = await fetch("/engine/stats");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const view = await response.json();
    const model = view.models.find((m) => m.name === $("model").value) || view.models[0];
    const dead = model && model.is_alive === false;
    $("phase").textContent = dead ? "engine dead" : view.phase;
    $("phase").className = "badge " + (dead ? "dead" : view.phase);
    if (model) showModel(model);
  } catch (e) {
    $("phase").textContent = "unreachable";
    $("phase").className = "badge failed";
  }
  setTimeout(poll, POLL_MS);
}

loadModels();
poll();
