/* Dead letters: a paged list with the filters of `triage dlq`, counts by reason, and
   replay or discard of everything a filter selects (confirmed, with progress). */
"use strict";
(function () {
  const { el, clear, banner, get, post, num, itemHref, modal } = window.triage;
  const form = document.getElementById("filters");
  const FIELDS = ["partition", "reason", "since", "state"];
  let cursor = null;
  let nextCursor = null;

  function current() {
    const out = {};
    for (const name of FIELDS) {
      const v = form.elements[name].value.trim();
      if (v) out[name] = v;
    }
    return out;
  }

  function query(extra) {
    const params = new URLSearchParams(Object.assign({}, current(), extra || {}));
    return params.toString();
  }

  function describe(filters) {
    const parts = Object.entries(filters).map(([k, v]) => k + " " + JSON.stringify(v));
    return parts.length ? parts.join(", ") : "no filter (every dead letter of this deployment)";
  }

  function message(text, bad) {
    const box = clear(document.getElementById("message"));
    if (text) box.append(el("p", { class: bad ? "notice bad" : "notice", text: text }));
  }

  async function loadList() {
    const answer = await get("/api/deadletters?" + query(cursor ? { after: cursor } : {}));
    const list = clear(document.getElementById("list"));
    if (!answer.ok) {
      if (answer.status === 400) message(answer.data.error, true);
      list.append(el("p", { class: "bad", text: answer.data.error || "cannot list" }));
      return;
    }
    banner(null);
    nextCursor = answer.data.next;
    document.getElementById("next").disabled = !nextCursor;
    document.getElementById("first").disabled = !cursor;
    if (!answer.data.items.length) {
      list.append(el("p", { id: "empty", class: "muted",
        text: "No dead letter matches " + describe(current()) + "." }));
      return;
    }
    const rows = answer.data.items.map((item) => el("tr", { dataset: { id: item.id } },
      el("td", {}, el("a", { href: itemHref(item.id), text: item.id })),
      el("td", { class: "status", text: item.status }),
      el("td", { class: "num", text: num(item.attempts) }),
      el("td", { text: (item.dead_lettered_at || "").replace("T", " ").slice(0, 19) }),
      el("td", { class: "cut", text: item.payload_s3 ? "(in S3)" : num(item.key) }),
      el("td", { class: "cut reason", text: item.reason })));
    list.append(el("table", { id: "items" },
      el("thead", {}, el("tr", {}, ["dead letter", "state", "attempts", "dead-lettered at (UTC)",
        "key", "reason"].map((h) => el("th", { text: h })))),
      el("tbody", {}, rows)));
  }

  async function loadReasons() {
    const answer = await get("/api/deadletters/reasons?" + query());
    const box = clear(document.getElementById("reasons"));
    if (!answer.ok) { box.append(el("p", { class: "bad", text: answer.data.error })); return; }
    const data = answer.data;
    box.append(el("p", { class: "muted", text: (data.complete === false ? "more than " : "") + data.total + " matching" }));
    const rows = data.reasons.map((r) => el("tr", {},
      el("td", { class: "num", text: r.count }),
      el("td", {}, el("a", { href: "#", class: "reason-link", text: r.reason, on: { click: (ev) => {
        ev.preventDefault();
        form.elements.reason.value = r.raw;
        apply();
      } } }))));
    if (data.other) rows.push(el("tr", {}, el("td", { class: "num", text: data.other }),
      el("td", { class: "muted", text: "other reasons" })));
    if (rows.length) box.append(el("table", { id: "reason-counts" },
      el("thead", {}, el("tr", {}, el("th", { text: "count" }), el("th", { text: "reason" }))),
      el("tbody", {}, rows)));
  }

  function apply() {
    cursor = null;
    message(null);
    history.replaceState(null, "", "/deadletters" + (query() ? "?" + query() : ""));
    return Promise.all([loadList(), loadReasons()]);
  }

  async function bulk(action) {
    const filters = current();
    delete filters.state;  // bulk work acts on pending items only
    const counted = await get("/api/deadletters/count?" + new URLSearchParams(filters));
    if (!counted.ok) { message(counted.data.error, counted.status === 400); return; }
    const n = counted.data.pending;
    if (!n) { message("No pending dead letter matches " + describe(filters) + ": nothing to " + action + "."); return; }
    const verb = action === "replay" ? "Replay" : "Discard";
    const ok = await modal(verb + " " + n + " dead letters?",
      verb + " " + n + " pending dead letter" + (n === 1 ? "" : "s") + " matching " +
      describe(filters) + "?" + (action === "discard" ? " Discarded ones are never replayed." : ""),
      verb + " " + n, action === "discard");
    if (!ok) return;
    const started = await post("/api/jobs", Object.assign({ action: action }, filters));
    if (!started.ok) { message(started.data.error, true); return; }
    follow(started.data.id, n);
  }

  async function follow(id, expected) {
    const box = clear(document.getElementById("job"));
    const bar = el("progress", { id: "job-progress", max: Math.max(1, expected), value: 0 });
    const text = el("span", { id: "job-text", text: " starting…" });
    box.append(el("div", { class: "notice" }, bar, text));
    for (;;) {
      const answer = await get("/api/jobs/" + encodeURIComponent(id));
      if (answer.ok) {
        const job = answer.data;
        const r = job.result;
        if (r) {
          bar.max = Math.max(1, r.selected, r.done);
          bar.value = r.done;
          const parts = [r.done + " of " + r.selected + " done"];
          if (job.action === "replay") parts.push(r.replayed + " replayed");
          else parts.push(r.discarded + " discarded");
          parts.push(r.skipped + " skipped");
          if (r.failed) parts.push(r.failed + " failed");
          if (r.in_doubt) parts.push(r.in_doubt + " in doubt");
          text.textContent = " " + job.action + " " + job.state + ": " + parts.join(", ");
          for (const f of (job.state !== "running" ? r.failures : [])) {
            box.append(el("p", { class: "bad", text: f.id + " " + f.outcome + ": " + f.why }));
          }
        }
        if (job.state !== "running") {
          if (job.error) box.append(el("p", { class: "bad", text: job.error }));
          box.dataset.state = job.state;
          await apply();
          return;
        }
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }

  const params = new URLSearchParams(location.search);
  for (const name of FIELDS) if (params.get(name)) form.elements[name].value = params.get(name);
  form.addEventListener("submit", (ev) => { ev.preventDefault(); apply(); });
  document.getElementById("next").addEventListener("click", () => {
    if (nextCursor) { cursor = nextCursor; loadList(); }
  });
  document.getElementById("first").addEventListener("click", () => { cursor = null; loadList(); });
  document.getElementById("replay-all").addEventListener("click", () => bulk("replay"));
  document.getElementById("discard-all").addEventListener("click", () => bulk("discard"));
  apply();
  // The table going away and coming back: retry a failed listing every few seconds.
  setInterval(() => {
    if (!document.getElementById("banner").hidden) loadList();
  }, 3000);
})();
