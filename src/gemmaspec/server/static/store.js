// What the page keeps in the browser's localStorage: the conversations (new, rename, delete; they
// survive a reload) and the settings. Nothing is sent anywhere but to the server, with each request.

const CHATS_KEY = "gemmaspec-chats-v1";
const SETTINGS_KEY = "gemmaspec-settings-v1";
const OLD_KEY_KEY = "gemmaspec-api-key";  // where the first page kept the API key

export const DEFAULT_SETTINGS = {
  mode: "auto", system: "", max_tokens: "256", temperature: "0.7", top_k: "", top_p: "", min_p: "", seed: "",
  spec: "on", n_max: "", apikey: "", theme: "auto", specView: false,
};

/** The settings, defaults filled in. */
export function loadSettings() {
  let s = {};
  try { s = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {}; } catch (e) { s = {}; }
  const out = { ...DEFAULT_SETTINGS, ...s };
  if (!out.apikey) out.apikey = localStorage.getItem(OLD_KEY_KEY) || "";
  return out;
}

export function saveSettings(s) {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

/** The conversations: `chats` (newest first), each `{id, title, renamed, messages, updated}`; a
 * message is `{role: "user", content, mode, images}` (images: downscaled JPEG data URLs, see
 * attach.js) or `{role: "assistant", content, tokens, stats}`. */
export class ChatStore {
  constructor() {
    let d = null;
    try { d = JSON.parse(localStorage.getItem(CHATS_KEY) || "null"); } catch (e) { d = null; }
    this.chats = d && Array.isArray(d.chats) ? d.chats : [];
    this.currentId = d && d.current;
    if (!this.current) this.currentId = this.chats.length ? this.chats[0].id : null;
  }

  get current() {
    return this.chats.find((c) => c.id === this.currentId) || null;
  }

  /** Keep everything; when the browser's quota is full, the oldest conversations' token colours
   * go first, then their images (a note says how many), then the oldest conversations. */
  save() {
    for (;;) {
      try {
        localStorage.setItem(CHATS_KEY, JSON.stringify({ current: this.currentId, chats: this.chats }));
        return;
      } catch (e) {
        const oldest = (has) => [...this.chats].reverse().find((c) => c.messages.some(has));
        const withTokens = oldest((m) => m.tokens), withImages = oldest((m) => m.images && m.images.length);
        if (withTokens) withTokens.messages.forEach((m) => delete m.tokens);
        else if (withImages) {
          for (const m of withImages.messages) {
            if (!m.images || !m.images.length) continue;
            m.imagesDropped = (m.imagesDropped || 0) + m.images.length;
            delete m.images;
          }
        } else if (this.chats.length > 1) this.chats.pop();
        else return;
      }
    }
  }

  create() {
    const chat = { id: newId(), title: "New chat", renamed: false, messages: [], updated: Date.now() };
    this.chats.unshift(chat);
    this.currentId = chat.id;
    this.save();
    return chat;
  }

  select(id) {
    if (this.chats.some((c) => c.id === id)) this.currentId = id;
    this.save();
  }

  rename(id, title) {
    const c = this.chats.find((x) => x.id === id);
    if (c && title.trim()) { c.title = title.trim(); c.renamed = true; this.save(); }
  }

  remove(id) {
    this.chats = this.chats.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.chats.length ? this.chats[0].id : null;
    this.save();
  }

  /** The current chat changed (a message added or edited): it moves to the top, and takes its first
   * message as its title unless renamed. */
  touch(chat) {
    if (!this.chats.includes(chat)) return;  // deleted meanwhile
    chat.updated = Date.now();
    if (!chat.renamed && chat.messages.length) {
      const m0 = chat.messages[0], first = m0.content.replace(/\s+/g, " ").trim();
      chat.title = first.length > 48 ? first.slice(0, 47) + "…" : first || (m0.images && m0.images.length ? "Image" : "New chat");
    }
    this.chats = [chat, ...this.chats.filter((c) => c !== chat)];
    this.save();
  }
}
