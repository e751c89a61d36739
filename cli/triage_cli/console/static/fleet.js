/* Fleet: the proxy processes, which partitions each serves, the leases and their
   holders, and the rebalances the console saw in the last hour. */
"use strict";
(function () {
  const { el, clear, banner, get, every, num, time } = window.triage;

  function table(id, headers, rows) {
    return el("table", { id: id },
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, rows));
  }

  function render(doc) {
    document.getElementById("sampled").textContent = "Sampled at " + time(doc.sampled_at) + ".";
    const problems = clear(document.getElementById("problems"));
    if (doc.error) problems.append(el("p", { class: "notice bad", text: "Cannot read the fleet: " + doc.error }));
    if (doc.leases_error) problems.append(el("p", { class: "notice bad", text: "Leases: " + doc.leases_error }));
    const procs = doc.processes.map((p) => el("tr", {},
      el("td", { text: p.url }),
      el("td", { class: p.state === "running" ? "ok" : "bad", text: p.state + (p.error ? " (" + p.error + ")" : "") }),
      el("td", { class: "num", text: num(p.pid) }),
      el("td", { text: num(p.owner) }), el("td", { text: num(p.mode) }),
      el("td", { text: num(p.endpoint) }),
      el("td", { text: (p.assigned || []).join(", ") || "–" }),
      el("td", { class: "served", text: (p.served || []).join(", ") || "–" })));
    clear(document.getElementById("processes")).append(procs.length
      ? table("process-table", ["status URL", "state", "pid", "owner", "mode", "endpoint", "assigned", "serves"], procs)
      : el("p", { class: "muted", text: "No proxy process is configured to be asked." }));
    const parts = doc.partitions.map((p) => {
      const lease = p.lease;
      return el("tr", {},
        el("td", { class: "num", text: p.partition }),
        el("td", { class: p.proxy === "running" ? "ok" : "bad", text: p.proxy }),
        el("td", { text: p.served_by ? "pid " + p.served_by.pid + " · " + num(p.served_by.owner) : "–" }),
        el("td", { text: lease ? lease.owner : "no lease item" }),
        el("td", { text: lease ? new Date(lease.until_ms).toLocaleTimeString() + (lease.live ? "" : " (lapsed)") : "–" }),
        el("td", { text: lease ? num(lease.endpoint) : "–" }));
    });
    clear(document.getElementById("leases")).append(table("lease-table",
      ["partition", "proxy", "served by", "lease holder", "lease until", "lease endpoint"], parts));
    const moves = doc.rebalances.map((r) => el("tr", {},
      el("td", { text: time(r.at) }), el("td", { class: "num", text: r.partition }),
      el("td", { text: num(r.before) }), el("td", { text: num(r.after) })));
    clear(document.getElementById("rebalances")).append(moves.length
      ? table("rebalance-table", ["seen at", "partition", "from", "to"], moves)
      : el("p", { class: "muted", text: "No partition moved while the console ran." }));
  }

  every(3000, async () => {
    const answer = await get("/api/fleet");
    if (!answer.ok) return;
    banner(null);
    render(answer.data);
  });
})();
