// The Paceline console: reads the /v1 API with the token the user gives (kept for this
// tab only, sent as a bearer header, never a cookie) and shows every value as text.
"use strict";

const TOKEN_KEY = "paceline-token";
const CHART_POINTS = 300;
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(TOKEN_KEY) || "";
let timers = [];
let eventsAbort = null;
let callsSeen = 0;
const charts = new Map();
// When each lane's calls were seen (the last RATE_WINDOW_MS), for its rate.
const RATE_WINDOW_MS = 10000;
const callTimes = new Map();

function noteCalls(calls) {
  const now = Date.now();
  for (const call of calls) {
    const lane = call.lane || "default";
    if (!callTimes.has(lane)) callTimes.set(lane, []);
    callTimes.get(lane).push(now);
  }
}

function laneRate(lane) {
  const times = callTimes.get(lane) || [];
  const since = Date.now() - RATE_WINDOW_MS;
  while (times.length && times[0] < since) times.shift();
  return (times.length / (RATE_WINDOW_MS / 1000)).toFixed(1);
}

function say(text, ok) {
  $("message").textContent = text;
  $("message").className = ok ? "ok" : "";
}

async function api(method, path, body) {
  const headers = { Authorization: "Bearer " + token };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let answer = null;
  try { answer = await response.json(); } catch (_) { answer = null; }
  if (response.status === 401) {
    disconnect();
    throw new Error("wrong token: " + (answer && answer.error || "401"));
  }
  if (!response.ok) throw new Error((answer && answer.error) || ("HTTP " + response.status));
  return answer;
}

// A table row of text cells.
function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell === null || cell === undefined ? "–" : String(cell);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function chartFor(tier) {
  if (charts.has(tier)) return charts.get(tier);
  const box = document.createElement("div");
  box.className = "tier";
  const title = document.createElement("h3");
  title.textContent = tier;
  const figure = document.createElement("p");
  figure.className = "tier-figure";
  box.append(title, figure);
  $("tiers").appendChild(box);
  const data = [[], [], []];
  const plot = typeof uPlot === "function" ? new uPlot({
    width: 360, height: 160,
    series: [{}, { label: "used", stroke: "#2563eb", width: 2 }, { label: "limit", stroke: "#a1261a", dash: [6, 4] }],
    axes: [{}, { size: 50 }],
    scales: { y: { range: (_, min, max) => [0, Math.max(1, max) * 1.1] } },
  }, data, box) : null;
  const chart = { data, plot, figure };
  charts.set(tier, chart);
  return chart;
}

function showTiers(tiers) {
  const now = Date.now() / 1000;
  for (const tier of tiers) {
    const chart = chartFor(tier.tier);
    const used = tier.used === null || tier.used === undefined ? 0 : tier.used;
    chart.figure.textContent = used + " / " + tier.limit + " used";
    chart.data[0].push(now); chart.data[1].push(used); chart.data[2].push(tier.limit);
    if (chart.data[0].length > CHART_POINTS) chart.data.forEach((series) => series.shift());
    if (chart.plot) chart.plot.setData(chart.data);
  }
}

function showCircuit(circuit) {
  const state = $("circuit-state");
  if (!circuit) { state.textContent = "per lane (see Lanes)"; state.className = ""; $("circuit-detail").textContent = ""; return; }
  state.textContent = circuit.status;
  state.className = "state-" + circuit.status;
  $("circuit-detail").textContent = "epoch " + circuit.epoch + (circuit.reason ? ": " + circuit.reason : "") + (circuit.held ? " (held)" : "");
}

function showLanes(lanes) {
  $("lanes-section").hidden = !lanes;
  if (!lanes) return;
  fill($("lanes"), lanes.map((lane) => row([
    lane.lane, lane.weight, lane.tiers.join(" + "),
    lane.backlog ? lane.backlog.visible : null, lane.backlog ? lane.backlog.not_visible : null, lane.backlog ? lane.backlog.dead : null,
    laneRate(lane.lane), lane.circuit + (lane.circuit_held ? " (held)" : ""),
  ])));
}

async function refreshStatus() {
  const status = await api("GET", "/v1/status");
  $("queue-ready").textContent = status.queue.visible;
  $("queue-in-flight").textContent = status.queue.not_visible;
  $("queue-dead").textContent = status.queue.dead + (status.worker_dead ? " + " + status.worker_dead + " (worker)" : "");
  showTiers(status.tiers);
  showCircuit(status.circuit);
  showLanes(status.lanes);
}

function redriveButton(group) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "redrive";
  button.textContent = "Redrive";
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      const done = await api("POST", "/v1/dlq/redrive", { dlq: group.source, cause: [group.cause] });
      say("redrove " + done.done + " dead letter(s) of " + group.cause + " to the jobs queue", true);
      await refreshDlq();
    } catch (e) { say(e.message); } finally { button.disabled = false; }
  });
  return button;
}

async function refreshDlq() {
  const dlq = await api("GET", "/v1/dlq?limit=50");
  fill($("dlq-causes"), dlq.summary.map((group) => row([group.source, group.cause, group.count, group.last_seen, group.example, redriveButton(group)])));
  fill($("dlq-records"), dlq.records.map((record) => {
    const tr = row([record.dead_at, record.cause, record.job_id, record.detail]);
    tr.className = "selectable";
    tr.addEventListener("click", () => {
      const detail = $("dlq-detail");
      detail.textContent = JSON.stringify(record, null, 2);
      detail.hidden = false;
    });
    return tr;
  }));
}

async function searchResults(event) {
  if (event) event.preventDefault();
  const query = new URLSearchParams({ limit: "100" });
  for (const [name, id] of [["job", "results-job"], ["lane", "results-lane"], ["status", "results-status"]]) {
    if ($(id).value.trim()) query.set(name, $(id).value.trim());
  }
  try {
    const page = await api("GET", "/v1/results?" + query);
    fill($("results"), page.records.map((record) => {
      const body = record.body === null || record.body === undefined ? "" : (typeof record.body === "string" ? record.body : JSON.stringify(record.body));
      return row([record.times.answered, record.job_id, record.lane || "default", record.outcome, record.status, record.attempts, body || record.reason || ""]);
    }));
  } catch (e) { say(e.message); }
}

function logLine(text) {
  const item = document.createElement("li");
  item.textContent = new Date().toLocaleTimeString() + " " + text;
  const list = $("events");
  list.prepend(item);
  while (list.children.length > 200) list.lastChild.remove();
}

function logEvent(name, data) {
  if (name === "calls") {
    callsSeen += data.calls.length;
    noteCalls(data.calls);
    $("calls-seen").textContent = callsSeen;
    for (const call of data.calls) logLine("call " + call.job_id + " " + call.outcome + " " + (call.status === null ? "no answer" : call.status));
  } else if (name === "dead_letters") {
    for (const dead of data.dead_letters) logLine("dead letter " + dead.job_id + " " + (dead.reason || ""));
  } else if (name === "circuit") {
    logLine("circuit " + data.lane + " " + data.status + " (" + data.reason + ")");
  } else if (name === "queue") {
    logLine("queue: ready " + data.ready + ", in flight " + data.in_flight + ", dead " + data.dead);
  }
}

// Server-sent events read with fetch, so that the token goes in a header.
async function followEvents() {
  eventsAbort = new AbortController();
  try {
    const response = await fetch("/v1/events", { headers: { Authorization: "Bearer " + token }, signal: eventsAbort.signal });
    if (!response.ok) return;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data += line.slice(5).trim();
        }
        if (data) { try { logEvent(name, JSON.parse(data)); } catch (_) { /* a lagged count */ } }
      }
    }
  } catch (_) { /* closed */ }
}

function every(ms, work) {
  const run = () => work().catch((e) => say(e.message));
  run();
  timers.push(setInterval(run, ms));
}

async function connect() {
  try {
    await api("GET", "/v1/status");
  } catch (e) { say(e.message); return; }
  sessionStorage.setItem(TOKEN_KEY, token);
  say("connected", true);
  $("console").hidden = false;
  $("logout").hidden = false;
  every(1000, refreshStatus);
  every(3000, refreshDlq);
  searchResults();
  followEvents();
}

function disconnect() {
  timers.forEach(clearInterval);
  timers = [];
  if (eventsAbort) eventsAbort.abort();
  sessionStorage.removeItem(TOKEN_KEY);
  $("console").hidden = true;
  $("logout").hidden = true;
}

async function circuit(action) {
  const lane = $("circuit-lane").value.trim() || undefined;
  const body = action === "open" ? { lane, hold: true, reason: "console" } : { lane };
  try {
    const answer = await api("POST", "/v1/circuit/" + action, body);
    say(answer.said, true);
    await refreshStatus();
  } catch (e) { say(e.message); }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    token = $("token").value.trim();
    disconnect();
    connect();
  });
  $("logout").addEventListener("click", () => { disconnect(); token = ""; say("token forgotten", true); });
  $("results-search").addEventListener("submit", searchResults);
  $("circuit-hold").addEventListener("click", () => circuit("open"));
  $("circuit-close").addEventListener("click", () => circuit("close"));
  if (token) connect();
});
