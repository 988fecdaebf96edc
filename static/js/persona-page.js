/**
 * The persona page: a quote starts at once, streams in, and ends on a card with copy, permalink
 * and feedback; a follow-up box then asks the persona questions about it.
 *
 * Two transports drive the same card (chosen by the form's `data-transport`):
 *   - "htmx" (the default): the forms carry `hx-post` and hx-sse appends each HTML-escaped text
 *     fragment to the target; the named events `meta`, `done` and `error` arrive here as DOM
 *     events on the form. This module only keeps the card's state, and adds the conversation
 *     (`messages`) and `fresh` to the request in `htmx:config:request`.
 *   - "fetch": `streamQuote` from quote-stream.js reads the JSON stream (`?transport=fetch`).
 *
 * No inline script and no eval (the page runs under a strict CSP): every listener is here.
 */

import { QuoteStreamError, streamQuote } from "./quote-stream.js";

const STATES = ["idle", "loading", "streaming", "done", "error", "stopped"];
const LOST = "The connection was lost before the quote was finished.";

function prefersReducedMotion() {
  return window.matchMedia?.("(prefers-reduced-motion: reduce)").matches ?? false;
}

function parseJSON(text) {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

function csrfToken(form) {
  return form.querySelector("[name=csrfmiddlewaretoken]")?.value ?? "";
}

export function mountPersonaPage(form) {
  const doc = form.ownerDocument;
  const find = (testid) => doc.querySelector(`[data-testid="${testid}"]`);
  const card = doc.getElementById(form.dataset.card || "quote-card");
  const topicInput = form.querySelector("[name='topic']");
  const el = {
    generate: find("generate"),
    stop: find("stop"),
    placeholder: find("placeholder"),
    loading: find("loading"),
    quote: find("quote"),
    quoteText: find("quote-text"),
    stopped: find("stopped"),
    credit: find("credit"),
    modelLink: find("model-link"),
    modelNoteLink: find("model-note-link"),
    creditPersona: find("credit-persona"),
    cacheNote: find("cache-note"),
    error: find("error"),
    errorMessage: find("error-message"),
    retryAfter: find("retry-after"),
    retry: find("retry"),
    actions: find("quote-actions"),
    copy: find("copy"),
    permalink: find("permalink"),
    feedback: [find("feedback-up"), find("feedback-down")],
    actionStatus: find("action-status"),
    followup: find("followup"),
    conversation: find("conversation"),
    followupForm: find("followup-form"),
    question: find("question"),
    ask: find("ask"),
  };
  const config = {
    transport: form.dataset.transport === "fetch" ? "fetch" : "htmx",
    url: form.dataset.streamUrl,
    persona: form.dataset.persona,
    personaName: form.dataset.personaName || "",
    modelName: form.dataset.modelName || "",
    modelUrl: form.dataset.modelUrl || "",
  };

  /** The request in flight: {view, form, controller?, terminal, stopped}. */
  let active = null;
  let countdownTimer = null;
  let lastTopic = "";
  let lastFresh = false;
  let shownQuote = false;
  /** The conversation so far: the quote, then questions and answers. */
  let turns = [];
  let quoteId = null;

  /* --- the main quote card ----------------------------------------------------------------- */

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

  function showError(message, { retry = true, retryAfter = null } = {}) {
    el.errorMessage.textContent = message;
    el.error.hidden = false;
    el.retry.hidden = !retry;
    clearCountdown();
    if (retryAfter && retryAfter > 0) {
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

  function setBusy(busy) {
    const hadFocus = doc.activeElement === (busy ? el.generate : el.stop);
    el.generate.disabled = busy || countdownTimer !== null;
    el.ask.disabled = busy;
    el.stop.hidden = !busy;
    form.setAttribute("aria-busy", String(busy));
    if (hadFocus) (busy ? el.stop : el.generate).focus();
  }

  function setModel(model, modelUrl, links) {
    for (const link of links) {
      if (!link) continue;
      link.textContent = model || "the model";
      if (modelUrl) link.href = modelUrl;
      else link.removeAttribute("href");
    }
  }

  /** Whitespace a model opens with stays in the text (it must match the log) but hidden. */
  function splitLead(textEl, token) {
    if (textEl.textContent.trim()) return token;
    const lead = /^\s*/.exec(token)[0];
    if (lead) {
      let span = textEl.querySelector(".quote__lead");
      if (!span) {
        span = doc.createElement("span");
        span.className = "quote__lead";
        span.hidden = true;
        textEl.append(span);
      }
      span.append(lead);
    }
    return token.slice(lead.length);
  }

  const quoteView = {
    textEl: el.quoteText,
    begin() {
      clearCountdown();
      el.quoteText.replaceChildren();
      el.error.hidden = true;
      el.errorMessage.textContent = "";
      el.retry.hidden = true;
      el.stopped.hidden = true;
      el.credit.hidden = true;
      el.actions.hidden = true;
      el.quote.hidden = true;
      el.placeholder.hidden = true;
      el.followup.hidden = true;
      el.conversation.replaceChildren();
      el.actionStatus.textContent = "";
      for (const button of el.feedback) button.setAttribute("aria-pressed", "false");
      turns = [];
      quoteId = null;
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
      quoteId = meta.id || null;
      if (meta.permalink) {
        el.permalink.href = meta.permalink;
        el.permalink.hidden = false;
      } else {
        el.permalink.hidden = true;
      }
      el.actions.hidden = false;
      el.generate.textContent = "Another quote";
      shownQuote = true;
      turns = [{ role: "assistant", content: el.quoteText.textContent }];
      el.followup.hidden = false;
      setState("done");
    },
    fail(error) {
      el.loading.hidden = true;
      if (!el.quoteText.textContent.trim()) el.quote.hidden = true;
      setState("error");
      showError(error.message, { retryAfter: error.retryAfter });
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

  /* --- follow-up answers ------------------------------------------------------------------- */

  function answerView(question) {
    const item = doc.createElement("li");
    item.className = "turn turn--question";
    item.dataset.testid = "asked";
    item.textContent = question;
    const answer = doc.createElement("li");
    answer.className = "turn turn--answer";
    answer.dataset.testid = "answer";
    answer.dataset.state = "loading";
    answer.setAttribute("aria-busy", "true");
    const body = doc.createElement("p");
    body.className = "turn__body";
    const textEl = doc.createElement("span");
    textEl.className = "turn__text";
    textEl.dataset.testid = "answer-text";
    const caret = doc.createElement("span");
    caret.className = "quote__caret";
    caret.setAttribute("aria-hidden", "true");
    const thinking = doc.createElement("span");
    thinking.className = "turn__thinking";
    thinking.textContent = `${config.personaName} is thinking…`;
    body.append(thinking, textEl, caret);
    const footer = doc.createElement("p");
    footer.className = "turn__meta";
    footer.hidden = true;
    answer.append(body, footer);
    el.conversation.append(item, answer);
    const set = (state) => {
      answer.dataset.state = state;
      answer.setAttribute("aria-busy", String(state === "loading" || state === "streaming"));
    };
    const pending = [...turns, { role: "user", content: question }];
    return {
      textEl,
      messages: pending,
      meta: {},
      begin() {
        set("loading");
        answer.scrollIntoView({ block: "nearest", behavior: prefersReducedMotion() ? "auto" : "smooth" });
      },
      started() {
        return answer.dataset.state === "streaming";
      },
      firstText() {
        thinking.remove();
        set("streaming");
      },
      done(info) {
        thinking.remove();
        const meta = { ...this.meta, ...info };
        textEl.normalize();
        footer.replaceChildren();
        const model = doc.createElement("a");
        setModel(meta.model || config.modelName, meta.model_url || config.modelUrl, [model]);
        model.rel = "noopener";
        footer.append("— ", model, ` as ${config.personaName}`);
        if (meta.permalink) {
          const link = doc.createElement("a");
          link.href = meta.permalink;
          link.textContent = "Permalink";
          link.dataset.testid = "answer-permalink";
          footer.append(" · ", link);
        }
        footer.hidden = false;
        turns = [...pending, { role: "assistant", content: textEl.textContent }];
        set("done");
        el.question.value = "";
      },
      fail(error) {
        thinking.remove();
        footer.textContent = error.message;
        footer.classList.add("turn__meta--error");
        footer.hidden = false;
        set("error");
        if (!textEl.textContent.trim()) answer.classList.add("turn--empty");
      },
      stop() {
        thinking.remove();
        footer.textContent = "Stopped";
        footer.hidden = false;
        set("stopped");
      },
    };
  }

  /* --- a request's life, whichever transport ----------------------------------------------- */

  function begin(view, sourceForm) {
    active = { view, form: sourceForm, terminal: false, stopped: false };
    view.begin();
    setBusy(true);
    return active;
  }

  function finish(run) {
    if (active === run) {
      active = null;
      setBusy(false);
    }
  }

  function onText(run) {
    if (!run.view.started() && run.view.textEl.textContent.trim()) run.view.firstText();
  }

  function onDone(run, info) {
    if (run.terminal) return;
    run.terminal = true;
    run.view.done(info);
    finish(run);
  }

  function onFail(run, error) {
    if (run.terminal) return;
    run.terminal = true;
    run.view.fail(error);
    finish(run);
  }

  function stopStreaming() {
    const run = active;
    if (!run) return;
    run.stopped = true;
    run.terminal = true;
    if (config.transport === "htmx") {
      window.htmx.trigger(run.form, "htmx:abort");
    } else {
      run.controller?.abort();
    }
    run.view.stop();
    finish(run);
  }

  function errorOf(payload, fallback) {
    return {
      code: payload?.code || "error",
      message: payload?.message || fallback,
      retryAfter: payload?.retry_after ?? null,
    };
  }

  /* --- htmx -------------------------------------------------------------------------------- */

  function wireHtmx(sourceForm, makeView) {
    let run = null;
    sourceForm.addEventListener("htmx:config:request", (event) => {
      const { ctx } = event.detail;
      if (active) {
        event.preventDefault();
        return;
      }
      const view = makeView(ctx.request.body);
      if (!view) {
        event.preventDefault();
        return;
      }
      if (view !== quoteView) ctx.target = view.textEl;
      run = begin(view, sourceForm);
      run.ctx = ctx;
    });
    sourceForm.addEventListener("htmx:sse:before:message", (event) => {
      const message = event.detail.message;
      if (!run || run.stopped || message.event) return;
      // Leading whitespace goes into a hidden span (hx-swap would show it): see splitLead.
      if (!run.view.textEl.textContent.trim()) {
        const lead = /^\s*/.exec(message.data)[0]; // whitespace is the same escaped or not
        if (lead) message.data = splitLead(run.view.textEl, lead) + message.data.slice(lead.length);
      }
    });
    sourceForm.addEventListener("htmx:sse:after:message", (event) => {
      if (run && !run.stopped && !event.detail.message.event) onText(run);
    });
    sourceForm.addEventListener("meta", (event) => {
      if (!run) return;
      run.view.meta = { ...run.view.meta, ...(parseJSON(event.detail?.data) || {}) };
    });
    sourceForm.addEventListener("done", (event) => {
      if (run) onDone(run, parseJSON(event.detail?.data) || {});
    });
    sourceForm.addEventListener("error", (event) => {
      if (!run || !event.detail) return;
      onFail(run, errorOf(parseJSON(event.detail.data), "The model stopped with an error."));
    });
    sourceForm.addEventListener("htmx:after:request", (event) => {
      // Not a stream (a proxy's error page, say): never swap it into the quote.
      event.preventDefault();
      const status = event.detail.ctx?.response?.status;
      if (run?.ctx === event.detail.ctx) {
        onFail(run, errorOf(null, `The server could not write a quote (HTTP ${status}).`));
      }
    });
    sourceForm.addEventListener("htmx:error", () => {
      if (run && !run.stopped) {
        onFail(run, errorOf(null, "Could not reach the server. Check your connection and try again."));
      }
    });
    sourceForm.addEventListener("htmx:finally:request", (event) => {
      // A stopped request ends after the next one began: only the current one counts.
      if (!run || run.ctx !== event.detail.ctx) return;
      if (!run.terminal) onFail(run, errorOf(null, LOST));
      run = null;
    });
  }

  /* --- fetch ------------------------------------------------------------------------------- */

  async function runFetch(view, body, sourceForm) {
    const run = begin(view, sourceForm);
    run.controller = new AbortController();
    const { signal } = run.controller;
    try {
      const result = await streamQuote({
        url: config.url,
        body,
        signal,
        onOpen({ model, modelUrl, response }) {
          const id = response.headers.get("X-Quote-Id");
          view.meta = {
            model,
            model_url: modelUrl,
            cache_status: response.headers.get("cf-aig-cache-status") || "",
            id,
            permalink: id ? `/q/${id}/` : null,
          };
        },
        onToken(token) {
          if (run.stopped) return;
          const text = splitLead(view.textEl, token);
          if (text) view.textEl.append(text);
          onText(run);
        },
      });
      if (!run.stopped) onDone(run, { usage: result.usage });
    } catch (error) {
      if (run.stopped || error?.name === "AbortError") return;
      if (error instanceof QuoteStreamError) {
        onFail(run, { code: error.code, message: error.message, retryAfter: error.retryAfter });
      } else {
        console.error(error);
        onFail(run, errorOf(null, "Something went wrong while writing the quote."));
      }
    }
  }

  /* --- requests ---------------------------------------------------------------------------- */

  function quoteParams(topic, fresh) {
    lastTopic = topic;
    lastFresh = fresh;
    const body = { persona: config.persona };
    if (topic) body.topic = topic;
    if (fresh) body.fresh = true;
    return body;
  }

  function startQuote({ retry = false } = {}) {
    if (active) return;
    const topic = retry ? lastTopic : topicInput.value.trim();
    const fresh = retry ? lastFresh : shownQuote && topic === lastTopic;
    if (config.transport === "htmx") {
      // hx-post does the request; htmx:config:request below fills in the fields.
      pendingRetry = retry;
      form.requestSubmit();
      return;
    }
    runFetch(quoteView, quoteParams(topic, fresh), form);
  }

  function askQuestion() {
    const question = el.question.value.trim();
    if (active || !question || !turns.length) return;
    const view = answerView(question);
    runFetch(view, { ...quoteParams(lastTopic, false), messages: view.messages }, el.followupForm);
  }

  let pendingRetry = false;

  if (config.transport === "htmx") {
    wireHtmx(form, (body) => {
      const retry = pendingRetry;
      pendingRetry = false;
      const topic = retry ? lastTopic : topicInput.value.trim();
      const fresh = retry ? lastFresh : shownQuote && topic === lastTopic;
      const params = quoteParams(topic, fresh);
      body.set("topic", params.topic ?? "");
      if (params.fresh) body.set("fresh", "1");
      else body.delete("fresh");
      return quoteView;
    });
    wireHtmx(el.followupForm, (body) => {
      const question = el.question.value.trim();
      if (!question || !turns.length) return null;
      const view = answerView(question);
      body.delete("question");
      if (lastTopic) body.set("topic", lastTopic);
      body.set("messages", JSON.stringify(view.messages));
      return view;
    });
  } else {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!el.generate.disabled) startQuote();
    });
    el.followupForm.addEventListener("submit", (event) => {
      event.preventDefault();
      askQuestion();
    });
  }

  el.stop.addEventListener("click", stopStreaming);
  el.retry.addEventListener("click", () => startQuote({ retry: true }));
  doc.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && active) stopStreaming();
  });

  /* --- copy and feedback ------------------------------------------------------------------- */

  function say(message) {
    el.actionStatus.textContent = message;
  }

  el.copy.addEventListener("click", async () => {
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
      if (!quoteId) return;
      const value = Number(button.dataset.value);
      try {
        const response = await fetch(`/api/quotes/${quoteId}/feedback`, {
          method: "POST",
          headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken(form) },
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

  setState("idle");
  form.dataset.ready = "true";
  // The page starts its quote at once (a refresh replays the cached one). With htmx, once htmx
  // has wired the form: this module may run before or after htmx initialises.
  if (config.transport === "fetch") {
    startQuote();
  } else if (form.hasAttribute("data-htmx-powered")) {
    startQuote();
  } else {
    form.addEventListener("htmx:after:init", () => startQuote(), { once: true });
  }
  return { start: startQuote, stop: stopStreaming };
}

if (typeof document !== "undefined") {
  const form = document.querySelector("form[data-quote-page]");
  if (form) mountPersonaPage(form);
}
