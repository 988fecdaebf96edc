/**
 * A request's life, whichever transport carries it: one request at a time, driving a view (the
 * card, or an answer) from begin to exactly one of done, fail or stop.
 *
 *   - htmx (the default): the forms carry `hx-post` and hx-sse appends each HTML-escaped text
 *     fragment to the target; the named events `meta`, `done` and `error` arrive as DOM events
 *     on the form. `htmx:config:request` fills in the fields the view decides.
 *   - fetch (`?transport=fetch`): `streamQuote` from quote-stream.js reads the JSON stream.
 *
 * A connection that drops mid-quote is resumed on both: the server keeps the generation running
 * for a grace period (QUOTES_RESUME_GRACE_S, 10 s by default) and answers the same request,
 * asked again with the last event id seen, with exactly the events after it. The tries come
 * after 0.5, 1, 2 and 4 s (RESUME_DELAYS_MS), then the quote is given up as lost. hx-sse does it
 * for htmx (its `reconnect`, which sends `Last-Event-ID`); streamQuote does it for fetch.
 * Stop is not a drop: it asks the server to stop the generation at once (the stop endpoint),
 * then closes the connection.
 */

import { QuoteStreamError, RESUME_DELAYS_MS, streamQuote } from "../quote-stream.js";
import { parseJSON, splitLead, urlFor } from "./dom.js";

const LOST = "The connection was lost before the quote was finished.";

function errorOf(payload, fallback) {
  return {
    code: payload?.code || "error",
    message: payload?.message || fallback,
    retryAfter: payload?.retry_after ?? null,
  };
}

/** hx-sse's reconnect, bounded to fit in the server's grace: the same pauses as the fetch client. */
function resumeWithHtmx() {
  const htmx = window.htmx;
  if (!htmx) return;
  htmx.config.sse = {
    ...(htmx.config.sse || {}),
    reconnect: true,
    reconnectDelay: RESUME_DELAYS_MS[0],
    reconnectMaxDelay: RESUME_DELAYS_MS[RESUME_DELAYS_MS.length - 1],
    reconnectMaxAttempts: RESUME_DELAYS_MS.length,
    reconnectJitter: 0,
  };
}

export function createRequests(page) {
  const { doc, el, config, form } = page;
  /** The request in flight: {view, form, controller?, ctx?, connection?, terminal, stopped}. */
  let active = null;
  if (config.transport === "htmx") resumeWithHtmx();

  function setBusy(busy) {
    const hadFocus = doc.activeElement === (busy ? el.generate : el.stop);
    el.generate.disabled = busy || page.card.counting();
    el.ask.disabled = busy;
    el.stop.hidden = !busy;
    form.setAttribute("aria-busy", String(busy));
    if (hadFocus) (busy ? el.stop : el.generate).focus();
  }

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

  /** Tell the server to stop now (a dropped connection alone would keep it running a while). */
  function stopOnServer(id) {
    if (!id || !config.stopUrl) return;
    fetch(urlFor(config.stopUrl, id), {
      method: "POST",
      credentials: "same-origin",
      cache: "no-store",
      keepalive: true,
    }).catch(() => {}); // offline: the server's grace ends it
  }

  function stop() {
    const run = active;
    if (!run) return;
    run.stopped = true;
    run.terminal = true;
    stopOnServer(run.view.meta?.id);
    if (config.transport === "htmx") {
      window.htmx.trigger(run.form, "htmx:abort");
    } else {
      run.controller?.abort();
    }
    run.view.stop();
    finish(run);
  }

  /** Wire one hx-post form: `makeView(body)` fills in the form's fields and returns the view
   * to drive, or null to send nothing. */
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
      if (view !== page.card) ctx.target = view.textEl;
      run = begin(view, sourceForm);
      run.ctx = ctx;
    });
    sourceForm.addEventListener("htmx:sse:before:connection", (event) => {
      // hx-sse reconnects whenever a body ends: only a live quote whose connection dropped is
      // resumed, never one that ended (done, error, stopped) or was replaced by a newer one.
      const { connection } = event.detail;
      if (connection.attempt === 0) {
        if (run && !run.connection) run.connection = connection;
        return;
      }
      if (!run || run.connection !== connection || run.terminal) {
        connection.cancelled = true;
        event.preventDefault();
      }
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

  async function runFetch(view, body, sourceForm) {
    const run = begin(view, sourceForm);
    run.controller = new AbortController();
    const { signal } = run.controller;
    try {
      const result = await streamQuote({
        url: config.streamUrl,
        body,
        signal,
        onOpen({ model, modelUrl, response }) {
          const id = response.headers.get("X-Quote-Id");
          view.meta = {
            model,
            model_url: modelUrl,
            cache_status: response.headers.get("cf-aig-cache-status") || "",
            id,
            permalink: id ? urlFor(config.permalinkUrl, id) : null,
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

  return {
    busy: () => active !== null,
    stop,
    wireHtmx,
    runFetch,
  };
}
