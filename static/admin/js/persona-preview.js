/**
 * Live preview on the persona change form: POST the form's current (unsaved) values to the
 * admin's preview endpoint and stream the quote into the preview box, with the same client the
 * public page uses. The endpoint validates the values with the change form's own ModelForm.
 */

import { QuoteStreamError, streamQuote } from "../../js/quote-stream.js";

/** The form's fields as {name: [values]}, leaving out the CSRF token and the admin's submit buttons. */
function formFields(form) {
  const fields = {};
  for (const [name, value] of new FormData(form)) {
    if (name === "csrfmiddlewaretoken" || name.startsWith("_") || typeof value !== "string") continue;
    (fields[name] ??= []).push(value);
  }
  return fields;
}

function csrfToken(form) {
  const input = form.querySelector("input[name=csrfmiddlewaretoken]");
  if (input?.value) return input.value;
  const cookie = document.cookie.split("; ").find((part) => part.startsWith("csrftoken="));
  return cookie ? decodeURIComponent(cookie.slice("csrftoken=".length)) : "";
}

function mountPreview(panel) {
  const form = panel.closest("form");
  const find = (testid) => panel.querySelector(`[data-testid="${testid}"]`);
  const topicInput = find("preview-topic");
  const runButton = find("preview-button");
  const stopButton = find("preview-stop");
  const box = find("preview-box");
  const placeholder = find("preview-placeholder");
  const loading = find("preview-loading");
  const quote = find("preview-text");
  const meta = find("preview-meta");
  const errorNote = find("preview-error");
  let controller = null;

  function setState(state) {
    panel.dataset.state = state;
    box.setAttribute("aria-busy", String(state === "loading" || state === "streaming"));
    runButton.disabled = state === "loading" || state === "streaming";
    stopButton.hidden = !runButton.disabled;
  }

  function reset() {
    placeholder.hidden = true;
    quote.replaceChildren();
    quote.hidden = true;
    meta.hidden = true;
    meta.textContent = "";
    errorNote.hidden = true;
    errorNote.textContent = "";
  }

  async function run() {
    controller?.abort();
    controller = new AbortController();
    const { signal } = controller;
    const token = csrfToken(form);
    const withCsrf = (url, init) =>
      fetch(url, { ...init, headers: { ...init.headers, "X-CSRFToken": token } });

    reset();
    loading.hidden = false;
    setState("loading");
    let model = "";
    let started = false;
    const began = performance.now();
    try {
      const result = await streamQuote({
        url: panel.dataset.previewUrl,
        body: { fields: formFields(form), topic: topicInput.value.trim() },
        signal,
        fetch: withCsrf,
        onOpen(info) {
          model = info.model || "";
        },
        onToken(text) {
          if (!started) {
            text = text.trimStart();
            if (!text) return;
            started = true;
            loading.hidden = true;
            quote.hidden = false;
            setState("streaming");
          }
          quote.append(text);
        },
      });
      loading.hidden = true;
      quote.normalize();
      const seconds = ((performance.now() - began) / 1000).toFixed(1);
      const tokens = result.usage?.completion_tokens;
      meta.textContent = [model, tokens != null ? `${tokens} tokens` : "", `${seconds} s`, "not saved"]
        .filter(Boolean)
        .join(" · ");
      meta.hidden = false;
      if (!started) {
        placeholder.hidden = false;
        placeholder.textContent = "The model wrote nothing this time.";
      }
      setState("done");
    } catch (error) {
      if (signal.aborted || error?.name === "AbortError") return;
      loading.hidden = true;
      errorNote.textContent =
        error instanceof QuoteStreamError ? error.message : "Something went wrong with the preview.";
      errorNote.hidden = false;
      if (!(error instanceof QuoteStreamError)) console.error(error);
      setState("error");
    } finally {
      if (controller?.signal === signal) controller = null;
    }
  }

  function stop() {
    if (!controller) return;
    controller.abort();
    controller = null;
    loading.hidden = true;
    meta.textContent = "Stopped.";
    meta.hidden = false;
    setState("stopped");
  }

  runButton.addEventListener("click", run);
  stopButton.addEventListener("click", stop);
  // Enter in the topic box previews instead of saving the whole form.
  topicInput.addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      if (!runButton.disabled) run();
    }
  });
  runButton.disabled = false;
  panel.dataset.ready = "true";
}

const panel = document.querySelector("[data-persona-preview]");
if (panel) mountPreview(panel);
