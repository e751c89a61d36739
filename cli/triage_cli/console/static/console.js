/* Shared helpers of every page. Data from the server only ever reaches the DOM as text
   (textContent, or attribute values the code builds itself): never as markup. */
"use strict";
(function () {
  const csrfMeta = document.querySelector('meta[name="csrf-token"]');
  const csrf = csrfMeta ? csrfMeta.getAttribute("content") : "";

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = String(v);
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, String(v));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

  function banner(message) {
    const b = document.getElementById("banner");
    if (!b) return;
    if (message) { b.textContent = message; b.hidden = false; }
    else { b.textContent = ""; b.hidden = true; }
  }

  async function request(path, options) {
    let response;
    try {
      response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
    } catch (err) {
      banner("The console does not answer (" + err.message + "); retrying.");
      return { ok: false, status: 0, data: { error: "the console does not answer" } };
    }
    let data = null;
    try { data = await response.json(); } catch (err) { data = { error: response.statusText }; }
    if (response.status === 401) {
      banner("Not logged in: open the URL `triage console` printed (it holds the login token).");
    } else if (response.status === 503) {
      banner((data && data.error) || "A source is unavailable; retrying.");
    }
    return { ok: response.ok, status: response.status, data: data };
  }

  function get(path) { return request(path); }

  function post(path, body) {
    return request(path, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify(body || {}),
    });
  }

  function every(ms, fn) {
    let stopped = false;
    async function tick() {
      if (stopped) return;
      try { await fn(); } catch (err) { banner("Page error: " + err.message); }
      if (!stopped) setTimeout(tick, ms);
    }
    tick();
    return () => { stopped = true; };
  }

  function num(v) { return v === null || v === undefined ? "–" : String(v); }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 60) return seconds.toFixed(1) + " s";
    if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  function time(epochS) {
    if (!epochS) return "–";
    return new Date(epochS * 1000).toLocaleTimeString();
  }

  function itemHref(id) {
    return "/deadletters/" + id.split("/").map(encodeURIComponent).join("/");
  }

  function modal(title, text, confirmLabel, danger) {
    return new Promise((resolve) => {
      const back = el("div", { class: "modal-back" });
      const done = (answer) => { back.remove(); resolve(answer); };
      const box = el("div", { class: "modal", role: "dialog", "aria-modal": "true" },
        el("h2", { text: title }),
        el("p", { text: text, id: "confirm-text" }),
        el("div", { class: "actions" },
          el("button", { class: danger ? "danger" : "primary", id: "confirm-yes",
                         on: { click: () => done(true) } }, confirmLabel),
          el("button", { id: "confirm-no", on: { click: () => done(false) } }, "Cancel")));
      back.append(box);
      document.body.append(back);
    });
  }

  window.triage = { el, clear, banner, get, post, every, num, age, time, itemHref, modal, csrf };
  window.triageConsole = { charts: {} };
})();
