/**
 * Persona Quotes: the browser client of the JSON quote stream. It touches no DOM and mounts
 * nothing on import (the admin preview imports it too).
 *
 * The client (`streamQuote`, `createSSEParser`, `tokenOf`, `QuoteStreamError`) has no DOM
 * dependency and is the documented way to consume `POST /api/quotes/stream`:
 *
 *   import { streamQuote } from "/static/js/quote-stream.js";
 *   const controller = new AbortController();
 *   const result = await streamQuote({
 *     url: "/api/quotes/stream",
 *     body: { persona: "alan-watts", topic: "silence" },
 *     signal: controller.signal,
 *     onOpen: ({ model, modelUrl }) => {},   // 200 received, before the first token
 *     onToken: (text) => {},                 // each non-empty token, in order
 *     onEvent: (event) => {},                // every SSE event: { type, data, id, json }
 *   });
 *   // result: { text, usage, model, modelUrl, response }
 *
 * A connection that drops mid-stream is resumed: the same URL is asked again with the last
 * event id seen (`last_event_id`), after 0.5, 1, 2 and 4 s (`retryDelays`), and the text goes
 * on exactly where it stopped. Every event of a stream carries `id: <generation id>.<key>:<n>`
 * (the key: a secret of this stream's own, so the generation's id alone resumes nothing).
 *
 * It rejects with a `QuoteStreamError` (`code`, `message`, `status`, `retryAfter`, `phase`)
 * for any server or network failure, and with the signal's AbortError when aborted.
 *
 * `streamQuoteEventSource` does the same over EventSource (GET) and closes on the final `done`.
 *
 * The persona page is wired by persona-page.js and its modules in ./persona/ (htmx by default,
 * this client with ?transport=fetch).
 */

const SSE_CONTENT_TYPE = "text/event-stream";
/** Pauses before each try to resume a dropped stream: 7.5 s in all, inside the server's grace
 * (QUOTES_RESUME_GRACE_S, 10 s by default). */
export const RESUME_DELAYS_MS = [500, 1000, 2000, 4000];

/** A failure a visitor can act on. `phase` is "request" (before streaming) or "stream". */
export class QuoteStreamError extends Error {
  constructor(code, message, { status = 0, retryAfter = null, phase = "request" } = {}) {
    super(message);
    this.name = "QuoteStreamError";
    this.code = code;
    this.status = status;
    this.retryAfter = retryAfter;
    this.phase = phase;
  }
}

/**
 * An incremental SSE parser following the WHATWG HTML rules: lines end at CRLF, LF or CR (a CRLF
 * may be split across chunks), one leading BOM is dropped, `:` lines are comments, `data` lines
 * are joined with "\n", a blank line dispatches, an event without data is not dispatched and an
 * unterminated event at the end of the stream is dropped.
 *
 * @param {(event: {type: string, data: string, id: string}) => void} onEvent
 * @returns {{push(chunk: string): void, end(): void, readonly retry: number|null}}
 */
export function createSSEParser(onEvent) {
  let buffer = "";
  let started = false;
  let skipLeadingLF = false; // the previous chunk ended in CR: a LF starting this one is its pair
  let dataLines = [];
  let eventType = "";
  let lastEventId = "";
  let retry = null;

  function dispatch() {
    if (dataLines.length === 0) {
      eventType = "";
      return;
    }
    const event = { type: eventType || "message", data: dataLines.join("\n"), id: lastEventId };
    dataLines = [];
    eventType = "";
    onEvent(event);
  }

  function processLine(line) {
    if (line === "") {
      dispatch();
      return;
    }
    if (line.charCodeAt(0) === 0x3a /* ":" */) return;
    const colon = line.indexOf(":");
    let field = line;
    let value = "";
    if (colon !== -1) {
      field = line.slice(0, colon);
      value = line.slice(colon + 1);
      if (value.charCodeAt(0) === 0x20) value = value.slice(1);
    }
    switch (field) {
      case "event":
        eventType = value;
        break;
      case "data":
        dataLines.push(value);
        break;
      case "id":
        if (!value.includes("\0")) lastEventId = value;
        break;
      case "retry":
        if (/^\d+$/.test(value)) retry = Number(value);
        break;
      default:
        break; // unknown fields are ignored
    }
  }

  return {
    push(chunk) {
      if (!chunk) return;
      if (!started) {
        started = true;
        if (chunk.charCodeAt(0) === 0xfeff) chunk = chunk.slice(1);
      }
      if (skipLeadingLF && chunk.charCodeAt(0) === 0x0a) chunk = chunk.slice(1);
      skipLeadingLF = false;
      buffer += chunk;

      let start = 0;
      const length = buffer.length;
      for (let i = 0; i < length; i++) {
        const code = buffer.charCodeAt(i);
        if (code !== 0x0a && code !== 0x0d) continue;
        processLine(buffer.slice(start, i));
        if (code === 0x0d) {
          if (i + 1 < length) {
            if (buffer.charCodeAt(i + 1) === 0x0a) i++;
          } else {
            skipLeadingLF = true;
          }
        }
        start = i + 1;
      }
      buffer = buffer.slice(start);
    },
    end() {
      // An unterminated line or event at end of stream is dropped, as the spec says.
      buffer = "";
      dataLines = [];
      eventType = "";
    },
    get retry() {
      return retry;
    },
  };
}

/** The text of one Workers AI (`response`) or OpenAI-style (`choices[0].delta.content`) chunk. */
export function tokenOf(payload) {
  if (payload == null || typeof payload !== "object") return "";
  const { response } = payload;
  if (typeof response === "string") return response;
  if (typeof response === "number") return String(response);
  const content = payload.choices?.[0]?.delta?.content;
  return typeof content === "string" ? content : "";
}

/** Seconds from a Retry-After header (delta-seconds or an HTTP date), or null. */
export function parseRetryAfter(value) {
  if (!value) return null;
  const trimmed = value.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed);
  const when = Date.parse(trimmed);
  if (Number.isNaN(when)) return null;
  return Math.max(0, Math.ceil((when - Date.now()) / 1000));
}

function errorFromPayload(payload, fallbackMessage, options) {
  const error = payload && typeof payload === "object" ? payload.error : null;
  if (error && typeof error === "object") {
    return new QuoteStreamError(
      String(error.code || "error"),
      String(error.message || fallbackMessage),
      options,
    );
  }
  if (typeof error === "string" && error) {
    return new QuoteStreamError("error", error, options);
  }
  return new QuoteStreamError("error", fallbackMessage, options);
}

function abortReason(signal) {
  return signal.reason ?? new DOMException("The quote was stopped.", "AbortError");
}

async function errorFromResponse(response) {
  const retryAfter = parseRetryAfter(response.headers.get("Retry-After"));
  const options = { status: response.status, retryAfter, phase: "request" };
  const fallback =
    response.status === 429
      ? "Too many quotes in a short time."
      : `The server could not write a quote (HTTP ${response.status}).`;
  let payload = null;
  try {
    payload = JSON.parse(await response.text());
  } catch {
    // Not JSON (a proxy's error page, say): fall back to a generic message.
  }
  const error = errorFromPayload(payload, fallback, options);
  if (error.code === "error" && response.status === 429) error.code = "rate_limited";
  return error;
}

/**
 * POST `body` as JSON to `url` and stream the quote.
 *
 * @param {object} options
 * @param {string} options.url  the stream endpoint, e.g. "/api/quotes/stream"
 * @param {{persona: string, topic?: string}} options.body
 * @param {AbortSignal} [options.signal]  abort to stop; the server sees a disconnect
 * @param {(text: string) => void} [options.onToken]
 * @param {(event: {type: string, data: string, id: string, json: any}) => void} [options.onEvent]
 * @param {(info: {model: string|null, modelUrl: string|null, response: Response}) => void} [options.onOpen]
 * @param {number[]} [options.retryDelays]  pauses (ms) before each try to resume a dropped
 *   stream (by its last event id); [] never resumes
 * @param {typeof fetch} [options.fetch]
 * @returns {Promise<{text: string, usage: object|null, model: string|null, modelUrl: string|null, response: Response}>}
 */
export async function streamQuote({
  url,
  body,
  signal,
  onToken = () => {},
  onEvent = () => {},
  onOpen = () => {},
  retryDelays = RESUME_DELAYS_MS,
  fetch: fetchImpl = globalThis.fetch.bind(globalThis),
}) {
  let response;
  try {
    response = await fetchImpl(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: SSE_CONTENT_TYPE },
      body: JSON.stringify(body),
      signal,
      credentials: "same-origin",
      cache: "no-store",
    });
  } catch (error) {
    if (signal?.aborted) throw abortReason(signal);
    throw new QuoteStreamError(
      "network_error",
      "Could not reach the server. Check your connection and try again.",
    );
  }

  if (!response.ok) throw await errorFromResponse(response);

  const contentType = response.headers.get("Content-Type") || "";
  if (!contentType.toLowerCase().startsWith(SSE_CONTENT_TYPE) || !response.body) {
    throw new QuoteStreamError("bad_response", "The server sent an answer this page cannot read.", {
      status: response.status,
    });
  }

  const model = response.headers.get("X-Quote-Model");
  const modelUrl = response.headers.get("X-Quote-Model-Url");
  onOpen({ model, modelUrl, response });

  let text = "";
  let usage = null;
  let finished = false;
  let failure = null;
  let lastEventId = "";

  function onSSE(event) {
    if (finished || failure) return;
    if (event.id) lastEventId = event.id;
    let json = null;
    if (event.data !== "[DONE]") {
      try {
        json = JSON.parse(event.data);
      } catch {
        json = null;
      }
    }
    onEvent({ ...event, json });

    if (event.type === "error") {
      failure = errorFromPayload(json, "The model stopped with an error.", {
        status: response.status,
        phase: "stream",
      });
      return;
    }
    if (event.type !== "message") return; // named events we do not know are someone else's
    if (event.data === "[DONE]") {
      finished = true;
      return;
    }
    if (json === null) return;
    if (json.error) {
      failure = errorFromPayload(json, "The model stopped with an error.", {
        status: response.status,
        phase: "stream",
      });
      return;
    }
    if (json.usage) usage = json.usage;
    const token = tokenOf(json);
    if (token) {
      text += token;
      onToken(token);
    }
  }

  const lost = () =>
    new QuoteStreamError("connection_lost", "The connection was lost before the quote was finished.", {
      status: response.status,
      phase: "stream",
    });

  let attempt = 0;
  /** The connection dropped: ask for the events after the last one seen, after a pause that
   * doubles each time (the server keeps the generation running for a grace period, about
   * 10 s). A new reader, or null when the tries are used up. */
  async function resume() {
    // Only an event id carries the generation's resume key: its id alone resumes nothing.
    const id = lastEventId;
    while (id && attempt < retryDelays.length) {
      await pause(retryDelays[attempt++], signal);
      let next;
      try {
        next = await fetchImpl(url, {
          method: "POST",
          headers: { "Content-Type": "application/json", Accept: SSE_CONTENT_TYPE },
          body: JSON.stringify({ ...body, last_event_id: id }),
          signal,
          credentials: "same-origin",
          cache: "no-store",
        });
      } catch {
        if (signal?.aborted) throw abortReason(signal);
        continue; // still offline: the next try waits longer
      }
      if (!next.ok) throw await errorFromResponse(next); // e.g. resume_unavailable: say so
      if (!next.body) continue;
      attempt = 0; // a working connection earns a fresh budget of tries
      return next.body.pipeThrough(new TextDecoderStream()).getReader();
    }
    return null;
  }

  let parser = createSSEParser(onSSE);
  let reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  try {
    while (!finished && !failure) {
      let chunk = null;
      try {
        chunk = await reader.read();
      } catch {
        if (signal?.aborted) throw abortReason(signal);
      }
      if (chunk && !chunk.done) {
        parser.push(chunk.value);
        continue;
      }
      // Cut short (a network error, or a body that ended before [DONE]): resume where we were.
      parser.end();
      if (finished || failure) break;
      reader.cancel().catch(() => {});
      const next = await resume();
      if (!next) throw lost();
      reader = next;
      parser = createSSEParser(onSSE); // an event cut in half is sent again whole
    }
  } finally {
    // Closes the connection when we leave early ([DONE] or an error event); harmless at the end.
    reader.cancel().catch(() => {});
  }

  if (failure) throw failure;
  if (signal?.aborted) throw abortReason(signal);
  if (!finished) throw lost();
  return { text, usage, model, modelUrl, response };
}

function pause(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(abortReason(signal));
      return;
    }
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener(
      "abort",
      () => {
        clearTimeout(timer);
        reject(abortReason(signal));
      },
      { once: true },
    );
  });
}

/**
 * The same stream over `EventSource` (GET; no body, so no follow-up `messages`).
 *
 * The server ends a finished stream with `data: [DONE]` and then a named `done` event, and an
 * interrupted one with a named `error` event; this closes the EventSource on either, because an
 * EventSource left open reconnects when the body ends. A connection that drops is left to the
 * browser's own reconnect (a few times): it sends Last-Event-ID, and the server resumes.
 *
 *   const { text, id, permalink } = await streamQuoteEventSource({
 *     url: "/api/quotes/stream", params: { persona: "alan-watts" }, onToken: (t) => {},
 *   });
 *
 * @returns {Promise<{text: string, usage: object|null, id: string|null, permalink: string|null}>}
 */
export function streamQuoteEventSource({ url, params = {}, onToken = () => {}, signal } = {}) {
  const query = new URLSearchParams(params).toString();
  const source = new EventSource(query ? `${url}?${query}` : url);
  let text = "";
  let usage = null;
  return new Promise((resolve, reject) => {
    const close = () => source.close();
    signal?.addEventListener("abort", () => {
      close();
      reject(abortReason(signal));
    });
    source.addEventListener("message", (event) => {
      if (event.data === "[DONE]") return; // the named `done` follows
      let json = null;
      try {
        json = JSON.parse(event.data);
      } catch {
        return;
      }
      if (json?.usage) usage = json.usage;
      const token = tokenOf(json);
      if (token) {
        text += token;
        onToken(token);
      }
    });
    source.addEventListener("done", (event) => {
      close();
      let json = null;
      try {
        json = JSON.parse(event.data);
      } catch {
        json = null;
      }
      resolve({ text, usage, id: json?.id ?? null, permalink: json?.permalink ?? null });
    });
    let drops = 0;
    source.addEventListener("open", () => {
      drops = 0;
    });
    source.addEventListener("error", (event) => {
      if (!event.data && source.readyState === EventSource.CONNECTING && ++drops <= RESUME_DELAYS_MS.length) {
        // The connection dropped and the browser is reconnecting by itself (after the
        // server's `retry`), with Last-Event-ID: the server resumes the same generation.
        return;
      }
      close();
      if (event.data) {
        let json = null;
        try {
          json = JSON.parse(event.data);
        } catch {
          json = null;
        }
        reject(errorFromPayload(json, "The model stopped with an error.", { phase: "stream" }));
      } else {
        // A network error, or a non-200 answer (EventSource cannot read its status or body).
        reject(new QuoteStreamError("connection_lost", "The quote stream could not be opened or was lost."));
      }
    });
  });
}
