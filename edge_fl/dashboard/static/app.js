// edge-fl dashboard page: one EventSource, a few uPlot charts, plain tables. No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const records = [];
let view = null;
const charts = {};
const stats = { rendered: 0, lastSeq: -1, renderMs: 0, times: [] };
window.__dashboard = stats; // read by the tests and the responsiveness benchmark

const fmt = {
  int: (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US")),
  acc: (v) => (v == null ? "–" : v.toFixed(4)),
  eps: (v) => (v == null ? "–" : v >= 1000 ? Math.round(v).toLocaleString("en-US") : v.toPrecision(4)),
  text: (v) => (v == null ? "–" : String(v)),
};

const ROUND_COLUMNS = [
  ["round", "round", fmt.int],
  ["version", "version", fmt.int],
  ["status", "status", fmt.text],
  ["accuracy", "accuracy", fmt.acc],
  ["loss", "loss", fmt.acc],
  ["epsilon", "epsilon", fmt.eps],
  ["received", "received", fmt.int],
  ["rejected", "rejected", fmt.int],
  ["bytes_up", "bytes up", fmt.int],
  ["bytes_down", "bytes down", fmt.int],
  ["wire_up_p50", "up p50/dev", fmt.int],
  ["wire_up_p95", "up p95/dev", fmt.int],
  ["wire_up_max", "up max/dev", fmt.int],
  ["wire_down_p95", "down p95/dev", fmt.int],
  ["epsilon_device_max", "eps max/dev", fmt.eps],
];

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function column(key) {
  return records.map((r) => (typeof r[key] === "number" ? r[key] : null));
}

function xs() {
  const async_ = view && view.job.mode && view.job.mode !== "sync";
  return records.map((r, i) => (async_ ? r.version : r.round) ?? i);
}

// ---------------------------------------------------------------- charts

function compact(v) {
  if (v == null) return "";
  const a = Math.abs(v);
  if (a >= 1e9) return +(v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
  return +v.toPrecision(4) + "";
}

const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

function makeChart(id, series, opts) {
  const box = $(id);
  const width = Math.max(300, box.clientWidth - 4);
  const values = (u, vals) => vals.map(compact);
  const axes = [
    { label: view && view.job.mode && view.job.mode !== "sync" ? "version" : "round", incrs: INTEGER_STEPS },
    { size: 60, values },
  ];
  if (opts.y2) axes.push({ side: 1, scale: "y2", grid: { show: false }, size: 60, values });
  const scales = { x: { time: false }, y: opts.log ? { distr: 3 } : {} };
  if (opts.y2) scales.y2 = {};
  const u = new uPlot({ width, height: 220, series: [{}, ...series], axes, scales, legend: { live: false } },
    [[], ...series.map(() => [])], box);
  return u;
}

function logNeeded(columns) {
  let lo = Infinity, hi = 0;
  for (const col of columns) for (const v of col) if (v != null && v > 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return hi > 0 && hi / lo > 100; // series more than two orders of magnitude apart
}

function drawCharts() {
  const x = xs();
  if (!charts.acc) {
    charts.acc = makeChart("chart-acc", [
      { label: "accuracy", stroke: "#2f6fde", width: 2 },
      { label: "loss", stroke: "#d9822b", scale: "y2", width: 2 },
    ], { y2: true });
  }
  charts.acc.setData([x, column("accuracy"), column("loss")]);

  const budget = view.job.budget;
  const eps = [
    ["epsilon", "job (worst device)", "#b42318"],
    ["epsilon_device_p50", "device p50", "#7a5af8"],
    ["epsilon_device_p95", "device p95", "#9e77ed"],
    ["epsilon_device_max", "device max", "#d6bbfb"],
  ].filter(([key]) => key === "epsilon" || records.some((r) => typeof r[key] === "number"));
  const epsCols = eps.map(([key]) => column(key));
  if (budget != null) epsCols.push(x.map(() => budget));
  const log = logNeeded(epsCols);
  const shape = eps.map(([k]) => k).join() + (budget != null) + log;
  if (charts.epsShape !== shape) {
    if (charts.eps) charts.eps.destroy();
    const series = eps.map(([, label, stroke]) => ({ label, stroke, width: 2 }));
    if (budget != null) series.push({ label: "budget", stroke: "#444", dash: [6, 4], width: 1 });
    charts.eps = makeChart("chart-eps", series, { log });
    charts.epsShape = shape;
    $("eps-scale").textContent = log ? "(log scale: values span over two orders of magnitude)" : "";
  }
  charts.eps.setData([x, ...epsCols.map((c) => (log ? c.map((v) => (v > 0 ? v : null)) : c))]);

  if (!charts.bytes) {
    charts.bytes = makeChart("chart-bytes", [
      { label: "bytes up", stroke: "#2f6fde", width: 2 },
      { label: "bytes down", stroke: "#1a7f37", width: 2 },
    ], {});
  }
  charts.bytes.setData([x, column("bytes_up"), column("bytes_down")]);

  if (!charts.dev) {
    charts.dev = makeChart("chart-dev", [
      { label: "up p50", stroke: "#2f6fde" },
      { label: "up p95", stroke: "#6b9cf0" },
      { label: "up max", stroke: "#a9c4f5" },
      { label: "down p50", stroke: "#1a7f37" },
      { label: "down p95", stroke: "#4cae6a" },
      { label: "down max", stroke: "#9ad4a8" },
    ], {});
  }
  charts.dev.setData([x, ...["up_p50", "up_p95", "up_max", "down_p50", "down_p95", "down_max"].map((k) => column("wire_" + k))]);
  const wire = records.some((r) => typeof r.wire_up_max === "number");
  $("dev-note").textContent = wire || !records.length ? ""
    : view.job.poisson ? "(not published with Poisson selection: it would count who took part)"
    : "(not in these records: a simulated fleet (edge-fl simulate) counts every device's wire bytes)";
  const perDevice = records.some((r) => typeof r.epsilon_device_max === "number");
  $("eps-note").textContent = view.job.mechanism === "none" ? "(no privacy mechanism: nothing is spent)"
    : perDevice || !records.length ? ""
    : (view.notes || {}).epsilon_device ? `(${view.notes.epsilon_device})`
    : view.redacted && view.job.poisson ? "(per device: operator only with Poisson selection)"
    : view.job.source === "run" ? ""
    : view.job.poisson ? "(per device: kept off the metrics topic with Poisson selection, it counts releases; `edge-fl dashboard RUN_DIR` on the aggregator's host shows it)"
    : "(per device: this aggregator's records do not carry it; the job's value is the worst device's)";
}

// ---------------------------------------------------------------- tables and cards

function cell(tr, key, value, show) {
  const td = el("td", { "data-field": key, "data-value": JSON.stringify(value ?? null) }, show(value));
  tr.appendChild(td);
}

function drawRounds() {
  const table = $("rounds");
  if (!table.tHead.rows.length) {
    const tr = el("tr");
    for (const [, title] of ROUND_COLUMNS) tr.appendChild(el("th", {}, title));
    table.tHead.appendChild(tr);
  }
  const body = el("tbody");
  for (const r of records.slice(-50).reverse()) {
    const tr = el("tr", { "data-round": String(r.round), "data-version": String(r.version) });
    for (const [key, , show] of ROUND_COLUMNS) cell(tr, key, r[key], show);
    body.appendChild(tr);
  }
  table.replaceChild(body, table.tBodies[0]);
}

function drawOperator() {
  const d = view.devices;
  for (const td of document.querySelectorAll("#devices td[data-count]")) {
    const v = d[td.dataset.count];
    td.textContent = v == null ? "secret" : fmt.int(v);
    td.dataset.value = JSON.stringify(v ?? null);
    td.title = v == null ? "Poisson selection: devices choose themselves with secret coins" : "";
  }
  $("devices-asof").textContent = "from " + d.as_of;
  const reasons = Object.entries(d.stopped_by_reason || {}).map(([k, v]) => `${k}: ${v}`);
  $("stopped-reasons").textContent = reasons.length ? "stopped: " + reasons.join(", ") : "";

  const rej = el("tbody");
  const samples = view.rejections.samples || {};
  const reasonsAll = new Set([...Object.keys(view.rejections.by_reason), ...Object.keys(samples)]);
  for (const reason of reasonsAll) {
    const tr = el("tr", { "data-reason": reason });
    tr.appendChild(el("td", {}, reason));
    cell(tr, "count", view.rejections.by_reason[reason] ?? null, fmt.int);
    tr.appendChild(el("td", {}, (samples[reason] || []).slice(-2).join(" | ")));
    rej.appendChild(tr);
  }
  if (!reasonsAll.size) rej.appendChild(el("tr", {}, null)).appendChild(el("td", { colspan: "3" }, "none"));
  $("rejections").replaceChild(rej, $("rejections").tBodies[0]);

  const wk = el("tbody");
  for (const [w, s] of Object.entries(view.ingest.workers)) {
    const tr = el("tr", { "data-worker": w });
    tr.appendChild(el("td", {}, w));
    tr.appendChild(el("td", {}, s));
    wk.appendChild(tr);
  }
  if (!Object.keys(view.ingest.workers).length) {
    wk.appendChild(el("tr")).appendChild(el("td", { colspan: "2" }, view.job.workers_configured ? "none seen" : "no ingest workers (the aggregator ingests alone)"));
  }
  $("workers").replaceChild(wk, $("workers").tBodies[0]);
  const miss = view.ingest.missing;
  $("missing").textContent = (miss.length ? "missing shares in the last round: " + miss.join(", ") + ". " : "")
    + `rounds with missing shares: ${view.ingest.missing_rounds}`;

  const last = records[records.length - 1] || {};
  const pd = el("tbody");
  for (const dir of ["up", "down"]) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, `wire ${dir}`));
    for (const q of ["p50", "p95", "max"]) cell(tr, `wire_${dir}_${q}`, last[`wire_${dir}_${q}`], fmt.int);
    pd.appendChild(tr);
  }
  $("perdevice").replaceChild(pd, $("perdevice").tBodies[0]);
}

function drawCards() {
  const j = view.job, c = view.current, last = records[records.length - 1] || {};
  $("job").textContent = j.job;
  document.title = `edge-fl ${j.job}`;
  const parts = [j.source === "run" ? "run directory" : "live", j.mode, j.mechanism && `mechanism ${j.mechanism}`,
    j.poisson ? "Poisson selection" : null, j.devices_configured && `${j.devices_configured} devices`];
  $("meta").textContent = parts.filter(Boolean).join(" · ");
  const sync = !j.mode || j.mode === "sync";
  const rnd = sync ? (c.round ?? last.round) : (c.version ?? last.version);
  const done = c.done || (j.rounds != null && last.round >= j.rounds && sync);
  $("progress").textContent = rnd == null ? "–" : `${sync ? "round" : "version"} ${rnd}${j.rounds ? " / " + j.rounds : ""}${done ? " (done)" : ""}`;
  $("progress").dataset.value = JSON.stringify(rnd ?? null);
  $("progressbar").style.width = j.rounds && rnd != null ? Math.min(100, (100 * rnd) / j.rounds) + "%" : "0";
  $("accuracy").textContent = fmt.acc(last.accuracy);
  $("accuracy").dataset.value = JSON.stringify(last.accuracy ?? null);
  $("loss").textContent = last.loss == null ? "" : "loss " + fmt.acc(last.loss);
  const eps = last.epsilon ?? (view.summary || {}).epsilon;
  $("epsilon").textContent = fmt.eps(eps);
  $("epsilon").dataset.value = JSON.stringify(eps ?? null);
  const sub = [];
  if (last.accountant) sub.push(`${last.accountant}, delta ${last.delta}`);
  if (j.budget != null) sub.push(`budget ${j.budget}`);
  if (j.target_epsilon != null) sub.push(`target ${j.target_epsilon}`);
  $("epsilon-sub").textContent = sub.join(" · ");
  $("redacted").hidden = !view.redacted;
  for (const s of document.querySelectorAll(".operator")) s.hidden = !!view.redacted;
  drawDeadline();
}

function drawDeadline() {
  if (!view) return;
  const c = view.current;
  if (c.done) { $("deadline").textContent = "job done"; $("deadline-sub").textContent = ""; return; }
  if (c.ends_at == null) { $("deadline").textContent = "–"; return; }
  const left = c.ends_at - Date.now() / 1000;
  $("deadline").textContent = left > 0 ? `${left.toFixed(0)} s left` : "passed";
  $("deadline-sub").textContent = `round ${c.round}: ${c.deadline_s} s from ${new Date(c.issued_at * 1000).toLocaleTimeString()}`;
}

// ---------------------------------------------------------------- the stream

function apply(v) {
  const t0 = performance.now();
  records.length = Math.min(records.length, v.records_from ?? 0);
  records.push(...v.records);
  view = v;
  drawCards();
  drawCharts();
  drawRounds();
  if (!v.redacted) drawOperator();
  stats.rendered += 1;
  stats.lastSeq = v.seq;
  stats.renderMs += performance.now() - t0;
  const now = Date.now();
  stats.times.push(now);
  while (stats.times.length && stats.times[0] < now - 10000) stats.times.shift();
  $("rate").textContent = `${(stats.times.length / 10).toFixed(1)} updates/s rendered (last 10 s)`;
  document.body.dataset.seq = String(v.seq);
  document.body.dataset.records = String(records.length);
}

function connect() {
  const source = new EventSource("/events");
  source.addEventListener("view", (e) => {
    const v = JSON.parse(e.data);
    const broker = v.connected === false ? " (broker unreachable)" : "";
    $("conn").textContent = (v.job.source === "run" ? "following the run directory" : "live") + broker;
    $("conn").className = broker ? "conn bad" : "conn ok";
    document.body.dataset.connected = JSON.stringify(v.connected);
    apply(v);
  });
  source.onerror = () => {
    $("conn").textContent = "reconnecting…";
    $("conn").className = "conn bad";
  };
}

setInterval(drawDeadline, 1000);
window.addEventListener("resize", () => {
  for (const k of ["acc", "eps", "bytes", "dev"]) {
    const u = charts[k];
    if (u) u.setSize({ width: Math.max(300, u.root.parentNode.clientWidth - 4), height: 220 });
  }
});
connect();
