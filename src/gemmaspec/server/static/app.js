// The chat page's controller: conversations, sending and streaming, Stop, edit / regenerate / copy,
// the settings panel, the theme, the text-completion mode for a base model, and images attached to a
// message (file picker, paste, drop) when the server has a vision tower.
import { downscale, imageFiles, thumb } from "./attach.js";
import { chatBody, completionBody, errorText, events, headers, piece } from "./api.js";
import { copyText } from "./markdown.js";
import { entriesOf } from "./spec.js";
import { ChatStore, DEFAULT_SETTINGS, loadSettings, saveSettings } from "./store.js";
import { editMessage, fillReply, messageEl } from "./view.js";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop"), empty = $("empty");
const store = new ChatStore();
let settings = loadSettings();
let server = { isBase: null, spec: null, vision: false };  // from /props
let controller = null;  // the running request's AbortController
let attached = [];  // the composer's images (downscaled data URLs), sent with the next message
let attaching = Promise.resolve();  // images still being decoded and downscaled

// -- settings -------------------------------------------------------------------------------------
const FIELDS = { mode: "mode", system: "system", max_tokens: "max-tokens", temperature: "temperature",
                 top_k: "top-k", top_p: "top-p", min_p: "min-p", seed: "seed", spec: "spec", n_max: "n-max",
                 apikey: "apikey" };

function fillSettings() {
  for (const [key, id] of Object.entries(FIELDS)) $(id).value = settings[key];
  $("spec-view").checked = !!settings.specView;
  const sp = server.spec;
  $("spec-info").textContent = sp ? `The server drafts with ${sp.type} (n-max ${sp.n_max}); a request can change ` +
    "n-max or turn drafting off, not the drafter (the server's --spec-type)." : "";
}

for (const [key, id] of Object.entries(FIELDS)) {
  $(id).addEventListener("input", () => { settings[key] = $(id).value; saveSettings(settings); showNotice(); });
}
$("open-settings").addEventListener("click", () => { fillSettings(); $("settings").showModal(); });
$("reset-settings").addEventListener("click", () => {
  settings = { ...DEFAULT_SETTINGS, apikey: settings.apikey, theme: settings.theme, specView: settings.specView };
  saveSettings(settings);
  fillSettings();
  showNotice();
});

function applyTheme() {
  if (settings.theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = settings.theme;
  $("theme").title = `Theme: ${settings.theme === "auto" ? "the system's" : settings.theme} (click to change)`;
}
$("theme").addEventListener("click", () => {
  settings.theme = { auto: "dark", dark: "light", light: "auto" }[settings.theme] || "auto";
  saveSettings(settings);
  applyTheme();
});
$("spec-view").addEventListener("change", () => {
  settings.specView = $("spec-view").checked;
  saveSettings(settings);
  renderChat();
});

/** "chat" or "completion": the setting, or for "auto" text completion when the model is a base model. */
function mode() {
  if (settings.mode === "chat" || settings.mode === "completion") return settings.mode;
  return server.isBase ? "completion" : "chat";
}

function showNotice() {
  const n = $("notice");
  n.hidden = !server.isBase;
  if (server.isBase) {
    n.textContent = mode() === "completion"
      ? "The loaded model is a base model: it continues text rather than answering, so the page sends text " +
        "completions (your text, then its continuation). ⚙ switches to chat."
      : "The loaded model is a base model: it continues text rather than answering; its chat replies will be poor. " +
        "⚙ → mode switches to text completion.";
  }
}

// -- conversations --------------------------------------------------------------------------------
function renderSidebar() {
  const ul = $("chats");
  ul.textContent = "";
  for (const c of store.chats) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c.id === store.currentId) li.className = "current";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = c.title;
    title.title = c.title;
    const rename = document.createElement("button");
    rename.className = "rename"; rename.type = "button"; rename.textContent = "✎"; rename.title = "Rename";
    const del = document.createElement("button");
    del.className = "delete"; del.type = "button"; del.textContent = "✕"; del.title = "Delete";
    li.append(title, rename, del);
    ul.appendChild(li);
  }
}

$("chats").addEventListener("click", (ev) => {
  const li = ev.target.closest("li");
  if (!li) return;
  const id = li.dataset.id;
  if (ev.target.classList.contains("delete")) {
    const c = store.chats.find((x) => x.id === id);
    if (!confirm(`Delete the conversation "${c ? c.title : ""}"?`)) return;
    if (id === store.currentId) stop();
    store.remove(id);
    renderAll();
  } else if (ev.target.classList.contains("rename")) {
    const title = li.querySelector(".title");
    const box = document.createElement("input");
    box.className = "rename-box";
    box.value = title.textContent;
    title.replaceWith(box);
    box.focus();
    box.select();
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep) store.rename(id, box.value);
      renderSidebar();
    };
    box.addEventListener("keydown", (e) => { if (e.key === "Enter") finish(true); if (e.key === "Escape") finish(false); });
    box.addEventListener("blur", () => finish(true));
  } else if (ev.target.classList.contains("title") && id !== store.currentId) {
    stop();
    store.select(id);
    renderAll();
    document.body.classList.remove("sidebar-open");
  }
});
$("new-chat").addEventListener("click", () => { stop(); store.create(); renderAll(); input.focus(); });
$("toggle-sidebar").addEventListener("click", () => {  // narrow screens: shown on demand; wide ones: hidden on demand
  document.body.classList.toggle(matchMedia("(max-width: 700px)").matches ? "sidebar-open" : "sidebar-closed");
});
$("close-sidebar").addEventListener("click", () => document.body.classList.remove("sidebar-open"));
$("main").addEventListener("click", (ev) => {  // a click beside the open list closes it
  if (!ev.target.closest("#toggle-sidebar")) document.body.classList.remove("sidebar-open");
});

function renderChat() {
  log.textContent = "";
  const chat = store.current;
  if (!chat || !chat.messages.length) { log.appendChild(empty); return; }
  chat.messages.forEach((m, i) => log.appendChild(messageEl(m, i, settings.specView)));
  log.scrollTop = log.scrollHeight;
}

function renderAll() { renderSidebar(); renderChat(); }

// -- generating -----------------------------------------------------------------------------------
function setBusy(busy) { sendBtn.disabled = busy; stopBtn.disabled = !busy; }

function stop() { if (controller) controller.abort(); }

function errorBubble(text) {
  const div = document.createElement("div");
  div.className = "msg error";
  div.textContent = "error: " + text;
  log.appendChild(div);
}

/** Generate the reply to the current conversation's last message, streamed into a new bubble. */
async function generate() {
  const chat = store.current, m = mode();
  const last = chat.messages[chat.messages.length - 1];
  const reply = { role: "assistant", content: "", tokens: [], stats: null, mode: m, streaming: true };
  chat.messages.push(reply);
  const index = chat.messages.length - 1;
  if (empty.isConnected) empty.remove();
  log.appendChild(messageEl(reply, index, settings.specView));
  // the reply's bubble now (the conversation may have been drawn again meanwhile), or null when another is shown
  const bubble = () => (store.current === chat ? log.querySelector(`.msg.assistant[data-index="${index}"]`) : null);
  controller = new AbortController();
  setBusy(true);
  let timings = null, stopped = false, error = null, pending = false;
  const paint = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      const div = bubble();
      if (!div || !reply.streaming) return;
      const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
      fillReply(div, reply);
      if (atEnd) log.scrollTop = log.scrollHeight;
    });
  };
  try {
    const body = m === "completion" ? completionBody(settings, last.content, last.images)
      : chatBody(settings, chat.messages.slice(0, -1));
    const r = await fetch(m === "completion" ? "completion" : "v1/chat/completions", {
      method: "POST", headers: headers(settings.apikey), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const ev of events(r)) {
      const p = piece(ev, m);
      if (p.timings) timings = p.timings;
      if (p.text || p.provenance) {
        reply.content += p.text;
        reply.tokens.push(...entriesOf(p.text, p.provenance));
        reply.stats = { timings, stopped: false };
        paint();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else error = e.message;
  } finally {
    controller = null;
    setBusy(false);
  }
  reply.stats = { timings, stopped };
  delete reply.streaming;
  const div = bubble();
  if (error && !reply.content) {
    chat.messages.splice(chat.messages.indexOf(reply), 1);
    if (div) { div.remove(); errorBubble(error); }
  } else {
    if (error) reply.stats.error = error;
    if (div) { fillReply(div, reply); div.dataset.done = "1"; }
  }
  store.touch(chat);
  renderSidebar();
}

function send(text, images) {
  const chat = store.current || store.create();
  chat.messages.push({ role: "user", content: text, mode: mode(), ...(images.length ? { images } : {}) });
  store.touch(chat);
  renderAll();
  generate();
}

$("form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  await attaching;
  const text = input.value;
  if ((!text.trim() && !attached.length) || controller) return;
  input.value = "";
  const images = attached;
  attached = [];
  renderAttachments();
  send(text, images);
});

// -- images ---------------------------------------------------------------------------------------
function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  attached.forEach((url, i) => box.appendChild(thumb(url, () => { attached.splice(i, 1); renderAttachments(); })));
  box.hidden = !attached.length;
}

/** Attach the image files among `files` (each downscaled, see attach.js); other files are refused. */
function attachFiles(files) {
  const all = Array.from(files || []), images = imageFiles(all);
  if (all.length > images.length) errorBubble("only images can be attached (PNG, JPEG, WebP, GIF, BMP)");
  attaching = attaching.then(async () => {
    for (const f of images) {
      try { attached.push(await downscale(f)); } catch (e) { errorBubble(e.message); }
    }
    renderAttachments();
  });
  return attaching;
}

$("attach").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", () => { attachFiles($("file").files); $("file").value = ""; });
input.addEventListener("paste", (ev) => {  // a pasted image is attached; pasted text stays text
  const files = imageFiles(ev.clipboardData && ev.clipboardData.files);
  if (!server.vision || !files.length) return;
  ev.preventDefault();
  attachFiles(files);
});
$("form").addEventListener("dragover", (ev) => { if (server.vision) { ev.preventDefault(); $("form").classList.add("drop"); } });
$("form").addEventListener("dragleave", () => $("form").classList.remove("drop"));
$("form").addEventListener("drop", (ev) => {
  $("form").classList.remove("drop");
  if (!server.vision || !ev.dataTransfer || !ev.dataTransfer.files.length) return;
  ev.preventDefault();
  attachFiles(ev.dataTransfer.files);
});
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
stopBtn.addEventListener("click", stop);

// the buttons of each message: copy, edit, regenerate, tokens view, and the code blocks' copy
log.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  if (b.classList.contains("copy-code")) {
    const ok = await copyText(b.closest(".code").querySelector("code").textContent);
    flash(b, ok ? "copied" : "copy failed", "copy");
    return;
  }
  const div = b.closest(".msg"), chat = store.current;
  if (!div || !chat || div.dataset.index === undefined) return;
  const i = parseInt(div.dataset.index, 10), msg = chat.messages[i];
  if (b.classList.contains("copy-msg")) {
    flash(b, (await copyText(msg.content)) ? "copied" : "copy failed", "copy");
  } else if (b.classList.contains("toggle-tokens")) {
    div.dataset.view = div.dataset.view === "tokens" ? "text" : "tokens";
    fillReply(div, msg);
  } else if (b.classList.contains("regen") && !controller) {
    chat.messages.splice(i);
    renderChat();
    generate();
  } else if (b.classList.contains("edit") && !controller) {
    editMessage(div, msg.content, (text) => {
      chat.messages.splice(i);
      chat.messages.push({ ...msg, content: text });
      store.touch(chat);
      renderAll();
      generate();
    }, () => renderChat());
  }
});

function flash(b, text, back) {
  b.textContent = text;
  setTimeout(() => { b.textContent = back; }, 1500);
}

// -- the server -----------------------------------------------------------------------------------
async function loadModel() {
  try {
    const r = await fetch("v1/models", { headers: headers(settings.apikey) });
    const j = await r.json();
    $("model").textContent = r.ok ? j.data[0].id : (j.error ? j.error.message : "unavailable");
    if (r.status === 503) { setTimeout(loadModel, 1000); return; }
    if (r.ok) await loadProps();
  } catch (e) { $("model").textContent = "server unreachable"; }
}

/** The model's kind and the server's speculation, from /props. A base model is told by `is_base_model`
 * when the server sends it; without it the page stays in chat mode unless the settings say otherwise. */
async function loadProps() {
  try {
    const r = await fetch("props", { headers: headers(settings.apikey) });
    if (!r.ok) return;
    const p = await r.json();
    server = { isBase: typeof p.is_base_model === "boolean" ? p.is_base_model : null, spec: p.speculative || null,
               vision: !!(p.modalities && p.modalities.vision) };  // llama-server's: a vision tower is loaded
    $("attach").hidden = !server.vision;
    const sp = server.spec;
    if (sp) $("model").textContent += ` · ${sp.type === "none" ? "no speculation" : sp.type + ", n-max " + sp.n_max}` +
                                       (server.isBase ? " · base model" : "");
    showNotice();
  } catch (e) { /* the page works without it */ }
}

$("apikey").addEventListener("change", loadModel);
applyTheme();
fillSettings();
renderAll();
loadModel();
