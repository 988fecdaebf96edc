/**
 * The persona page: a quote starts at once, streams in, and ends on a card with copy, permalink
 * and feedback; a follow-up box then asks the persona questions about it.
 *
 * The parts live in ./persona/: the card (card.js), the follow-up conversation
 * (conversation.js), and a request's life over htmx or fetch (transport.js). This module reads
 * the page's configuration (the form's data attributes: URLs come from the template) and wires
 * the forms and buttons. Two transports drive the same card (the form's `data-transport`):
 * "htmx" by default, "fetch" with `?transport=fetch`.
 *
 * No inline script and no eval (the page runs under a strict CSP): every listener is here.
 */

import { createCard, wireActions } from "./persona/card.js";
import { createConversation } from "./persona/conversation.js";
import { createRequests } from "./persona/transport.js";

const TESTIDS = {
  generate: "generate",
  stop: "stop",
  placeholder: "placeholder",
  loading: "loading",
  quote: "quote",
  quoteText: "quote-text",
  stopped: "stopped",
  credit: "credit",
  modelLink: "model-link",
  modelNoteLink: "model-note-link",
  creditPersona: "credit-persona",
  cacheNote: "cache-note",
  error: "error",
  errorMessage: "error-message",
  retryAfter: "retry-after",
  retry: "retry",
  budgetNote: "budget-note",
  budgetLocal: "budget-local",
  actions: "quote-actions",
  copy: "copy",
  permalink: "permalink",
  actionStatus: "action-status",
  followup: "followup",
  conversation: "conversation",
  followupForm: "followup-form",
  question: "question",
  ask: "ask",
};

export function mountPersonaPage(form) {
  const doc = form.ownerDocument;
  const find = (testid) => doc.querySelector(`[data-testid="${testid}"]`);
  const el = Object.fromEntries(Object.entries(TESTIDS).map(([key, testid]) => [key, find(testid)]));
  el.feedback = [find("feedback-up"), find("feedback-down")];
  const data = form.dataset;
  const page = {
    doc,
    el,
    form,
    cardEl: doc.getElementById(data.card || "quote-card"),
    /** The card's view and the conversation (created below; they refer to each other). */
    card: null,
    conversation: null,
    config: {
      transport: data.transport === "fetch" ? "fetch" : "htmx",
      streamUrl: data.streamUrl,
      permalinkUrl: data.permalinkUrl,
      feedbackUrl: data.feedbackUrl,
      shareUrl: data.shareUrl,
      stopUrl: data.stopUrl,
      csrfToken: form.querySelector("[name=csrfmiddlewaretoken]")?.value ?? "",
      persona: data.persona,
      personaName: data.personaName || "",
      modelName: data.modelName || "",
      modelUrl: data.modelUrl || "",
    },
    /** The finished quote's public id (for feedback), and whether one has been shown. */
    quoteId: null,
    shownQuote: false,
  };
  page.conversation = createConversation(page);
  page.card = createCard(page);
  const { config } = page;
  const requests = createRequests(page);
  const topicInput = form.querySelector("[name='topic']");
  let lastTopic = "";
  let lastFresh = false;
  let pendingRetry = false;

  function quoteParams(topic, fresh) {
    lastTopic = topic;
    lastFresh = fresh;
    const body = { persona: config.persona };
    if (topic) body.topic = topic;
    if (fresh) body.fresh = true;
    return body;
  }

  function nextQuote(retry) {
    const topic = retry ? lastTopic : topicInput.value.trim();
    return quoteParams(topic, retry ? lastFresh : page.shownQuote && topic === lastTopic);
  }

  function startQuote({ retry = false } = {}) {
    if (requests.busy()) return;
    if (config.transport === "htmx") {
      // hx-post does the request; htmx:config:request fills in the fields.
      pendingRetry = retry;
      form.requestSubmit();
      return;
    }
    requests.runFetch(page.card, nextQuote(retry), form);
  }

  if (config.transport === "htmx") {
    requests.wireHtmx(form, (body) => {
      const params = nextQuote(pendingRetry);
      pendingRetry = false;
      body.set("topic", params.topic ?? "");
      if (params.fresh) body.set("fresh", "1");
      else body.delete("fresh");
      return page.card;
    });
    requests.wireHtmx(el.followupForm, (body) => {
      const view = page.conversation.ask(el.question.value.trim());
      if (!view) return null;
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
      if (requests.busy()) return;
      const view = page.conversation.ask(el.question.value.trim());
      if (!view) return;
      requests.runFetch(view, { ...quoteParams(lastTopic, false), messages: view.messages }, el.followupForm);
    });
  }

  el.stop.addEventListener("click", requests.stop);
  el.retry.addEventListener("click", () => startQuote({ retry: true }));
  doc.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && requests.busy()) requests.stop();
  });
  wireActions(page);

  page.card.setState("idle");
  form.dataset.ready = "true";
  // The page starts its quote at once (a refresh replays the cached one). With htmx, once htmx
  // has wired the form: this module may run before or after htmx initialises.
  if (config.transport === "fetch" || form.hasAttribute("data-htmx-powered")) {
    startQuote();
  } else {
    form.addEventListener("htmx:after:init", () => startQuote(), { once: true });
  }
  return { start: startQuote, stop: requests.stop };
}

if (typeof document !== "undefined") {
  const form = document.querySelector("form[data-quote-page]");
  if (form) mountPersonaPage(form);
}
