// Markdown for replies: marked (vendor/marked.esm.js, MIT) with highlight.js's core and a few
// languages (vendor/highlight.*.min.js, BSD-3-Clause). Model output is untrusted: raw HTML in it is
// shown as text, links keep only http(s) and mailto targets, images are not loaded (their text is
// shown), and code blocks get a header with the language and a copy button.
import { Marked } from "./vendor/marked.esm.js";
import hljs from "./vendor/highlight.core.min.js";
import bash from "./vendor/highlight.bash.min.js";
import c from "./vendor/highlight.c.min.js";
import cpp from "./vendor/highlight.cpp.min.js";
import css from "./vendor/highlight.css.min.js";
import diff from "./vendor/highlight.diff.min.js";
import go from "./vendor/highlight.go.min.js";
import java from "./vendor/highlight.java.min.js";
import javascript from "./vendor/highlight.javascript.min.js";
import json from "./vendor/highlight.json.min.js";
import markdown from "./vendor/highlight.markdown.min.js";
import plaintext from "./vendor/highlight.plaintext.min.js";
import python from "./vendor/highlight.python.min.js";
import rust from "./vendor/highlight.rust.min.js";
import sql from "./vendor/highlight.sql.min.js";
import typescript from "./vendor/highlight.typescript.min.js";
import xml from "./vendor/highlight.xml.min.js";
import yaml from "./vendor/highlight.yaml.min.js";

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, plaintext, python, rust, sql,
                    typescript, xml, yaml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** Text made safe to put inside HTML (element content or a quoted attribute). */
export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (ch) => ESC[ch]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

/** Highlighted HTML of `code`: in `lang` when highlight.js knows it, else the language it finds
 * most likely among those loaded (plain escaped text for very short code). */
export function highlight(code, lang) {
  if (lang && hljs.getLanguage(lang)) return { html: hljs.highlight(code, { language: lang }).value, lang };
  if (code.trim().length < 12) return { html: escapeHtml(code), lang: lang || "" };
  const auto = hljs.highlightAuto(code);
  return { html: auto.value, lang: lang || auto.language || "" };
}

const renderer = {
  html({ text }) { return escapeHtml(text); },  // raw HTML from the model: shown, never run
  link({ href, title, tokens }) {
    const label = this.parser.parseInline(tokens);
    if (!SAFE_URL.test(href || "")) return label;
    const t = title ? ` title="${escapeHtml(title)}"` : "";
    return `<a href="${escapeHtml(href)}"${t} target="_blank" rel="noopener noreferrer nofollow">${label}</a>`;
  },
  image({ href, text }) { return escapeHtml(`[image: ${text || href}]`); },  // never fetched
  code({ text, lang }) {
    const name = (lang || "").trim().split(/\s+/)[0].toLowerCase();
    const h = highlight(text, name);
    return `<div class="code"><div class="code-head"><span class="lang">${escapeHtml(h.lang)}</span>` +
           `<button type="button" class="copy-code">copy</button></div>` +
           `<pre><code class="hljs${h.lang ? " language-" + escapeHtml(h.lang) : ""}">${h.html}</code></pre></div>`;
  },
};

const md = new Marked({ gfm: true, breaks: true, renderer });  // a single newline breaks the line, as models write

/** Sanitised HTML of markdown `text`. */
export function renderMarkdown(text) {
  return md.parse(text || "");
}

/** Copy `text` to the clipboard: the Clipboard API where the page may use it (localhost, https),
 * else a hidden textarea and the copy command (http to another machine). Resolves to true when copied. */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try { await navigator.clipboard.writeText(text); return true; } catch (e) { /* fall back */ }
  }
  const ta = document.createElement("textarea");
  ta.value = text;
  ta.style.position = "fixed";
  ta.style.opacity = "0";
  document.body.appendChild(ta);
  ta.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
  ta.remove();
  return ok;
}
