// Images attached to a message (shown only when /props says the server has a vision tower): each
// file, pasted or dropped image is decoded by the browser and kept as one downscaled copy, a JPEG
// data URL at most MAX_SIDE pixels on its longest side. That copy is what is sent (as an OpenAI
// image_url part, or as /completion's multimodal_data) and what the conversation keeps in
// localStorage, so a reloaded conversation sends the same image again.

/** Longest side of the kept copy: Gemma 3's vision tower reads 896 x 896 pixels, so more is never used. */
export const MAX_SIDE = 896;
const QUALITY = 0.85;

/** A data URL the page made itself (`data:image/...;base64,`); anything else is not shown or sent. */
export function isImageUrl(u) {
  return typeof u === "string" && /^data:image\/(jpeg|png|webp|gif|bmp);base64,[A-Za-z0-9+/=]+$/.test(u);
}

/** A File or Blob holding an image → its downscaled JPEG data URL (a white background under any
 * transparency). Rejects with a message naming the file when the browser cannot decode it. */
export async function downscale(file) {
  const url = URL.createObjectURL(file);
  try {
    const img = await new Promise((resolve, reject) => {
      const im = new Image();
      im.onload = () => resolve(im);
      im.onerror = () => reject(new Error(`${file.name || "the image"}: not an image the browser can read`));
      im.src = url;
    });
    const scale = Math.min(1, MAX_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
    const w = Math.max(1, Math.round(img.naturalWidth * scale)), h = Math.max(1, Math.round(img.naturalHeight * scale));
    const canvas = document.createElement("canvas");
    canvas.width = w;
    canvas.height = h;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, w, h);
    ctx.drawImage(img, 0, 0, w, h);
    return canvas.toDataURL("image/jpeg", QUALITY);
  } finally {
    URL.revokeObjectURL(url);
  }
}

/** The image files among a DataTransfer's (paste, drop) or a file input's files. */
export function imageFiles(files) {
  return Array.from(files || []).filter((f) => f.type && f.type.startsWith("image/"));
}

/** A thumbnail element for a data URL; with `onRemove`, a ✕ button that calls it. */
export function thumb(url, onRemove) {
  const box = document.createElement("span");
  box.className = "thumb";
  const img = document.createElement("img");
  img.alt = "attached image";
  if (isImageUrl(url)) img.src = url;
  box.appendChild(img);
  if (onRemove) {
    const x = document.createElement("button");
    x.type = "button";
    x.className = "remove-image";
    x.title = "Remove this image";
    x.textContent = "✕";
    x.addEventListener("click", onRemove);
    box.appendChild(x);
  }
  return box;
}
