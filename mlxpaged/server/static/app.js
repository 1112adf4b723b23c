// mlxpaged's page: chat on /v1/chat/completions (streamed, n answers side by side; images attached to
// a message go as `image_url` data URLs, for a vision model) and a live view
// of the paged KV cache from /web/cache (server-sent events read through fetch, so the API key
// goes in a header, as on every route). No framework, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const POOL_SHOWN = 4096; // blocks drawn at most; the counters cover the rest
const state = {
  key: sessionStorage.getItem("mlxpaged-key") || "",
  model: null,
  history: [], // the conversation: the user's turns and answer 0 of each reply
  chat: null, // the AbortController of the answer being streamed
  watch: null, // the AbortController of the cache stream
  last: null, // the previous cache picture (to tell what changed)
};

function headers(json) {
  const h = {};
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || `${resp.status} ${resp.statusText}`;
  } catch (e) {
    return `${resp.status} ${resp.statusText}`;
  }
}

// Calls onData with each event's data of a text/event-stream response, until it ends.
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
}

// -- connecting, and the key ----------------------------------------------------------------------
async function connect() {
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers(false) });
  } catch (e) {
    $("model").textContent = "server unreachable";
    return;
  }
  if (resp.status === 401) {
    $("key-panel").hidden = false;
    $("key-error").textContent = state.key ? await errorText(resp) : "";
    $("model").textContent = "locked";
    $("auth").textContent = "";
    $("key").focus();
    return;
  }
  if (!resp.ok) {
    $("error").textContent = await errorText(resp);
    return;
  }
  const models = await resp.json();
  state.model = models.data[0].id;
  $("model").textContent = state.model;
  $("auth").textContent = state.key ? "· API key set" : "";
  $("key-panel").hidden = true;
  $("key-error").textContent = "";
  watchCache();
}

function useKey() {
  state.key = $("key").value.trim();
  sessionStorage.setItem("mlxpaged-key", state.key);
  connect();
}

// -- chat -------------------------------------------------------------------------------------------
function intValue(id, fallback) {
  const v = parseInt($(id).value, 10);
  return Number.isFinite(v) ? v : fallback;
}

// The log follows a streaming answer while the reader is at its end; one who scrolled up stays put.
function logAtEnd() {
  const log = $("log");
  return log.scrollHeight - log.scrollTop - log.clientHeight < 40;
}
function logToEnd() {
  $("log").scrollTop = $("log").scrollHeight;
}

// The attached files as data URLs (read in the browser; nothing is uploaded but the message itself).
function readImages(files) {
  return Promise.all(
    [...files].map(
      (f) =>
        new Promise((resolve, reject) => {
          const r = new FileReader();
          r.onload = () => resolve(r.result);
          r.onerror = () => reject(new Error(`cannot read ${f.name}`));
          r.readAsDataURL(f);
        }),
    ),
  );
}

function thumbnail(url) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.alt = "attached image";
  img.src = url;
  return img;
}

function showAttached() {
  const box = $("attached");
  box.textContent = "";
  readImages($("image").files).then((urls) => urls.forEach((u) => box.appendChild(thumbnail(u))));
}

function newTurn(text, n, images) {
  const turn = document.createElement("div");
  turn.className = "turn";
  const user = document.createElement("div");
  user.className = "user";
  for (const url of images) user.appendChild(thumbnail(url));
  user.appendChild(document.createTextNode(text));
  const answers = document.createElement("div");
  answers.className = "answers";
  const cells = [];
  for (let i = 0; i < n; i++) {
    const cell = document.createElement("div");
    cell.className = "answer";
    cell.dataset.index = i;
    cell.innerHTML = '<div class="text"></div><div class="meta"></div>';
    answers.appendChild(cell);
    cells.push(cell);
  }
  const usage = document.createElement("div");
  usage.className = "usage";
  turn.append(user, answers, usage);
  $("log").appendChild(turn);
  logToEnd();
  return { cells, usage };
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value;
  const files = $("image").files;
  if ((!text.trim() && !files.length) || state.chat) return;
  $("error").textContent = "";
  let images = [];
  try {
    if (files.length) images = await readImages(files);
  } catch (e) {
    $("error").textContent = String(e.message || e);
    return;
  }
  // the message's text, then its images: OpenAI's content parts
  const content = images.length
    ? [...(text ? [{ type: "text", text }] : []), ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
    : text;
  const n = intValue("n", 1);
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content });
  const body = {
    model: state.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    n,
    temperature: parseFloat($("temperature").value) || 0,
    max_tokens: intValue("max-tokens", 256),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length);
  if (stop.length) body.stop = stop;
  const { cells, usage } = newTurn(text, n, images);
  $("prompt").value = "";
  $("image").value = "";
  $("attached").textContent = "";
  state.chat = new AbortController();
  $("send").disabled = true;
  $("stop-btn").disabled = false;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal: state.chat.signal,
    });
    if (!resp.ok) {
      $("error").textContent = await errorText(resp);
      if (resp.status === 401) connect();
      return;
    }
    await readEvents(resp, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        $("error").textContent = chunk.error.message;
        return;
      }
      const follow = logAtEnd();
      for (const c of chunk.choices || []) {
        const cell = cells[c.index];
        if (!cell) continue;
        if (c.delta && c.delta.content) cell.querySelector(".text").textContent += c.delta.content;
        if (c.finish_reason) cell.querySelector(".meta").textContent = "finish: " + c.finish_reason;
      }
      if (chunk.usage) {
        const u = chunk.usage;
        const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
        usage.textContent = `prompt ${u.prompt_tokens} tokens (${cached} from the prefix cache), answers ${u.completion_tokens} tokens`;
      }
      if (follow) logToEnd();
    });
    state.history.push({ role: "user", content });
    state.history.push({ role: "assistant", content: cells[0].querySelector(".text").textContent });
  } catch (e) {
    if (e.name === "AbortError") {
      for (const cell of cells) {
        const meta = cell.querySelector(".meta");
        if (!meta.textContent) meta.textContent = "stopped";
      }
    } else {
      $("error").textContent = String(e);
    }
  } finally {
    state.chat = null;
    $("send").disabled = false;
    $("stop-btn").disabled = true;
  }
}

// -- the cache view ---------------------------------------------------------------------------------
async function watchCache() {
  if (state.watch) state.watch.abort();
  const ctl = (state.watch = new AbortController());
  while (state.watch === ctl) {
    try {
      const resp = await fetch("/web/cache", { headers: headers(false), signal: ctl.signal });
      if (!resp.ok) {
        $("cache-state").textContent = await errorText(resp);
        return;
      }
      $("cache-state").textContent = "live";
      await readEvents(resp, (data) => render(JSON.parse(data)));
    } catch (e) {
      if (e.name === "AbortError") return;
    }
    $("cache-state").textContent = "reconnecting…";
    await new Promise((r) => setTimeout(r, 1000));
  }
}

const COUNTERS = [
  ["blocks used / total", (v) => `${v.counters.blocks_used} / ${v.num_blocks}${v.max_blocks > v.num_blocks ? ` (up to ${v.max_blocks})` : ""}`, "blocks_used"],
  ["cached (free, reusable)", (v) => v.counters.blocks_cached, "blocks_cached"],
  ["peak blocks in use", (v) => v.counters.blocks_in_use_peak, "blocks_in_use_peak"],
  ["blocks if unshared", (v) => v.counters.blocks_without_sharing, "blocks_without_sharing"],
  ["tokens per block held", (v) => `${v.counters.tokens_per_block.toFixed(1)} of ${v.block_size}`, "tokens_per_block"],
  ["waste (empty slots held)", (v) => `${(100 * v.counters.waste).toFixed(1)} %`, "waste"],
  ["prefix hits: memory", (v) => `${v.counters.prefix_hit_tokens - v.counters.prefix_disk_hit_tokens} tokens`, "prefix_memory"],
  ["prefix hits: disk", (v) => `${v.counters.prefix_disk_hit_tokens} tokens`, "prefix_disk"],
  ["preemptions", (v) => v.counters.preemptions, "preemptions"],
  ["copy-on-write copies", (v) => v.counters.cow_copies, "cow_copies"],
  ["tokens/s", (v) => v.counters.tokens_per_s.toFixed(1), "tokens_per_s"],
  ["steps", (v) => v.counters.steps, "steps"],
];

function renderCounters(view) {
  const dl = $("counters");
  if (!dl.children.length) {
    for (const [label, , key] of COUNTERS) {
      const row = document.createElement("div");
      row.innerHTML = "<dt></dt><dd></dd>";
      row.firstChild.textContent = label;
      row.lastChild.id = "c-" + key;
      dl.appendChild(row);
    }
  }
  for (const [, value, key] of COUNTERS) $("c-" + key).textContent = value(view);
}

const STATE_CLASS = { ".": "block free", c: "block cached", u: "block used" };

function renderPool(view) {
  const pool = $("pool");
  const shown = Math.min(view.num_blocks, POOL_SHOWN);
  while (pool.children.length > shown) pool.lastChild.remove();
  while (pool.children.length < shown) pool.appendChild(document.createElement("span"));
  const refs = new Map(view.shared);
  for (let i = 0; i < shown; i++) {
    const el = pool.children[i];
    const ref = refs.get(i);
    const cls = STATE_CLASS[view.pool[i]] + (ref ? " shared" : "");
    if (el.className !== cls) el.className = cls;
    const label = ref ? String(ref) : "";
    if (el.textContent !== label) el.textContent = label;
    el.title = `block ${i}: ${ref ? `shared by ${ref} tables` : cls.slice(6)}`;
  }
  $("pool-note").textContent = view.num_blocks > shown ? `showing ${shown} of ${view.num_blocks} blocks` : "";
}

function renderRequests(view) {
  const box = $("requests");
  box.textContent = "";
  const refs = new Map(view.shared);
  for (const r of [...view.requests, ...view.waiting]) {
    const div = document.createElement("div");
    div.className = "req";
    div.dataset.id = r.id;
    const head = document.createElement("div");
    head.className = "head";
    const parts = [`#${r.id}`, r.status, `n=${r.n}`, `prompt ${r.prompt_tokens} tokens`];
    if (r.cached_tokens) parts.push(`prefix hit ${r.cached_tokens} tokens`);
    if (r.forked) parts.push("forked");
    if (r.preemptions) parts.push(`preempted ${r.preemptions}×`);
    head.textContent = parts.join(" · ");
    div.appendChild(head);
    for (const s of r.samples) {
      const row = document.createElement("div");
      row.className = "sample";
      const name = document.createElement("span");
      name.textContent = `sample ${s.sample}: ${s.tokens} tokens →`;
      row.appendChild(name);
      s.blocks.forEach((b, i) => {
        const chip = document.createElement("span");
        const ref = refs.get(b);
        chip.className = ref ? "chip shared" : "chip";
        chip.textContent = String(b);
        chip.title = `logical ${i} → physical ${b}${ref ? `, shared by ${ref}` : ""}`;
        row.appendChild(chip);
      });
      div.appendChild(row);
    }
    box.appendChild(div);
  }
  if (!box.children.length) box.innerHTML = '<p class="muted">none</p>';
}

function note(text) {
  const li = document.createElement("li");
  li.textContent = text;
  const list = $("events");
  list.prepend(li);
  while (list.children.length > 20) list.lastChild.remove();
}

function renderEvents(view) {
  const prev = state.last;
  state.last = view;
  if (!prev) return;
  const before = new Map([...prev.requests, ...prev.waiting].map((r) => [r.id, r]));
  for (const r of view.requests) {
    const p = before.get(r.id);
    if ((!p || p.status !== "running") && r.status === "running") {
      note(`#${r.id} admitted: ${r.prompt_tokens} prompt tokens, ${r.cached_tokens} from the prefix cache, n=${r.n}`);
    }
    if (r.forked && p && !p.forked) note(`#${r.id} forked into ${r.n} samples sharing the prompt's blocks`);
  }
  let preempted = 0;
  for (const r of [...view.requests, ...view.waiting]) {
    const p = before.get(r.id);
    if (p && r.preemptions > p.preemptions) {
      note(`#${r.id} preempted: its blocks were freed; it is recomputed when readmitted`);
      preempted += r.preemptions - p.preemptions;
    }
  }
  const missed = view.counters.preemptions - prev.counters.preemptions - preempted;
  if (missed > 0) note(`${missed} preempted between two pictures`);
  const now = new Set([...view.requests, ...view.waiting].map((r) => r.id));
  for (const id of before.keys()) if (!now.has(id)) note(`#${id} finished: its blocks went back to the pool`);
  const cow = view.counters.cow_copies - prev.counters.cow_copies;
  if (cow > 0) note(`${cow} copy-on-write cop${cow === 1 ? "y" : "ies"} of a shared last block`);
}

function render(view) {
  renderCounters(view);
  renderPool(view);
  renderRequests(view);
  renderEvents(view);
  $("cache-state").textContent = view.idle ? "live · idle" : "live";
}

// -- wiring -----------------------------------------------------------------------------------------
$("ask").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("image").addEventListener("change", showAttached);
$("stop-btn").addEventListener("click", () => state.chat && state.chat.abort());
$("clear").addEventListener("click", () => {
  state.history = [];
  $("log").textContent = "";
});
$("key-save").addEventListener("click", useKey);
$("key").addEventListener("keydown", (e) => e.key === "Enter" && useKey());
connect();
