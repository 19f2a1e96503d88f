// The page's side of OpenAI's streamed chat route, and readable errors.

/** An error to show on the page (its message is for people). */
export class ChatError extends Error {}

/**
 * Stream a chat reply. `onChunk(obj)` sees each parsed server-sent event
 * (chunks with text carry `x_redrafter`; the last one `redrafter`).
 * Resolves when the stream ends, rejects with ChatError (or AbortError when
 * `signal` aborts it).
 */
export async function streamChat(body, signal, onChunk) {
  let response;
  try {
    response = await fetch("v1/chat/completions", {
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
  if (error.code === "context_length_exceeded") {
    return new ChatError(`${message} Start a new chat, or shorten the system prompt or the message.`);
  }
  return new ChatError(`The server refused the request (HTTP ${response.status}): ${message}`);
}

/** The model id and whether it drafts, for the header ("" when unknown). */
export async function serverInfo() {
  try {
    const health = await (await fetch("health")).json();
    return `${health.model} · ${health.drafter ? "drafter on" : "no drafter"}`;
  } catch {
    return "";
  }
}
