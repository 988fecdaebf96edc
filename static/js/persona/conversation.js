/**
 * The follow-up conversation under a finished quote: the turns so far (sent as `messages`),
 * and one view per question, which streams its answer like the card streams the quote.
 */

import { BUDGET_EXHAUSTED, prefersReducedMotion, setModel, shareOnFollow } from "./dom.js";

const BUDGET_NOTE = "Today’s budget for new answers from this model is spent: they return tomorrow (UTC).";

export function createConversation(page) {
  const { doc, el, config } = page;
  /** The conversation so far: the quote, then questions and answers. */
  let turns = [];

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
          shareOnFollow(link, config, meta.id);
          footer.append(" · ", link);
        }
        footer.hidden = false;
        turns = [...pending, { role: "assistant", content: textEl.textContent }];
        set("done");
        el.question.value = "";
      },
      fail(error) {
        thinking.remove();
        const budget = error.code === BUDGET_EXHAUSTED;
        footer.textContent = budget ? BUDGET_NOTE : error.message;
        if (!budget) footer.classList.add("turn__meta--error");
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

  return {
    /** A new quote is on its way: the old conversation goes. */
    reset() {
      el.followup.hidden = true;
      el.conversation.replaceChildren();
      turns = [];
    },
    /** The quote is finished: it opens the conversation. */
    open(quote) {
      turns = [{ role: "assistant", content: quote }];
      el.followup.hidden = false;
    },
    /** The view for the question being asked, or null when there is nothing to ask about. */
    ask(question) {
      if (!question || !turns.length) return null;
      return answerView(question);
    },
  };
}
