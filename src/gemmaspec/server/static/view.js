// The conversation's messages as DOM: user messages as plain text, replies as sanitised markdown
// (chat) or plain text (text completion), or as coloured tokens with the speculation panel; under
// each reply its figures (tokens, tokens/s, draft acceptance, time to first token).
import { thumb } from "./attach.js";
import { renderMarkdown } from "./markdown.js";
import { renderTokens, specPanel } from "./spec.js";

/** The figures line of a reply: from the server's timings (the last ones streamed, so a stopped
 * reply keeps them) and whether it was stopped. */
export function statsText(stats) {
  if (!stats) return "";
  const parts = [], t = stats.timings;
  if (t) {
    parts.push(`${t.predicted_n} tokens`, `${(t.predicted_per_second || 0).toFixed(1)} tokens/s`);
    const acc = t.draft_n ? (100 * t.draft_n_accepted / t.draft_n).toFixed(0) + "%" : "n/a";
    parts.push(`acceptance ${acc} (${t.draft_n_accepted}/${t.draft_n} drafts)`, `TTFT ${(t.ttft_ms || 0).toFixed(0)} ms`);
  }
  if (stats.stopped) parts.push("stopped");
  if (stats.error) parts.push("error: " + stats.error);
  return parts.join(" · ");
}

function button(cls, label, title) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = label;
  if (title) b.title = title;
  return b;
}

/** Fill a reply's bubble: its text (markdown, or plain for a text completion) or, in the token
 * view, its coloured tokens and the speculation panel; then its figures. */
export function fillReply(div, msg) {
  const text = div.querySelector(".text");
  const tokenView = div.dataset.view === "tokens" && msg.tokens && msg.tokens.length;
  text.className = "text";
  if (tokenView) renderTokens(text, msg.tokens);
  else if (msg.mode === "completion") { text.textContent = msg.content; text.classList.add("plain"); }
  else text.innerHTML = renderMarkdown(msg.content);
  const old = div.querySelector(".spec-panel");
  if (old) old.remove();
  if (tokenView) text.after(specPanel(msg.tokens));
  div.querySelector(".stats").textContent = statsText(msg.stats);
  div.querySelector(".toggle-tokens").hidden = !(msg.tokens && msg.tokens.length);
  div.querySelector(".toggle-tokens").textContent = tokenView ? "text" : "tokens";
}

/** A message's bubble. `index` is its place in the conversation (data-index); `tokenView` the
 * page's default view for replies. */
export function messageEl(msg, index, tokenView) {
  const div = document.createElement("div");
  div.dataset.index = String(index);
  const text = document.createElement("div");
  text.className = "text";
  div.appendChild(text);
  const tools = document.createElement("div");
  tools.className = "tools";
  if (msg.role === "assistant") {
    div.className = "msg assistant";
    div.dataset.view = tokenView ? "tokens" : "text";
    const stats = document.createElement("span");
    stats.className = "stats";
    div.appendChild(stats);
    tools.append(button("copy-msg", "copy", "Copy this reply"), button("regen", "regenerate", "Generate this reply again"),
                 button("toggle-tokens", "tokens", "Colour the tokens by where they came from"));
    div.appendChild(tools);
    if (!msg.streaming) div.dataset.done = "1";
    fillReply(div, msg);
  } else {
    div.className = "msg user" + (msg.mode === "completion" ? " prompt" : "");
    text.textContent = msg.content;
    if (msg.images && msg.images.length) {  // the images the message carried, above its text
      const imgs = document.createElement("div");
      imgs.className = "images";
      for (const url of msg.images) imgs.appendChild(thumb(url));
      div.insertBefore(imgs, text);
    }
    if (msg.imagesDropped) {
      const note = document.createElement("div");
      note.className = "muted";
      note.textContent = `(${msg.imagesDropped} image(s) removed to fit the browser's storage)`;
      div.insertBefore(note, text);
    }
    tools.append(button("edit", "edit", "Edit this message and generate again"), button("copy-msg", "copy", "Copy"));
    div.appendChild(tools);
  }
  return div;
}

/** Replace a user message's text by an editor; `onSave(text)` or `onCancel()` ends it. */
export function editMessage(div, content, onSave, onCancel) {
  div.classList.add("editing");
  const text = div.querySelector(".text"), tools = div.querySelector(".tools");
  text.textContent = "";
  tools.hidden = true;
  const ta = document.createElement("textarea");
  ta.className = "edit-box";
  ta.value = content;
  const save = button("save-edit", "Save & send"), cancel = button("cancel-edit secondary", "Cancel");
  const row = document.createElement("div");
  row.className = "tools";
  row.append(save, cancel);
  text.append(ta, row);
  ta.focus();
  save.addEventListener("click", () => { if (ta.value.trim()) onSave(ta.value); });
  cancel.addEventListener("click", onCancel);
}
