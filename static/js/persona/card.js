/**
 * The main quote card: its states, its error box (with the Retry-After countdown), the calm note
 * for a spent daily budget, and the copy and feedback actions under a finished quote.
 *
 * A short Retry-After (a rate limit, a full or restarting server: seconds) counts down with the
 * Write button disabled. A long one counts nothing down and disables nothing: `budget_exhausted`
 * (the day's spend ceiling for this model, until midnight UTC) gets a note of its own saying
 * new quotes return tomorrow and written ones still work; any other says when to come back.
 *
 * A view (this card, or an answer in conversation.js) is what a request drives: begin,
 * firstText, done, fail, stop; `textEl` is where the text goes and `meta` what is known so far.
 */

import {
  BUDGET_EXHAUSTED,
  LONG_WAIT_S,
  clockTime,
  nextUtcMidnight,
  parseJSON,
  prefersReducedMotion,
  setModel,
  shareOnFollow,
  shareQuote,
  urlFor,
} from "./dom.js";

const STATES = ["idle", "loading", "streaming", "done", "error", "stopped"];

export function createCard(page) {
  const { doc, el, config, cardEl: card } = page;
  let countdownTimer = null;

  function setState(state) {
    if (!STATES.includes(state)) throw new Error(`unknown state ${state}`);
    card.dataset.state = state;
    doc.documentElement.dataset.streamState = state;
    // Screen readers wait for the finished quote instead of reading every token.
    card.setAttribute("aria-busy", String(state === "loading" || state === "streaming"));
  }

  function clearCountdown() {
    if (countdownTimer !== null) {
      clearInterval(countdownTimer);
      countdownTimer = null;
    }
    el.retryAfter.hidden = true;
    el.retryAfter.textContent = "";
  }

  /** Today's budget for this model is spent: say so calmly, with nothing to wait out. */
  function showBudgetNote() {
    clearCountdown();
    const midnight = nextUtcMidnight();
    // In the visitor's own time too, unless that is UTC.
    el.budgetLocal.textContent =
      midnight.getTimezoneOffset() === 0 ? "" : ` (${clockTime(midnight)} your time)`;
    el.budgetNote.hidden = false;
  }

  function showError(message, { retry = true, retryAfter = null } = {}) {
    el.errorMessage.textContent = message;
    el.error.hidden = false;
    el.retry.hidden = !retry;
    clearCountdown();
    if (retryAfter && retryAfter > LONG_WAIT_S) {
      // Hours away: a time to come back at, and the page stays usable meanwhile.
      el.retry.hidden = true;
      el.retryAfter.hidden = false;
      el.retryAfter.textContent = `Try again after ${clockTime(new Date(Date.now() + retryAfter * 1000))}.`;
    } else if (retryAfter && retryAfter > 0) {
      let remaining = Math.ceil(retryAfter);
      el.generate.disabled = true;
      el.retry.hidden = true;
      el.retryAfter.hidden = false;
      const tick = () => {
        el.retryAfter.textContent = `Try again in ${remaining} s`;
      };
      tick();
      countdownTimer = setInterval(() => {
        remaining -= 1;
        if (remaining <= 0) {
          clearCountdown();
          el.generate.disabled = false;
          el.retry.hidden = false;
          return;
        }
        tick();
      }, 1000);
    }
  }

  const view = {
    textEl: el.quoteText,
    meta: {},
    counting: () => countdownTimer !== null,
    setState,
    begin() {
      clearCountdown();
      el.quoteText.replaceChildren();
      el.error.hidden = true;
      el.errorMessage.textContent = "";
      el.budgetNote.hidden = true;
      el.retry.hidden = true;
      el.stopped.hidden = true;
      el.credit.hidden = true;
      el.actions.hidden = true;
      el.quote.hidden = true;
      el.placeholder.hidden = true;
      el.actionStatus.textContent = "";
      for (const button of el.feedback) button.setAttribute("aria-pressed", "false");
      page.conversation.reset();
      page.quoteId = null;
      this.meta = {};
      el.loading.hidden = false;
      setState("loading");
      card.scrollIntoView({ block: "nearest", behavior: prefersReducedMotion() ? "auto" : "smooth" });
    },
    started() {
      return card.dataset.state === "streaming";
    },
    firstText() {
      el.loading.hidden = true;
      el.quote.hidden = false;
      setState("streaming");
    },
    done(info) {
      el.loading.hidden = true;
      if (!el.quoteText.textContent.trim()) {
        setState("error");
        showError("The model did not write anything this time. Please try again.");
        return;
      }
      el.quoteText.normalize();
      const meta = { ...this.meta, ...info };
      setModel(meta.model || config.modelName, meta.model_url || config.modelUrl, [
        el.modelLink,
        el.modelNoteLink,
      ]);
      el.creditPersona.textContent = config.personaName;
      el.cacheNote.hidden = (meta.cache_status || "").toUpperCase() !== "HIT";
      el.credit.hidden = false;
      page.quoteId = meta.id || null;
      if (meta.permalink) {
        el.permalink.href = meta.permalink;
        el.permalink.hidden = false;
      } else {
        el.permalink.hidden = true;
      }
      el.actions.hidden = false;
      el.generate.textContent = "Another quote";
      page.shownQuote = true;
      page.conversation.open(el.quoteText.textContent);
      setState("done");
    },
    fail(error) {
      el.loading.hidden = true;
      if (!el.quoteText.textContent.trim()) el.quote.hidden = true;
      setState("error");
      if (error.code === BUDGET_EXHAUSTED) showBudgetNote();
      else showError(error.message, { retryAfter: error.retryAfter });
      el.generate.textContent = "Write a quote";
    },
    stop() {
      const hadText = el.quoteText.textContent.trim().length > 0;
      el.loading.hidden = true;
      el.quote.hidden = !hadText;
      el.stopped.hidden = false;
      setState("stopped");
      el.generate.textContent = "Write a quote";
    },
  };
  return view;
}

/** Copy, permalink and thumbs up/down under a finished quote. */
export function wireActions(page) {
  const { doc, el, config } = page;
  const say = (message) => {
    el.actionStatus.textContent = message;
  };

  // Copy and Permalink are how a quote gets shared: each tells the server to keep it.
  shareOnFollow(el.permalink, config, () => page.quoteId);
  el.copy.addEventListener("click", async () => {
    shareQuote(config, page.quoteId);
    const text = `“${el.quoteText.textContent.trim()}” — ${config.personaName}`;
    try {
      await navigator.clipboard.writeText(text);
      say("Copied to the clipboard.");
    } catch {
      const selection = doc.getSelection();
      selection?.selectAllChildren(el.quoteText);
      say("Press Ctrl+C (⌘C) to copy the selected quote.");
    }
  });

  for (const button of el.feedback) {
    button.addEventListener("click", async () => {
      if (!page.quoteId) return;
      const value = Number(button.dataset.value);
      try {
        const response = await fetch(urlFor(config.feedbackUrl, page.quoteId), {
          method: "POST",
          headers: { "Content-Type": "application/json", "X-CSRFToken": config.csrfToken },
          body: JSON.stringify({ value }),
          credentials: "same-origin",
        });
        const payload = parseJSON(await response.text());
        if (!response.ok) {
          say(payload?.error?.message || "Your rating could not be saved.");
          return;
        }
        for (const other of el.feedback) other.setAttribute("aria-pressed", String(other === button));
        say(value > 0 ? "Thanks! Glad you liked it." : "Thanks, noted.");
      } catch {
        say("Your rating could not be saved: the connection failed.");
      }
    });
  }
}
