// "Try it" on a succeeded job's page: one prompt, answered by the fine-tuned model and by
// its base model side by side, each streamed as the server sends it (POST
// /v1/chat/completions with stream: true; server-sent events read from fetch's body).
"use strict";

async function streamChat(model, text, out) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { Authorization: `Bearer ${localStorage.getItem("ftune.apiKey") || ""}`,
               "Content-Type": "application/json" },
    body: JSON.stringify({ model, stream: true, max_tokens: 128, temperature: 0,
                           messages: [{ role: "user", content: text }] }),
  });
  if (!resp.ok) {
    let err = { message: resp.statusText };
    try { err = (await resp.json()).error || err; } catch (_) { /* not JSON */ }
    const retry = resp.headers.get("retry-after");
    throw new Error(`${resp.status} ${err.code || ""}: ${err.message}${retry ? ` (retry in ${retry} s)` : ""}`);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: {")) continue;
      for (const choice of JSON.parse(line.slice(6)).choices || []) {
        const piece = (choice.delta || {}).content;
        if (piece) out.textContent += piece; // text, never HTML
      }
    }
  }
}

// The card's HTML; ``models`` is [[label, model name], ...] (names are escaped by the caller).
function tryItCard(models) {
  return `<div class="card" id="tryit"><h3>Try it</h3>
    <form id="tryform" autocomplete="off"><input id="tryprompt" placeholder="Ask something" aria-label="prompt">
    <button type="submit" class="primary">Send</button></form>
    <div class="answers">${models.map(([label, name]) => `<div><h4>${label} <code>${name}</code></h4>
      <pre class="answer" data-model="${name}"></pre></div>`).join("")}</div></div>`;
}

function wireTryIt() {
  const form = document.querySelector("#tryform");
  if (!form) return;
  form.onsubmit = async (ev) => {
    ev.preventDefault();
    const text = document.querySelector("#tryprompt").value.trim();
    if (!text) return;
    await Promise.all([...document.querySelectorAll("#tryit pre.answer")].map(async (out) => {
      out.textContent = "";
      out.classList.remove("error");
      delete out.dataset.done; // set again once this answer's stream has ended
      try { await streamChat(out.dataset.model, text, out); } catch (e) {
        out.textContent = e.message;
        out.classList.add("error");
      } finally {
        out.dataset.done = "true";
      }
    }));
  };
}
