/* One dead letter: metadata, replay provenance, key/value/headers as text, JSON or hex;
   replay or discard it. */
"use strict";
(function () {
  const { el, clear, banner, get, post, num } = window.triage;
  const id = document.body.dataset.id;
  const base = "/api/deadletters/item/" + id.split("/").map(encodeURIComponent).join("/");
  let view = null;
  let payload = null;

  function message(text, bad) {
    const box = clear(document.getElementById("message"));
    if (text) box.append(el("p", { class: bad ? "notice bad" : "notice", id: "outcome", text: text }));
  }

  function pairs(target, rows) {
    const box = clear(document.getElementById(target));
    for (const [name, value] of rows) {
      box.append(el("dt", { text: name }), el("dd", { dataset: { field: name }, text: num(value) }));
    }
  }

  function showItem(item) {
    document.getElementById("title").textContent = "Dead letter " + item.id;
    pairs("meta", [["state", item.status], ["reason", item.reason], ["attempts", item.attempts],
      ["consumer", item.consumer_id], ["dead-lettered at", item.dead_lettered_at],
      ["kafka timestamp (ms)", item.timestamp_ms],
      ["payload", item.payload_s3 ? item.payload_s3 + " (" + item.payload_bytes + " bytes)" : "in the item"]]);
    pairs("provenance", [["replayed at", item.replayed_at], ["replayed to", item.replayed_to],
      ["replay id", item.replay_id], ["replays", item.replay_count],
      ["claimed by replay", item.replay_claim], ["discarded at", item.discarded_at]]);
    const pending = item.status === "pending";
    document.getElementById("replay").disabled = !pending;
    document.getElementById("discard").disabled = !pending;
    document.body.dataset.status = item.status;
  }

  function blobView(blob) {
    if (blob.null) return "(null)";
    if (view === "hex") return blob.hex + (blob.truncated ? "\n… (" + blob.size + " bytes in all)" : "");
    if (view === "json") return blob.json !== null ? blob.json : "(not JSON)";
    return blob.utf8 ? blob.text : "(not UTF-8; shown with replacement characters)\n" + blob.text;
  }

  function renderPayload() {
    const box = clear(document.getElementById("payload"));
    if (!payload) return;
    for (const button of document.querySelectorAll("#views button")) {
      button.setAttribute("aria-pressed", String(button.dataset.view === view));
    }
    const section = (title, blob, name) => [
      el("h3", { text: title + " (" + blob.size + " bytes)" }),
      el("pre", { class: "payload", id: name, text: blobView(blob) })];
    box.append(...section("Key", payload.key, "payload-key"));
    box.append(...section("Value", payload.value, "payload-value"));
    box.append(el("h3", { text: "Headers (" + payload.headers.length + ")" }));
    if (!payload.headers.length) box.append(el("p", { class: "muted", text: "none" }));
    payload.headers.forEach((h, i) => {
      box.append(el("h4", { text: h.name }), el("pre", { class: "payload header-value",
        id: "payload-header-" + i, text: blobView(h) }));
    });
  }

  async function loadPayload() {
    const box = clear(document.getElementById("payload"));
    box.append(el("p", { class: "muted", text: "Loading the payload…" }));
    const answer = await get(base + "/payload");
    if (!answer.ok) {
      clear(box).append(el("p", { class: "bad", text: answer.data.error }));
      return;
    }
    banner(null);
    payload = answer.data;
    if (!view) view = payload.value.auto;
    renderPayload();
  }

  async function load() {
    const answer = await get(base);
    if (!answer.ok) {
      if (answer.status === 404) message(answer.data.error, true);
      return false;
    }
    banner(null);
    showItem(answer.data);
    if (answer.data.payload_s3 && !payload) {
      const box = clear(document.getElementById("payload"));
      box.append(el("button", { type: "button", id: "fetch-s3", on: { click: loadPayload } },
        "Fetch the payload from S3 (" + answer.data.payload_bytes + " bytes)"));
    } else if (!payload) {
      await loadPayload();
    }
    return true;
  }

  async function act(action) {
    const button = document.getElementById(action);
    button.disabled = true;
    message(action === "replay" ? "Replaying…" : "Discarding…");
    const answer = await post(base + "/" + action);
    if (!answer.ok) { message(answer.data.error, true); await load(); return; }
    const r = answer.data;
    const text = r.outcome === "replayed" ? "Replayed to " + r.item.replayed_to + "."
      : r.outcome === "discarded" ? "Discarded."
      : "Not " + (action === "replay" ? "replayed" : "discarded") + ": " + r.why + ".";
    message(text, r.outcome === "failed" || r.outcome === "in_doubt");
    document.body.dataset.outcome = r.outcome;
    showItem(r.item);
  }

  for (const button of document.querySelectorAll("#views button")) {
    button.addEventListener("click", () => { view = button.dataset.view; renderPayload(); });
  }
  document.getElementById("replay").addEventListener("click", () => act("replay"));
  document.getElementById("discard").addEventListener("click", () => act("discard"));
  (async function retry() {
    if (!(await load())) setTimeout(retry, 3000);
  })();
})();
