// fairgate's built-in dashboard: polls /admin/summary and shows it.
// Every value is set as text (textContent), never as markup: model names
// and rule ids come from outside.
"use strict";

const POLL_MS = 2000;
const TREND_POINTS = 150;
const TOKEN_KEY = "fairgate-admin-token";

let previous = null;
const trend = [];

const $ = (id) => document.getElementById(id);

function setText(id, text) {
  $(id).textContent = text;
}

function setStatus(text, failed) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(failed));
}

function number(n) {
  return n == null ? "–" : Number(n).toLocaleString("en");
}

function ms(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return "–";
  return value < 1 ? `${(value * 1000).toFixed(0)} µs` : `${value.toFixed(value < 10 ? 2 : 0)} ms`;
}

// A number with `digits` decimals; a dash for none (JSON writes NaN as null).
function fixed(n, digits) {
  return typeof n === "number" && Number.isFinite(n) ? n.toFixed(digits) : "–";
}

function percent(part, whole) {
  return whole > 0 ? `${((100 * part) / whole).toFixed(2)}%` : "–";
}

function time(msSinceEpoch) {
  return new Date(msSinceEpoch).toLocaleTimeString();
}

// Fills a table: a header row, then one row per entry of `rows` (arrays of
// cells: a string, a number, or {text, cls}).
function table(id, headings, rows, empty) {
  const element = $(id);
  element.replaceChildren();
  const head = element.createTHead().insertRow();
  headings.forEach((heading) => {
    const th = document.createElement("th");
    th.textContent = heading;
    if (heading.startsWith("#")) th.className = "n";
    head.appendChild(th);
  });
  const body = element.createTBody();
  if (rows.length === 0) {
    const cell = body.insertRow().insertCell();
    cell.colSpan = headings.length;
    cell.className = "empty";
    cell.textContent = empty || "none yet";
    return;
  }
  rows.forEach((row) => {
    const tr = body.insertRow();
    row.forEach((value) => {
      const cell = tr.insertCell();
      if (typeof value === "number") {
        cell.className = "n";
        cell.textContent = number(value);
      } else if (value && typeof value === "object") {
        cell.textContent = value.text;
        cell.className = value.cls || "";
      } else {
        cell.textContent = value == null ? "" : String(value);
      }
    });
  });
}

function pairs(object) {
  return Object.entries(object || {}).sort((a, b) => b[1] - a[1]);
}

function renderTrend() {
  const svg = $("trend");
  svg.replaceChildren();
  if (trend.length < 2) return;
  const top = Math.max(1, ...trend.map((point) => point.requests));
  const x = (i) => (600 * i) / (TREND_POINTS - 1);
  const y = (v) => 86 - (82 * v) / top;
  for (const key of ["requests", "blocks"]) {
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    const offset = TREND_POINTS - trend.length;
    line.setAttribute("points", trend.map((p, i) => `${x(offset + i)},${y(p[key])}`).join(" "));
    line.setAttribute("class", key === "requests" ? "all" : "block");
    svg.appendChild(line);
  }
}

function render(summary) {
  const requests = summary.requests;
  const blocked = requests.by_verdict.block || 0;
  const rules = summary.rules;
  const reload = rules.reload || {};
  setText("rules", `rules ${rules.version} · ${rules.loaded} loaded`);
  if (reload.last_error) {
    setStatus(`last reload failed: ${reload.last_error}`, true);
  } else {
    setStatus(`updated ${time(summary.generated_ms)}`);
  }

  setText("requests", number(requests.total));
  setText("blocked", number(blocked));
  setText("block-share", `${percent(blocked, requests.total)} of requests`);
  if (previous) {
    const seconds = (summary.generated_ms - previous.generated_ms) / 1000;
    if (seconds > 0) {
      const rate = Math.max(0, requests.total - previous.requests.total) / seconds;
      const blockRate = Math.max(0, blocked - (previous.requests.by_verdict.block || 0)) / seconds;
      setText("request-rate", `${rate.toFixed(1)}/s now, ${blockRate.toFixed(1)} blocked/s`);
      trend.push({ requests: rate, blocks: blockRate });
      if (trend.length > TREND_POINTS) trend.shift();
      renderTrend();
    }
  }

  const latency = summary.latency;
  setText("added", `p99 ${ms(latency.added.p99_ms)}`);
  setText("added-detail", `p50 ${ms(latency.added.p50_ms)} · ${number(latency.added.count)} exchanges`);
  setText("upstream", `p99 ${ms(latency.upstream.p99_ms)}`);
  setText("upstream-detail", `p50 ${ms(latency.upstream.p50_ms)}`);
  setText("first-byte", `p99 ${ms(latency.stream_first_byte.p99_ms)}`);
  setText("first-byte-detail", `p50 ${ms(latency.stream_first_byte.p50_ms)} · ${number(latency.stream_first_byte.count)} streams`);
  const queue = summary.queue;
  const records = queue.records || {};
  setText("queue", `${number(queue.depth)} waiting`);
  setText(
    "queue-detail",
    `lag p99 ${ms(queue.lag.p99_ms)} · spilled ${number(records.spilled || 0)} · dropped ${number(records.dropped || 0)}`,
  );

  table("verdicts", ["verdict", "#requests", "share"],
    pairs(requests.by_verdict).map(([verdict, n]) => [verdict, n, percent(n, requests.total)]));
  table("scopes", ["scope", "#blocks"], pairs(summary.blocks.by_scope));
  table("routes", ["route", "#requests", "#blocked"],
    Object.entries(requests.by_route).map(([route, verdicts]) => [
      route,
      Object.values(verdicts).reduce((a, b) => a + b, 0),
      verdicts.block || 0,
    ]));
  table("models", ["model", "#requests", "#blocked"],
    Object.entries(requests.by_model).map(([model, verdicts]) => [
      model,
      Object.values(verdicts).reduce((a, b) => a + b, 0),
      verdicts.block || 0,
    ]));
  table("top-rules", ["rule", "category", "scope", "action", "#hits"],
    summary.top_rules.map((r) => [r.rule, r.category, r.scope, r.action, r.hits]));
  table("recent", ["time", "request id", "route", "model", "blocked", "rules", "#risk"],
    summary.recent_blocks.map((b) => [
      { text: time(b.finished_ms), cls: "time" },
      { text: b.request_id, cls: "id" },
      b.stream ? `${b.route} (stream)` : b.route,
      b.model || "",
      b.scope,
      b.rules.map((r) => `${r.rule} (${r.action})`).join(", "),
      { text: fixed(b.risk, 2), cls: "n" },
    ]), "no blocked exchange since the proxy started");
  const errors = [
    ...pairs(summary.errors.upstream).map(([kind, n]) => ["upstream", kind, n]),
    ...pairs(summary.errors.stream).map(([kind, n]) => ["stream", kind, n]),
    ...pairs(summary.errors.fault).map(([stage, n]) => ["fairgate", `fault (${stage})`, n]),
    ...pairs(summary.errors.answered).map(([code, n]) => ["answered", code, n]),
    ...(summary.stream_ends.client_closed
      ? [["client", "left a stream before its end", summary.stream_ends.client_closed]] : []),
    ...(reload.failures ? [["rules", "reload failed", reload.failures]] : []),
  ];
  table("errors", ["where", "kind", "#count"], errors);
  table("risk", ["scope", "mean", "#exchanges"],
    Object.entries(summary.risk).map(([scope, r]) => [scope, { text: fixed(r.mean, 3), cls: "n" }, r.count]));
  table("quality", ["metric", "mean", "#scores"],
    Object.entries(summary.quality).map(([metric, q]) => [metric, { text: fixed(q.mean, 3), cls: "n" }, q.count]));
}

async function poll() {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetch("/admin/summary", { headers, cache: "no-store" });
    if (response.status === 401) {
      $("login").hidden = false;
      setStatus(token ? "the admin token was refused" : "an admin token is required", true);
      return;
    }
    if (!response.ok) {
      setStatus(`summary: HTTP ${response.status}`, true);
      return;
    }
    $("login").hidden = true;
    const summary = await response.json();
    render(summary);
    previous = summary;
  } catch (error) {
    setStatus(`fairgate is unreachable (${error.message})`, true);
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  poll();
});

poll();
setInterval(poll, POLL_MS);
