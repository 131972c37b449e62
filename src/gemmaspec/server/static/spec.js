// Showing the speculation: each reply's tokens coloured by where they came from (the server's
// `return_provenance`: an accepted draft of the MTP assistant, of n-gram lookup or of a draft model,
// or the target model's own token), the drafts the target rejected on hover, and acceptance by
// draft position.
//
// A reply keeps its tokens as compact entries [text, source, pos, drafted, rejected, drafter], one per
// streamed token (text may be "" while the server holds it back; source null for text without a
// token, such as a tail released at the end).

export const SOURCES = {
  "draft-mtp": "MTP assistant (accepted draft)",
  "ngram-simple": "n-gram lookup (accepted draft)",
  "draft-simple": "draft model (accepted draft)",
  "target": "target model (its own token)",
};

/** Token entries for one streamed piece: its text goes with its last token. */
export function entriesOf(text, provenance) {
  if (!provenance || provenance.length === 0) return text ? [[text, null, 0, 0, null, null]] : [];
  return provenance.map((p, i) => [i === provenance.length - 1 ? text : "", p.source, p.pos, p.drafted,
                                   p.rejected && p.rejected.length ? p.rejected : null, p.drafter || null]);
}

/** Per source, how many tokens. */
export function countBySource(tokens) {
  const out = {};
  for (const [, src] of tokens) if (src) out[src] = (out[src] || 0) + 1;
  return out;
}

/** Acceptance by draft position: `drafted[i]` rounds drafted a token at position i, `accepted[i]`
 * of them kept it. Read from the target's token of each round with drafts (its pos = drafts accepted). */
export function positionStats(tokens) {
  const drafted = [], accepted = [];
  for (const [, src, pos, n] of tokens) {
    if (src !== "target" || !n) continue;
    for (let i = 0; i < n; i++) {
      drafted[i] = (drafted[i] || 0) + 1;
      accepted[i] = (accepted[i] || 0) + (i < pos ? 1 : 0);
    }
  }
  return { drafted, accepted };
}

function describe(src, pos, drafted, rejected, drafter) {
  if (src === "target") {
    if (rejected) return `target model: replaced ${drafter || "the drafter"}'s rejected draft ` +
                         rejected.map((t) => JSON.stringify(t)).join(" ") + ` (at draft position ${pos + 1})`;
    if (drafted) return `target model: bonus token after all ${drafted} drafts were accepted`;
    return "target model";
  }
  if (!src) return "text held back until the end";
  return `${SOURCES[src] || src}, draft position ${pos + 1} of ${drafted}`;
}

/** Fill `el` with one span per token, coloured by source (data-source), rejected drafts in the title. */
export function renderTokens(el, tokens) {
  el.textContent = "";
  el.classList.add("tokens");
  const frag = document.createDocumentFragment();
  for (const [text, src, pos, drafted, rejected, drafter] of tokens) {
    const span = document.createElement("span");
    span.className = "tok" + (rejected ? " after-reject" : "");
    if (src) span.dataset.source = src;
    span.title = describe(src, pos, drafted, rejected, drafter);
    if (rejected) span.dataset.rejected = JSON.stringify(rejected);
    span.textContent = text;
    frag.appendChild(span);
  }
  el.appendChild(frag);
}

/** The per-reply panel: a legend with each source's token count and acceptance by draft position. */
export function specPanel(tokens) {
  const panel = document.createElement("div");
  panel.className = "spec-panel";
  const legend = document.createElement("div");
  legend.className = "legend";
  const counts = countBySource(tokens);
  for (const [src, label] of Object.entries(SOURCES)) {
    if (!counts[src] && src === "draft-simple") continue;
    const item = document.createElement("span");
    item.dataset.legend = src;
    item.innerHTML = `<span class="swatch" data-source="${src}"></span>`;
    item.append(`${label}: ${counts[src] || 0}`);
    legend.appendChild(item);
  }
  panel.appendChild(legend);
  const { drafted, accepted } = positionStats(tokens);
  if (drafted.length) {
    const grid = document.createElement("div");
    grid.className = "positions";
    grid.setAttribute("aria-label", "acceptance by draft position");
    for (let i = 0; i < drafted.length; i++) {
      const rate = drafted[i] ? accepted[i] / drafted[i] : 0;
      const label = document.createElement("span");
      label.textContent = `draft ${i + 1}`;
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.innerHTML = `<span style="width:${(100 * rate).toFixed(0)}%"></span>`;
      const val = document.createElement("span");
      val.className = "pos-value";
      val.dataset.pos = String(i);
      val.textContent = `${accepted[i]}/${drafted[i]} (${(100 * rate).toFixed(0)}%)`;
      grid.append(label, bar, val);
    }
    panel.appendChild(grid);
  }
  return panel;
}
