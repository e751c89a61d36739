/* Overview: per partition lag and what blocks its commit; plots of the last hour. */
"use strict";
(function () {
  const { el, clear, banner, get, every, num, age, time } = window.triage;
  const charts = window.triageConsole.charts;
  const COLORS = ["#2f5bd3", "#d92d20", "#079455", "#dc6803", "#7a5af8", "#0e9384", "#c11574",
                  "#4e5ba6", "#667085", "#b54708"];

  function plotWidth() {
    return Math.max(300, Math.min(560, Math.floor((document.body.clientWidth - 80) / 3)));
  }

  // Counts (lag, items pending) are whole numbers: their axis steps by whole numbers, or
  // a count of 1 would show ticks at 0.2, 0.4 ... (uPlot's default steps are decimal).
  const WHOLE_STEPS = [];
  for (let e = 0; e <= 12; e++) [1, 2, 5].forEach((m) => WHOLE_STEPS.push(m * 10 ** e));

  // One y axis per kind of series ("count" or "rate"), in the order they first appear: the
  // first on the left, a second on the right in its series' colour, so a rate and a count
  // in one plot do not share a scale.
  function yAxes(kinds) {
    const seen = [];
    kinds.forEach((kind, i) => { if (!seen.some((s) => s.kind === kind)) seen.push({ kind, i }); });
    return seen.map((s, n) => {
      const axis = { scale: s.kind, size: 60 };
      if (s.kind === "count") axis.incrs = WHOLE_STEPS;
      if (n > 0) {
        axis.side = 1;
        axis.grid = { show: false };
        axis.stroke = COLORS[s.i % COLORS.length];
      }
      return axis;
    });
  }

  function draw(name, target, labels, kinds, columns) {
    const key = labels.join("|");
    const chart = charts[name];
    if (chart && chart._key === key) {
      chart.setData(columns);
      return;
    }
    if (chart) chart.destroy();
    const series = [{}].concat(labels.map((label, i) => ({
      label: label, scale: kinds[i], stroke: COLORS[i % COLORS.length], width: 1.5,
      spanGaps: false,
    })));
    const made = new uPlot({
      width: plotWidth(), height: 200, series: series,
      scales: { x: { time: true } },
      axes: [{}].concat(yAxes(kinds)),
      legend: { show: true },
    }, columns, document.getElementById(target));
    made._key = key;
    charts[name] = made;
  }

  function plots(h) {
    const t = h.t || [];
    const parts = Object.keys(h.lag || {}).sort((a, b) => Number(a) - Number(b));
    const lagLabels = ["total"].concat(parts.map((p) => "partition " + p));
    draw("lag", "plot-lag", lagLabels, lagLabels.map(() => "count"),
      [t, h.lag_total].concat(parts.map((p) => h.lag[p])));
    draw("throughput", "plot-throughput", ["acks/s", "nacks/s"], ["rate", "rate"],
      [t, h.acked, h.nacked]);
    draw("deadletters", "plot-deadletters", ["dead-lettered/s", "pending in table"],
      ["rate", "count"], [t, h.dead_lettered, h.pending]);
  }

  function table(headers, rows) {
    return el("table", {},
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, rows));
  }

  function blockingCells(b) {
    if (!b) return [el("td", { class: "muted", text: "nothing unsettled" }), el("td"), el("td")];
    let what = b.waiting_for;
    if (b.holder) what += " (" + b.holder + ", attempt " + b.attempt + ")";
    else if (b.attempt) what += " (attempt " + b.attempt + ")";
    return [el("td", { class: "num", text: b.offset }), el("td", { class: "num", text: age(b.age_s) }),
            el("td", { text: what })];
  }

  function rate(rates, p, name) {
    const r = rates[String(p)];
    return r && r[name] !== undefined ? r[name].toFixed(1) : "–";
  }

  function render(doc) {
    const report = doc.report;
    const sampled = document.getElementById("sampled");
    const problems = clear(document.getElementById("problems"));
    if (doc.error) {
      problems.append(el("p", { class: "notice bad", id: "sample-error",
        text: "Cannot read the fleet: " + doc.error + " (retrying every " + doc.interval_s + " s)" }));
    }
    if (!report) return;
    sampled.textContent = "Sampled at " + time(doc.sampled_at) + " (" + age(doc.age_s) +
      " ago), every " + doc.interval_s + " s. Deployment " + doc.deployment.topic + " · group " +
      doc.deployment.group + ".";
    if (report.broker_error) problems.append(el("p", { class: "notice bad", id: "broker-error",
      text: "Broker: " + report.broker_error }));
    if (report.dead_letters_error) problems.append(el("p", { class: "notice bad",
      id: "table-error", text: "Dead-letter table: " + report.dead_letters_error }));
    for (const row of report.partitions) {
      // A fleet's unserved partition has no proxy of its own (proxy_url null): the error
      // alone says why.
      if (row.proxy === "down") problems.append(el("p", { class: "notice bad",
        text: "Partition " + row.partition + " down: " + (row.proxy_url
          ? "no proxy answers (" + row.proxy_url + ": " + row.proxy_error + ")"
          : (row.proxy_error || "no proxy process serves it")) }));
      for (const d of row.degraded || []) problems.append(el("p", { class: "notice",
        text: "Partition " + row.partition + " degraded: " + d }));
      for (const u of row.unwritable_dead_letters || []) problems.append(el("p", {
        class: "notice bad", text: "Partition " + row.partition + ": the dead letter at offset " +
          u.offset + " cannot be written (" + u.size + " bytes). Fix: " + u.fix }));
    }
    const rows = report.partitions.map((row) => {
      const served = row.served_by;
      return el("tr", { dataset: { partition: row.partition } },
        el("td", { class: "num", text: row.partition }),
        el("td", { class: row.proxy === "running" ? "ok" : "bad", text: row.proxy }),
        el("td", { text: served ? "pid " + served.pid + " · " + (served.endpoint || "") : "–" }),
        el("td", { class: "num", text: num(row.committed_offset) }),
        el("td", { class: "num", text: num(row.log_end_offset) }),
        el("td", { class: "num lag", text: num(row.lag) }),
        ...(row.proxy === "down" ? [el("td", { text: "–" }), el("td"), el("td")]  // unknown
          : blockingCells(row.blocking)),
        el("td", { class: "num", text: rate(doc.rates, row.partition, "acked") }),
        el("td", { class: "num", text: rate(doc.rates, row.partition, "nacked") }),
        el("td", { class: "num", text: rate(doc.rates, row.partition, "dead_lettered") }),
        el("td", { class: "num", text: num(row.in_flight) }),
        el("td", { class: "num", text: num(row.queued) }),
        el("td", { class: "num", text: num(row.connected_instances) }),
        el("td", { class: "num", text: num(row.dead_letters_pending) }));
    });
    const partitions = clear(document.getElementById("partitions"));
    partitions.append(table(["partition", "proxy", "served by", "committed", "log end", "lag",
      "blocking offset", "blocked for", "waiting for", "acks/s", "nacks/s", "DL/s",
      "in flight", "queued", "instances", "DL pending"], rows));
    const instRows = [];
    for (const row of report.partitions) {
      for (const i of row.instances_detail || []) {
        instRows.push(el("tr", {}, el("td", { class: "num", text: row.partition }),
          el("td", { text: i.consumer_id }), el("td", { class: "num", text: i.credits }),
          el("td", { class: "num", text: i.held })));
      }
    }
    const inst = clear(document.getElementById("instances"));
    inst.append(instRows.length ? table(["partition", "consumer id", "credits", "in flight"], instRows)
      : el("p", { class: "muted", text: "No consumer instance is connected." }));
    const push = clear(document.getElementById("push"));
    const pushRows = (report.push || []).map((t) => el("tr", {},
      el("td", { text: t.name }), el("td", { text: (t.partitions || []).join(", ") }),
      el("td", { text: "pid " + t.pid }), el("td", { class: t.state === "ok" ? "ok" : "warn", text: t.state }),
      el("td", { class: "num", text: num(t.limit) }), el("td", { class: "num", text: num(t.in_flight) }),
      el("td", { class: "num", text: num(t.errors) })));
    push.append(pushRows.length ? table(["target", "partitions", "process", "state", "limit",
      "in flight", "errors"], pushRows) : el("p", { class: "muted", text: "No push target." }));
  }

  every(2000, async () => {
    const answer = await get("/api/overview");
    if (!answer.ok) return;
    banner(null);
    render(answer.data);
    plots(answer.data.history);
    document.body.dataset.samples = String((answer.data.history.t || []).length);
  });
})();
