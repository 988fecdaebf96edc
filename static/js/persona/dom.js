/** Small helpers the persona page's modules share. */

export function prefersReducedMotion() {
  return window.matchMedia?.("(prefers-reduced-motion: reduce)").matches ?? false;
}

export function parseJSON(text) {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

/** Point each link at the model's documentation (or at nothing, when it has none). */
export function setModel(model, modelUrl, links) {
  for (const link of links) {
    if (!link) continue;
    link.textContent = model || "the model";
    if (modelUrl) link.href = modelUrl;
    else link.removeAttribute("href");
  }
}

/** Whitespace a model opens with stays in the text (it must match the log) but hidden. */
export function splitLead(textEl, token) {
  if (textEl.textContent.trim()) return token;
  const lead = /^\s*/.exec(token)[0];
  if (lead) {
    let span = textEl.querySelector(".quote__lead");
    if (!span) {
      span = textEl.ownerDocument.createElement("span");
      span.className = "quote__lead";
      span.hidden = true;
      textEl.append(span);
    }
    span.append(lead);
  }
  return token.slice(lead.length);
}

/** A quote's URL from the template's pattern (a data attribute with `{id}` in it). */
export function urlFor(pattern, id) {
  return pattern.replace("{id}", encodeURIComponent(id));
}
