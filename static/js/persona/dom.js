/** Small helpers the persona page's modules share. */

/** The error code of a spent daily budget (503, Retry-After: the seconds to midnight UTC). */
export const BUDGET_EXHAUSTED = "budget_exhausted";
/** A Retry-After longer than this (seconds) is not counted down: a time to come back is given. */
export const LONG_WAIT_S = 600;

/** The next midnight UTC: when a day's spend ceiling starts again. */
export function nextUtcMidnight(now = new Date()) {
  return new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate() + 1));
}

/** "14:05", in the visitor's own time zone and format. */
export function clockTime(date) {
  return date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

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

/**
 * Tell the server this quote was shared (its Permalink or Copy button), so it is kept past the
 * request log's retention; opening a permalink page keeps nothing (a link preview's bot opens
 * them too). `keepalive`: the request goes out even when the click navigates away at once.
 * Nothing to show either way: the link and the copy work whatever the answer.
 */
export function shareQuote(config, id) {
  if (!id || !config.shareUrl) return;
  fetch(urlFor(config.shareUrl, id), {
    method: "POST",
    headers: { "X-CSRFToken": config.csrfToken, Accept: "application/json" },
    credentials: "same-origin",
    keepalive: true,
  }).catch(() => {});
}

/** Share `id` whenever `link` is followed: a click, or a middle click (a new tab). */
export function shareOnFollow(link, config, id) {
  const follow = (event) => {
    if (event.type === "auxclick" && event.button !== 1) return;
    shareQuote(config, typeof id === "function" ? id() : id);
  };
  link.addEventListener("click", follow);
  link.addEventListener("auxclick", follow);
}
