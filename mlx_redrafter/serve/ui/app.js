// The chat page: conversations (kept in localStorage), streaming, Stop,
// settings, and the live status line that shows where the tokens came from.

import { ChatError, serverInfo, streamChat } from "./api.js";
import { chunkSource, renderReply } from "./render.js";
import { Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"), input: $("input"), send: $("send"), stop: $("stop"), status: $("status"),
  error: $("error"), chats: $("chats"), newChat: $("new-chat"), system: $("system"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), showSources: $("show-sources"),
};
const store = new Store(localStorage);
let running = null; // {controller, message} while a reply streams

// ------------------------------------------------------------------ drawing

function messageElement(message) {
  const el = document.createElement("article");
  el.className = `msg ${message.role}`;
  const who = document.createElement("h2");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "body";
  el.append(who, body);
  drawMessage(el, message);
  return el;
}

function drawMessage(el, message) {
  const body = el.querySelector(".body");
  el.dataset.state = message.state || "done";
  if (message.role === "user") body.textContent = message.content;
  else renderReply(body, message.segments || [[message.content, "llm"]]);
  let note = el.querySelector(".note");
  // While a reply streams its numbers are in the status line.
  const state = message.state || "done";
  const text = state === "stopped" ? "Stopped." : state === "done" && message.stats ? statusText(message.stats) : "";
  if (text && !note) {
    note = document.createElement("p");
    note.className = "note";
    el.append(note);
  }
  if (note) note.textContent = text;
}

function drawConversation() {
  const chat = store.current();
  ui.log.replaceChildren(...chat.messages.map(messageElement));
  ui.log.scrollTop = ui.log.scrollHeight;
  ui.chats.replaceChildren(
    ...store.list().map(({ id, title }) => new Option(title, id, false, id === chat.id)),
  );
  const s = store.settings;
  ui.system.value = s.system;
  ui.temperature.value = s.temperature;
  ui.maxTokens.value = s.maxTokens ?? "";
  ui.showSources.checked = s.showSources;
  document.body.classList.toggle("sources-on", s.showSources);
}

function showError(text) {
  ui.error.hidden = !text;
  ui.error.textContent = text || "";
}

function setRunning(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  ui.newChat.disabled = on;
  ui.chats.disabled = on;
}

// ------------------------------------------------------------------ the status line

/** Live stats of a reply: from the chunks' x_redrafter, then the final stats. */
function newStats() {
  return { tokens: 0, steps: 0, tps: 0, drafts: {}, prompt: 0, reused: 0 };
}

function addChunkStats(stats, x) {
  // Draft sources: "drafter", "mtp", "draft-model", "eagle3", "dflash", "lookup", "datastore".
  for (const source of x.sources) if (source !== "llm") stats.drafts[source] = (stats.drafts[source] || 0) + 1;
  Object.assign(stats, { tokens: x.tokens, steps: x.steps, tps: x.tokens_per_second,
    prompt: x.prompt_tokens, reused: x.prompt_tokens_reused });
}

function statusText(s) {
  const pct = (n) => `${Math.round((100 * n) / Math.max(s.tokens, 1))}%`;
  const perStep = s.tokens / Math.max(s.steps, 1);
  const counts = Object.entries(s.drafts);
  const drafted = counts.reduce((sum, [, n]) => sum + n, 0);
  const parts = counts.map(([source, n]) => `${source} ${pct(n)}`);
  return [
    `${s.tps.toFixed(1)} tokens/s`,
    `${perStep.toFixed(2)} tokens/step`,
    `${pct(drafted)} from drafts${parts.length ? ` (${parts.join(", ")})` : ""}`,
    `prompt ${s.prompt} tokens, ${s.reused} reused from the cache`,
  ].join(" · ");
}

// ------------------------------------------------------------------ a turn

function requestBody(chat) {
  const s = store.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages) if (m.content) messages.push({ role: m.role, content: m.content });
  const body = { messages, temperature: Number(s.temperature) || 0 };
  if (s.maxTokens) body.max_tokens = Number(s.maxTokens);
  return body;
}

async function send(text) {
  if (running || !text.trim()) return;
  showError("");
  const chat = store.current();
  chat.messages.push({ role: "user", content: text });
  const body = requestBody(chat);
  const reply = { role: "assistant", content: "", segments: [], state: "streaming", stats: newStats() };
  chat.messages.push(reply);
  store.save();
  drawConversation();
  ui.input.value = "";
  const el = ui.log.lastElementChild;
  running = { controller: new AbortController(), reply };
  setRunning(true);
  ui.status.textContent = "Waiting for the model…";
  let frame = 0;
  const redraw = () => {
    frame = 0;
    drawMessage(el, reply);
    ui.status.textContent = statusText(reply.stats);
    el.scrollIntoView({ block: "end" });
  };
  try {
    await streamChat(body, running.controller.signal, (chunk) => {
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply.content += delta;
        reply.segments.push([delta, chunkSource(chunk.x_redrafter?.sources)]);
      }
      if (chunk.x_redrafter) addChunkStats(reply.stats, chunk.x_redrafter);
      if (chunk.redrafter) reply.stats.tps = chunk.redrafter.generation_tps;
      if (!frame) frame = requestAnimationFrame(redraw);
    });
    reply.state = "done";
  } catch (e) {
    reply.state = e.name === "AbortError" ? "stopped" : "error";
    if (reply.state === "error") failed(chat, reply, text, e);
  } finally {
    cancelAnimationFrame(frame);
    finish(chat, reply);
  }
}

function failed(chat, reply, text, e) {
  showError(e instanceof ChatError ? e.message : `Something went wrong: ${e.message}`);
  if (!reply.content) {
    // Nothing came back: take the turn out and give the text back to retry.
    chat.messages.splice(-2, 2);
    ui.input.value = text;
  }
}

function finish(chat, reply) {
  running = null;
  setRunning(false);
  store.save();
  drawConversation();
  ui.status.textContent =
    reply.state === "stopped" ? "Stopped." : reply.state === "error" ? "Failed." : statusText(reply.stats);
  ui.input.focus();
}

// ------------------------------------------------------------------ controls

ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send(ui.input.value);
  } else if (e.key === "Escape" && running) {
    running.controller.abort();
  }
});
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send(ui.input.value);
});
ui.stop.addEventListener("click", () => {
  running?.controller.abort();
  ui.input.focus();
});
ui.newChat.addEventListener("click", () => {
  store.newChat();
  showError("");
  drawConversation();
  ui.status.textContent = "New chat.";
  ui.input.focus();
});
ui.chats.addEventListener("change", () => {
  store.select(ui.chats.value);
  drawConversation();
});
const settingInputs = [ui.system, ui.temperature, ui.maxTokens, ui.showSources];
function saveSettings() {
  Object.assign(store.settings, {
    system: ui.system.value, temperature: ui.temperature.value,
    maxTokens: ui.maxTokens.value || null, showSources: ui.showSources.checked,
  });
  store.save();
  document.body.classList.toggle("sources-on", ui.showSources.checked);
}
for (const input of settingInputs) {
  input.addEventListener("input", saveSettings);
  input.addEventListener("change", saveSettings);
}

drawConversation();
serverInfo().then((info) => ($("model").textContent = info));
ui.input.focus();
