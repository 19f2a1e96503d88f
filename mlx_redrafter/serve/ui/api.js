// The page's side of OpenAI's streamed chat route, readable errors, and the
// server's API key (asked for when the server answers 401, then kept).

import { storedKey, storeKey } from "./store.js";

/** An error to show on the page (its message is for people). */
export class ChatError extends Error {}

/**
 * `fetch(path, init)` with the kept API key as `Authorization: Bearer`. A 401
 * asks for the key (again, when the kept one was refused) and retries with
 * it; cancelling the question gives the 401 back.
 */
async function authorizedFetch(path, init = {}) {
  for (;;) {
    const key = storedKey();
    const headers = { ...init.headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const asked = prompt(
      key
        ? "The server refused the API key kept here. Enter the key (the --api-key it was started with):"
        : "This server needs an API key. Enter the key (the --api-key it was started with):",
    );
    if (!asked || !asked.trim()) return response;
    storeKey(asked.trim());
  }
}

/**
 * Stream a chat reply. `onChunk(obj)` sees each parsed server-sent event
 * (chunks with text carry `x_redrafter`; the last one `redrafter`).
 * Resolves when the stream ends, rejects with ChatError (or AbortError when
 * `signal` aborts it).
 */
export async function streamChat(body, signal, onChunk) {
  let response;
  try {
    response = await authorizedFetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      signal,
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ChatError(`The server at ${location.host} cannot be reached. Is mlx-redrafter serve still running?`);
  }
  if (!response.ok) throw await httpError(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let read;
    try {
      read = await reader.read();
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ChatError("The connection to the server was lost in the middle of the reply.");
    }
    if (read.done) break;
    buffer += decoder.decode(read.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (handleEvent(event, onChunk) === "done") return;
    }
  }
  throw new ChatError("The server ended the reply without finishing it.");
}

function handleEvent(event, onChunk) {
  const data = event
    .split("\n")
    .filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).trim())
    .join("\n");
  if (!data) return null;
  if (data === "[DONE]") return "done";
  const obj = JSON.parse(data);
  if (obj.error) throw new ChatError(`The server failed mid-reply: ${obj.error.message}`);
  onChunk(obj);
  return null;
}

async function httpError(response) {
  let error = {};
  try {
    error = (await response.json()).error || {};
  } catch {
    // not one of the server's error objects
  }
  const message = error.message || response.statusText || "no message";
  if (response.status === 503 || response.status === 429) {
    return new ChatError(error.message ? message : "The server is busy. Try again in a moment.");
  }
  if (response.status === 401) {
    return new ChatError("This server needs its API key (the --api-key it was started with). Send again to enter it.");
  }
  if (error.code === "context_length_exceeded") {
    return new ChatError(`${message} Start a new chat, or shorten the system prompt or the message.`);
  }
  return new ChatError(`The server refused the request (HTTP ${response.status}): ${message}`);
}

/** The model id and whether it drafts, for the header ("" when unknown). */
export async function serverInfo() {
  try {
    const health = await (await authorizedFetch("health")).json();
    const on = [health.drafter && "drafter", ...(health.sources || []).map((s) => s.split(":")[0])].filter(Boolean);
    return `${health.model} · ${on.length ? `${on.join(" + ")} on` : "no drafter"}`;
  } catch {
    return "";
  }
}
