// Talking to gemmaspec serve: request bodies built from the settings, and the server-sent events of
// a streamed reply. Only fields the server documents are sent (docs/server.md): samplers, seed,
// max tokens, speculative.n_max (0 turns drafting off for the request), return_provenance (where
// each token came from) and timings_per_token (so a stopped reply still has its figures). A user
// message's images (data URLs) go as OpenAI image_url parts before its text, or on /completion as
// llama-server's multimodal_data with a <__media__> marker each, before the text.

/** Request headers, with the API key when one is set. */
export function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey && apiKey.trim()) h["Authorization"] = "Bearer " + apiKey.trim();
  return h;
}

function num(v, parse) {
  if (v === undefined || v === null || String(v).trim() === "") return undefined;
  const n = parse(String(v));
  return Number.isFinite(n) ? n : undefined;
}

/** The fields every generation request shares: samplers, seed, speculation, streaming. */
export function commonFields(s) {
  const out = { stream: true, return_provenance: true, timings_per_token: true };
  const fields = { temperature: num(s.temperature, parseFloat), top_k: num(s.top_k, (x) => parseInt(x, 10)),
                   top_p: num(s.top_p, parseFloat), min_p: num(s.min_p, parseFloat),
                   seed: num(s.seed, (x) => parseInt(x, 10)) };
  for (const [k, v] of Object.entries(fields)) if (v !== undefined) out[k] = v;
  if (s.spec === "off") out["speculative.n_max"] = 0;
  else if (s.n_max === "auto") out["speculative.n_max"] = "auto";
  else if (num(s.n_max, (x) => parseInt(x, 10)) !== undefined) out["speculative.n_max"] = parseInt(s.n_max, 10);
  return out;
}

/** A /v1/chat/completions body: the system prompt (if any), then the conversation. */
export function chatBody(s, messages) {
  const msgs = [];
  if (s.system && s.system.trim()) msgs.push({ role: "system", content: s.system });
  for (const m of messages) {
    const role = m.role === "assistant" ? "assistant" : "user";
    if (role === "user" && m.images && m.images.length) {
      const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
      msgs.push({ role, content: [...parts, { type: "text", text: m.content }] });
    } else msgs.push({ role, content: m.content });
  }
  const body = { messages: msgs, ...commonFields(s) };
  const n = num(s.max_tokens, (x) => parseInt(x, 10));
  if (n !== undefined) body.max_tokens = n;
  return body;
}

/** A /completion body (llama-server's native endpoint): the prompt as text; with images (data URLs)
 * llama-server's prompt object, a <__media__> marker per image before the text. */
export function completionBody(s, prompt, images) {
  const body = { prompt, ...commonFields(s) };
  if (images && images.length) {
    body.prompt = { prompt_string: "<__media__>".repeat(images.length) + prompt,
                    multimodal_data: images.map((u) => u.slice(u.indexOf(",") + 1)) };
  }
  const n = num(s.max_tokens, (x) => parseInt(x, 10));
  if (n !== undefined) body.n_predict = n;
  return body;
}

/** The JSON events of a streamed response, in order (`[DONE]` ends it; an error event throws). */
export async function* events(response) {
  const reader = response.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data || data === "[DONE]") continue;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message || "server error");
      yield ev;
    }
  }
}

/** An HTTP error response's message. */
export async function errorText(r) {
  const j = await r.json().catch(() => ({}));
  return j.error ? j.error.message : `HTTP ${r.status}`;
}

/** One streamed piece of a reply, the same for chat and /completion: its text, its tokens'
 * provenance (or null) and the timings so far (or null). */
export function piece(ev, mode) {
  if (mode === "completion") return { text: ev.content || "", provenance: ev.provenance || null, timings: ev.timings || null };
  const c = ev.choices && ev.choices[0];
  return { text: (c && c.delta && c.delta.content) || "", provenance: (c && c.provenance) || null,
           timings: ev.timings || null };
}
