// Conversations and settings, kept in the browser's localStorage so that a
// reload (or a restart of the server) keeps them.

const KEY = "mlx-redrafter.chat.v1";
const DEFAULT_SETTINGS = { system: "", temperature: "0", maxTokens: null, showSources: true };

function fresh() {
  return { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, messages: [] };
}

export class Store {
  constructor(storage) {
    this.storage = storage;
    let state = null;
    try {
      state = JSON.parse(storage.getItem(KEY));
    } catch {
      // unreadable: start over
    }
    if (!state || !Array.isArray(state.chats) || !state.chats.length) {
      state = { chats: [fresh()], currentId: null, settings: {} };
    }
    state.settings = { ...DEFAULT_SETTINGS, ...state.settings };
    this.state = state;
    // A reply that was streaming when the page went away did not finish.
    for (const chat of state.chats) {
      for (const m of chat.messages) if (m.state === "streaming") m.state = "stopped";
    }
    if (!this.byId(state.currentId)) state.currentId = state.chats[0].id;
  }

  get settings() {
    return this.state.settings;
  }

  byId(id) {
    return this.state.chats.find((c) => c.id === id);
  }

  current() {
    return this.byId(this.state.currentId);
  }

  /** `[{id, title}]`, newest first; a chat's title is its first message. */
  list() {
    return this.state.chats.map((c) => {
      const first = c.messages.find((m) => m.role === "user");
      const title = first ? first.content.slice(0, 40) : "New chat";
      return { id: c.id, title };
    });
  }

  newChat() {
    const empty = this.state.chats.find((c) => !c.messages.length);
    const chat = empty || fresh();
    if (!empty) this.state.chats.unshift(chat);
    this.state.currentId = chat.id;
    this.save();
  }

  select(id) {
    if (this.byId(id)) this.state.currentId = id;
    this.save();
  }

  save() {
    try {
      this.storage.setItem(KEY, JSON.stringify(this.state));
    } catch {
      // full or disabled storage: the chat still works, it is just not kept
    }
  }
}

// The server's API key (`serve --api-key`), asked for once and kept apart
// from the conversations; null when none was given yet.
const API_KEY = "mlx-redrafter.api-key";

export function storedKey(storage = localStorage) {
  try {
    return storage.getItem(API_KEY);
  } catch {
    return null;
  }
}

export function storeKey(key, storage = localStorage) {
  try {
    storage.setItem(API_KEY, key);
  } catch {
    // disabled storage: the key is asked for again next time
  }
}
