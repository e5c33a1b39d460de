// The ftune dashboard: a dependency-free page over the same /v1 API the CLI uses.
// The API key stays in this browser's localStorage and is sent as a Bearer header.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => (
  { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const MAX_EVENTS = 50000;
let timer = null;
let generation = 0; // bumped by every route(): a slower, older render must not land
let eventCache = { id: null, events: [], after: null };

function apiKey() { return localStorage.getItem("ftune.apiKey") || ""; }

async function api(path, opts = {}) {
  const headers = Object.assign({ Authorization: `Bearer ${apiKey()}` }, opts.headers || {});
  const resp = await fetch(path, Object.assign({}, opts, { headers }));
  if (!resp.ok) {
    let body = null;
    try { body = await resp.json(); } catch (_) { /* not JSON */ }
    const err = (body && body.error) || { message: resp.statusText };
    const details = (err.details || []).map((d) => `\n  - ${d.param}: ${d.message}`).join("");
    throw new Error(`${resp.status} ${err.code || ""}: ${err.message}${details}`);
  }
  return resp;
}
const getJSON = async (path) => (await api(path)).json();
const isNum = (x) => typeof x === "number" && Number.isFinite(x);

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "–";
  return typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(digits)) : esc(x);
}
function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`
    : s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}
function statusBadge(s) { return `<span class="status ${esc(s)}">${esc(s)}</span>`; }
// <progress>, not a styled div: the CSP allows no inline style attributes.
function bar(pct) {
  const v = isNum(pct) ? Math.max(0, Math.min(100, pct)) : 0;
  return `<progress class="bar" max="100" value="${v.toFixed(1)}"></progress>`;
}
function percent(pct) { return isNum(pct) ? `${pct.toFixed(1)}%` : "–"; }

// Three significant digits, whatever the scale (a learning rate of 2e-5 is not "0.000"),
// short enough for the room left of the axis: small and large values in exponent form
// ("1.23e-6", not "0.00000123").
function axis(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return esc(v.toExponential(2).replace(/\.?0+e/, "e"));
  return esc(String(Number(v.toPrecision(3))));
}

// A line chart in plain SVG: one or more series of [x, y] points; ``footer``: HTML under it.
function chart(title, series, footer = "") {
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) return `<div class="card"><h3>${esc(title)}</h3><p class="muted">no data yet</p>${footer}</div>`;
  const W = 600, H = 300, P = 36, L = 110; // L: room for the y labels
  // Loops, not Math.min(...xs): spreading tens of thousands of points overflows the stack.
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const [x, y] of pts) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - P);
  const sy = (y) => H - P - ((y - y0) / (y1 - y0)) * (H - 2 * P);
  const colors = ["#2563eb", "#dc2626", "#16a34a"];
  const lines = series.map((s, i) => s.points.length
    ? `<polyline fill="none" stroke="${colors[i % 3]}" stroke-width="1.8" points="${
      s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ")}"/>` : "").join("");
  // Only series that have points: an "eval" entry with no eval data says something false.
  const legend = series.map((s, i) => s.points.length
    ? `<tspan fill="${colors[i % 3]}">■ ${esc(s.name)} </tspan>` : "").join("");
  return `<div class="card"><h3>${esc(title)}</h3><svg class="chart" viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(title)}">
    <line x1="${L}" y1="${H - P}" x2="${W - P}" y2="${H - P}" stroke="#ccc"/>
    <line x1="${L}" y1="${P}" x2="${L}" y2="${H - P}" stroke="#ccc"/>
    <text x="${L - 8}" y="${P + 8}" text-anchor="end">${axis(y1)}</text>
    <text x="${L - 8}" y="${H - P}" text-anchor="end">${axis(y0)}</text>
    <text x="${L}" y="${H - 6}">step ${fmt(x0)}</text>
    <text x="${W - P}" y="${H - 6}" text-anchor="end">step ${fmt(x1)}</text>
    <text x="${L}" y="22">${legend}</text>${lines}</svg>${footer}</div>`;
}

// The spec's evaluation as it ran (job.evaluation, core/evals/job_evaluation.py): each eval
// and criterion's pass rate by step, the base model at step 0 and the final model at the
// job's last step, so a curve shows which checkpoint was best and whether training helped.
function evaluationSeries(evaluation, lastStep) {
  const series = new Map();
  for (const s of (evaluation && evaluation.scores) || []) {
    const x = s.stage === "base" ? 0 : s.stage === "final" ? lastStep : s.step;
    for (const [name, c] of Object.entries(s.criteria || {})) {
      if (!isNum(x) || !isNum((c || {}).pass_rate)) continue; // none graded: no point
      const key = `${s.eval_id} ${name}`;
      if (!series.has(key)) series.set(key, []);
      series.get(key).push([x, c.pass_rate]);
    }
  }
  return [...series].map(([name, points]) => ({ name, points: points.sort((a, b) => a[0] - b[0]) }));
}

function evaluationCard(job) {
  const ev = job.evaluation;
  if (!ev) return "";
  const steps = (ev.scores || []).map((s) => s.step).filter(isNum);
  const last = Math.max(job.progress && isNum(job.progress.step) ? job.progress.step : 0, ...steps);
  const said = ev.best ? `<p id="evalbest">${esc(ev.best.reason)}</p>`
    : ev.error ? `<p id="evalbest" class="error">${esc(ev.error)}</p>`
    : `<p id="evalbest" class="muted">evaluation ${esc(ev.status)}</p>`;
  return chart("Evaluation (pass rate)", evaluationSeries(ev, last), said);
}

async function showJobs(current) {
  const view = $("#view");
  const page = await getJSON("/v1/jobs?limit=50");
  if (!current()) return;
  const rows = page.data.map((j) => {
    const p = j.progress || {}, m = j.metrics || {};
    return `<tr><td><a href="#/jobs/${esc(j.id)}">${esc(j.id)}</a></td><td>${esc(j.name || "")}</td>
      <td>${statusBadge(j.status)}</td><td>${bar(p.percent)}<span class="muted">${fmt(p.step)}/${fmt(p.total_steps)}</span></td>
      <td>${fmt(m.train_loss)}</td><td>${duration(p.eta_seconds)}</td><td class="muted">${esc(j.created_at)}</td></tr>`;
  }).join("");
  view.innerHTML = `<h2>Jobs</h2><table id="jobs"><thead><tr><th>id</th><th>name</th><th>status</th>
    <th>progress</th><th>loss</th><th>ETA</th><th>created</th></tr></thead>
    <tbody>${rows || '<tr><td colspan="7" class="muted">No jobs yet.</td></tr>'}</tbody></table>`;
  timer = setTimeout(() => route(), 3000);
}

// The fleet, for admin keys (a tenant key gets 403 from /v1/workers and sees a note).
async function showWorkers(current) {
  const view = $("#view");
  const resp = await fetch("/v1/workers", { headers: { Authorization: `Bearer ${apiKey()}` } });
  if (!current()) return;
  if (resp.status === 403) {
    view.innerHTML = '<h2>Workers</h2><p class="muted">Workers are shown to admin keys only.</p>';
    return;
  }
  if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
  const page = await resp.json();
  const rows = page.data.map((w) => {
    const gpus = w.gpus.map((g) => `${esc(g.index)}: ${esc(g.name)} ${
      g.job_id ? `<a href="#/jobs/${esc(g.job_id)}">${esc(g.job_id)}</a>` : '<span class="muted">free</span>'}`).join("<br>");
    return `<tr><td>${esc(w.id)}</td><td>${esc(w.host)}</td><td>${statusBadge(w.state)}</td>
      <td>${gpus || '<span class="muted">CPU only</span>'}</td><td>${esc(w.cpu_cores)}</td>
      <td>${esc(w.running_jobs.length)} / ${esc(w.slots)}</td><td class="muted">${esc(w.heartbeat_at)}</td></tr>`;
  }).join("");
  view.innerHTML = `<h2>Workers</h2><table id="workers"><thead><tr><th>id</th><th>host</th><th>state</th>
    <th>GPUs and their jobs</th><th>cores</th><th>jobs / slots</th><th>heartbeat</th></tr></thead>
    <tbody>${rows || '<tr><td colspan="7" class="muted">No worker registered.</td></tr>'}</tbody></table>`;
  timer = setTimeout(() => route(), 3000);
}

// Every event of the job on screen, fetched incrementally: only those after the last one seen.
async function jobEvents(id) {
  if (eventCache.id !== id) eventCache = { id, events: [], after: null };
  const cache = eventCache;
  for (let pages = 0; pages < 20; pages++) {
    const after = cache.after === null ? "" : `&after=${cache.after}`;
    const page = await getJSON(`/v1/jobs/${id}/events?limit=1000${after}`);
    for (const e of page.data) {
      if (cache.after === null || e.id > cache.after) { cache.events.push(e); cache.after = e.id; }
    }
    if (!page.has_more) break;
  }
  if (cache.events.length > MAX_EVENTS) cache.events.splice(0, cache.events.length - MAX_EVENTS);
  return cache.events;
}

// Preference objectives (dpo/orpo/kto) log these with each progress event.
const REWARDS = [["reward_chosen", "chosen"], ["reward_rejected", "rejected"], ["reward_margin", "margin"]];

function eventSeries(events) {
  const loss = [], evalLoss = [], lr = [], tps = [], acc = [];
  // grpo: the grader's mean reward on training answers and on held-out prompts, answer length.
  const reward = [], evalReward = [], length = [];
  const rewards = Object.fromEntries(REWARDS.map(([k]) => [k, []]));
  for (const e of events) {
    const d = e.data || {};
    if (!isNum(d.step)) continue;
    if (e.type === "progress") {
      if (isNum(d.loss)) loss.push([d.step, d.loss]);
      if (isNum(d.learning_rate)) lr.push([d.step, d.learning_rate]);
      if (isNum(d.tokens_per_second)) tps.push([d.step, d.tokens_per_second]);
      for (const [k] of REWARDS) if (isNum(d[k])) rewards[k].push([d.step, d[k]]);
      if (isNum(d.reward_accuracy)) acc.push([d.step, d.reward_accuracy]);
      if (isNum(d.reward)) reward.push([d.step, d.reward]);
      if (isNum(d.completion_length)) length.push([d.step, d.completion_length]);
    }
    if (e.type === "eval" && isNum(d.eval_loss)) evalLoss.push([d.step, d.eval_loss]);
    if (e.type === "eval" && isNum(d.reward)) evalReward.push([d.step, d.reward]);
  }
  return { loss, evalLoss, lr, tps, rewards, acc, reward, evalReward, length };
}

// grpo: the latest sampled answers with their scores, and each grader's failures.
function graderCards(events) {
  const last = events.filter((e) => e.type === "grader" && (e.data || {}).phase === "train").slice(-1)[0];
  if (!last) return "";
  const d = last.data;
  const samples = (d.samples || []).map((x) => `<tr><td>${fmt(d.step)}</td><td>${fmt(x.row)}</td>
    <td>${fmt(x.reward, 3)}</td><td><pre>${esc(x.completion)}</pre></td>
    <td class="error">${esc(Object.entries(x.errors || {}).map(([k, v]) => `${k}: ${v}`).join("; "))}</td></tr>`).join("");
  const graders = Object.entries(d.graders || {}).map(([name, c]) => `<tr><td>${esc(name)}</td>
    <td>${fmt(c.calls)}</td><td>${fmt(c.errors)}</td><td>${fmt(c.out_of_range)}</td>
    <td class="muted">${esc(c.last_error ? `row ${c.last_error_row}: ${c.last_error}` : "")}</td></tr>`).join("");
  return `<div class="card" id="samples"><h3>Sampled answers</h3><table><thead><tr><th>step</th><th>row</th>
      <th>reward</th><th>answer</th><th>errors</th></tr></thead><tbody>${samples}</tbody></table></div>
    <div class="card" id="graders"><h3>Graders</h3><table><thead><tr><th>grader</th><th>calls</th><th>errors</th>
      <th>outside [0, 1]</th><th>last error</th></tr></thead><tbody>${graders}</tbody></table></div>`;
}

// Downloads need the Authorization header, so they go through fetch and a blob URL.
async function saveDownload(path, fallbackName) {
  const resp = await api(path);
  const named = /filename="([^"]+)"/.exec(resp.headers.get("Content-Disposition") || "");
  const url = URL.createObjectURL(await resp.blob());
  const a = document.createElement("a");
  a.href = url;
  a.download = named ? named[1] : fallbackName;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

function runLink(run) {
  const url = run && run.url;
  if (!url || !/^https?:\/\//.test(url)) return esc(run ? run.run_id : "–");
  return `<a href="${esc(url)}" target="_blank" rel="noopener">${esc(run.run_id)}</a>`;
}

function trackingCard(t) {
  if (!t) return "";
  return `<div class="card" id="tracking"><h3>Tracking</h3><div class="kv">
    ${t.tensorboard ? '<span>TensorBoard</span><span><button id="tensorboard">Download event files</button></span>' : ""}
    ${t.mlflow ? `<span>MLflow run</span><span>${runLink(t.mlflow)}</span>` : ""}
    ${t.wandb ? `<span>W&amp;B run</span><span>${runLink(t.wandb)}${t.wandb.mode === "offline" ? ' <span class="muted">(offline)</span>' : ""}</span>` : ""}
  </div></div>`;
}

async function showJob(id, current) {
  const view = $("#view");
  const [job, events, ckpts, logs, launch] = await Promise.all([
    getJSON(`/v1/jobs/${id}`),
    jobEvents(id),
    getJSON(`/v1/jobs/${id}/checkpoints`),
    getJSON(`/v1/jobs/${id}/logs?tail=80`).catch(() => ({ lines: [] })),
    getJSON(`/v1/jobs/${id}/launch`).catch(() => null), // 404 until launched
  ]);
  if (!current()) return;
  const p = job.progress || {}, m = job.metrics || {};
  const s = eventSeries(events);
  const err = job.error ? `<p class="error">${esc(job.error.code)}: ${esc(job.error.message)}</p>` : "";
  // Memory of the latest attempt only: its events follow the last "preparing_data" phase
  // (an attempt's first event); an earlier attempt's peaks are another run's.
  let since = -1;
  events.forEach((e, i) => { if (e.type === "phase" && (e.data || {}).phase === "preparing_data") since = i; });
  const mem = memoryPeaks(events.filter((e, i) => e.type === "memory" && i > since)).map((p) =>
    `<tr><td>${esc(p.phase)}</td><td>${fmt(p.rank)}</td><td>${fmt(p.cpu, 0)}</td>
      <td>${fmt(p.gpu, 0)}</td></tr>`).join("");
  const tryModels = job.status === "succeeded" && (job.adapter_available || job.model_available)
    ? await tryItModels(job) : [];
  if (!current()) return;
  view.innerHTML = `
    <h2>${esc(job.name || job.id)} ${statusBadge(job.status)}</h2>${err}
    <p>${bar(p.percent)} step ${fmt(p.step)} / ${fmt(p.total_steps)} · ${percent(p.percent)} · ETA ${duration(p.eta_seconds)}
      ${job.phase && job.phase.phase !== "training" ? `<span id="phase" class="muted">${esc(job.phase.message)}</span>` : ""}</p>
    <p>
      ${job.status === "queued" || job.status === "running" ? '<button id="pause">Pause</button>' : ""}
      ${job.status === "paused" ? '<button class="primary" id="resume">Resume</button>' : ""}
      ${TERMINAL.has(job.status) || job.status === "cancelling" ? "" : '<button class="danger" id="cancel">Cancel</button>'}
      ${job.adapter_available ? '<button class="primary" id="download">Download adapter</button>' : ""}
      ${job.model_available ? `whole model (resumable, with sha256 checks): <code>ftune download ${esc(job.id)}</code>` : ""}
    </p><p id="actionerr" class="error"></p>
    <div class="grid">
      ${chart("Loss", [{ name: "train", points: s.loss }, { name: "eval", points: s.evalLoss }])}
      ${chart("Learning rate", [{ name: "lr", points: s.lr }])}
      ${chart("Tokens per second", [{ name: "tokens/s", points: s.tps }])}
      ${s.rewards.reward_margin.length ? chart("Rewards", REWARDS.map(([k, name]) => ({ name, points: s.rewards[k] }))) : ""}
      ${s.acc.length ? chart("Reward accuracy", [{ name: "accuracy", points: s.acc }]) : ""}
      ${s.reward.length ? chart("Reward", [{ name: "train", points: s.reward }, { name: "held-out", points: s.evalReward }]) : ""}
      ${s.length.length ? chart("Answer length (tokens)", [{ name: "mean", points: s.length }]) : ""}
      ${graderCards(events)}
      ${evaluationCard(job)}
      <div class="card"><h3>Job</h3><div class="kv">
        <span>id</span><span>${esc(job.id)}</span><span>attempt</span><span>${fmt(job.attempt)}</span>
        <span>created</span><span>${esc(job.created_at)}</span><span>started</span><span>${esc(job.started_at || "–")}</span>
        <span>finished</span><span>${esc(job.finished_at || "–")}</span>
        <span>train loss</span><span>${fmt(m.train_loss)}</span><span>eval loss</span><span>${fmt(m.eval_loss)}</span>
        <span>learning rate</span><span>${fmt(m.learning_rate, 6)}</span>
        <span>tokens/s</span><span>${fmt(m.tokens_per_second, 1)}</span><span>peak memory MB</span><span>${fmt(m.peak_memory_mb, 0)}</span>
        ${m.preference ? `<span>objective</span><span>${esc((job.spec.training || {}).objective || "")}</span>
        ${isNum(m.preference.reward) ? `<span>reward</span><span>${fmt(m.preference.reward)}</span>
        <span>answer length</span><span>${fmt(m.preference.completion_length, 1)}</span>` : `
        <span>reward margin</span><span>${fmt(m.preference.reward_margin)}</span>
        <span>reward accuracy</span><span>${fmt(m.preference.reward_accuracy)}</span>`}` : ""}
      </div></div>
      <div class="card"><h3>Usage</h3><div class="kv">
        <span>tokens trained</span><span>${fmt((job.usage || {}).trained_tokens)}</span>
        <span>loss tokens</span><span>${fmt((job.usage || {}).loss_tokens)}</span>
        <span>epochs</span><span>${fmt((job.usage || {}).epochs, 3)}</span>
        <span>wall seconds</span><span>${fmt((job.usage || {}).wall_seconds, 0)}</span>
        <span>${(job.run || {}).device === "cpu" ? "CPU process-seconds" : "GPU-seconds"}</span><span>${fmt((job.usage || {}).gpu_seconds, 0)}</span>
        <span>attempts</span><span>${fmt((job.usage || {}).attempts)}</span>
        <span>cost</span><span>${(job.usage || {}).cost == null ? "–" : `${fmt(job.usage.cost, 4)} ${esc(job.usage.currency)}`}</span>
      </div></div>
      <div class="card"><h3>Memory (MB) of attempt ${fmt(job.attempt)}</h3><table><thead><tr><th>phase</th><th>rank</th><th>CPU peak</th><th>GPU peak</th></tr></thead>
        <tbody>${mem || '<tr><td colspan="4" class="muted">none yet</td></tr>'}</tbody></table></div>
      ${trackingCard(job.tracking)}
      <div class="card"><h3>Checkpoints</h3><table id="checkpoints"><thead><tr><th>step</th><th>created</th><th></th></tr></thead><tbody>
        ${ckpts.data.map((c) => `<tr><td>${fmt(c.step)}</td><td class="muted">${esc(c.created_at)}</td>
          <td>${c.adapter_available === false ? "" : `<button class="ckpt" data-step="${esc(c.step)}">Download</button>`}</td></tr>`).join("")
          || '<tr><td colspan="3" class="muted">none yet</td></tr>'}</tbody></table></div>
    </div>
    ${tryModels.length ? tryItCard(tryModels) : ""}
    <div class="card"><h3>Events</h3><pre id="events">${events.slice(-40).map((e) =>
      `${esc(e.created_at)} ${esc(e.type)} ${esc(eventText(e))}`).join("\n")}</pre></div>
    <div class="card"><h3>Log tail</h3><pre id="logs">${esc(logs.lines.join("\n"))}</pre></div>
    <div class="card"><h3>Launch</h3>${launch ? `<pre>${esc(launch.argv.join(" "))}\n\n${esc(launch.accelerate_yaml)}</pre>`
      : '<p class="muted">not launched yet</p>'}</div>
    <div class="card"><h3>Spec that runs (defaults filled)</h3><pre>${esc(JSON.stringify(job.spec, null, 2))}</pre></div>
    <div class="card"><h3>Run</h3><pre>${esc(JSON.stringify(job.run || null, null, 2))}</pre></div>`;
  const action = (btn, work) => {
    if (!btn) return;
    btn.onclick = async () => {
      btn.disabled = true;
      $("#actionerr").textContent = "";
      try { await work(); } catch (e) { $("#actionerr").textContent = e.message; }
      btn.disabled = false;
    };
  };
  action($("#cancel"), async () => { await api(`/v1/jobs/${id}/cancel`, { method: "POST" }); route(); });
  action($("#pause"), async () => { await api(`/v1/jobs/${id}/pause`, { method: "POST" }); route(); });
  action($("#resume"), async () => { await api(`/v1/jobs/${id}/resume`, { method: "POST" }); route(); });
  action($("#download"), () => saveDownload(`/v1/jobs/${id}/adapter`, `${id}-adapter.zip`));
  for (const btn of document.querySelectorAll("#checkpoints button.ckpt")) {
    const step = btn.dataset.step;
    action(btn, () => saveDownload(`/v1/jobs/${id}/adapter?checkpoint=${encodeURIComponent(step)}`,
      `${id}-checkpoint-${step}.zip`));
  }
  action($("#tensorboard"), () => saveDownload(`/v1/jobs/${id}/tensorboard`, `${id}-tensorboard.zip`));
  wireTryIt();
  if (!TERMINAL.has(job.status)) timer = setTimeout(() => route(), 2000);
}

// One row per phase and rank: the highest peak of its evaluations (a phase is measured
// at every evaluation; repeating each row said nothing more).
function memoryPeaks(events) {
  const rows = new Map();
  for (const e of events) {
    const d = e.data || {}, key = `${d.phase}/${d.rank}`;
    const row = rows.get(key) || { phase: d.phase, rank: d.rank, cpu: null, gpu: null };
    if (isNum(d.cpu_mb_peak)) row.cpu = Math.max(row.cpu ?? d.cpu_mb_peak, d.cpu_mb_peak);
    if (isNum(d.gpu_mb_peak)) row.gpu = Math.max(row.gpu ?? d.gpu_mb_peak, d.gpu_mb_peak);
    rows.set(key, row);
  }
  return [...rows.values()];
}

function eventText(e) {
  if (e.message) return e.message;
  const d = e.data || {};
  if (e.type === "memory") {
    const gpu = isNum(d.gpu_mb_peak) ? `, GPU peak ${Math.round(d.gpu_mb_peak)} MB` : "";
    return `${d.phase} (rank ${d.rank}): CPU peak ${isNum(d.cpu_mb_peak) ? Math.round(d.cpu_mb_peak) : "–"} MB${gpu}`;
  }
  return JSON.stringify(d);
}

// The fine-tuned model (by its job id) and, when the catalog offers it, its base model.
async function tryItModels(job) {
  const models = [["fine-tuned", esc(job.id)]];
  try {
    const base = ((job.spec || {}).model || {}).name_or_path;
    const found = (await getJSON("/v1/models")).data.find((m) => m.ftune_location && m.ftune_location === base);
    if (found) models.push(["base", esc(found.id)]);
  } catch (_) { /* the fine-tuned model alone */ }
  return models;
}

const EXAMPLE_SPEC = {
  name: "my job",
  model: { name_or_path: "/models/my-model", task: "causal_lm" },
  dataset: { file_id: "file-...", format: "auto", max_seq_length: 512 },
  peft: { method: "lora", r: 8, lora_alpha: 16, target_modules: "all-linear" },
  training: { num_train_epochs: 1, learning_rate: 0.0002, per_device_train_batch_size: 8 },
  distributed: { strategy: "none", num_processes: 1 },
};

// One key per spec text: a double click or a retry of the same spec replays the job
// instead of queueing it twice; editing the spec starts a new submission.
function newIdempotencyKey() {
  if (crypto.randomUUID) return crypto.randomUUID(); // only in secure contexts (https, localhost)
  return Array.from(crypto.getRandomValues(new Uint8Array(16)),
    (b) => b.toString(16).padStart(2, "0")).join("");
}

// A dry run's receipt (the data format read, columns used and ignored) and its first rows
// as the trainer renders them, the tokens that carry loss marked.
function previewHTML(est) {
  const d = est.data_format;
  let html = "";
  if (d) {
    const used = Object.entries(d.columns_used).map(([role, col]) => `${col} (${role})`).join(", ");
    html += `<p id="receipt">Data: <b>${esc(d.format)}</b> [${esc(d.layout)}], ${d.detected ? "detected" : "as named"};
      columns used: ${esc(used)}; ignored: ${esc(d.columns_ignored.join(", ") || "none")}</p>`;
  }
  for (const row of est.preview || []) {
    const toks = row.tokens.map((t) =>
      `<span class="${t.loss ? "loss" : "ctx"}" title="${t.id}">${esc(t.text)}</span>`).join("");
    html += `<h4>row ${row.row}: ${row.tokens.length} tokens, ${row.loss_tokens} with a loss${row.kept ? "" : " (dropped)"}</h4>
      <pre class="tokens">${toks}</pre>`;
  }
  for (const note of est.notes || []) html += `<p class="muted">${esc(note)}</p>`;
  return html;
}

function showNew() {
  const view = $("#view");
  let idempotencyKey = newIdempotencyKey();
  view.innerHTML = `<h2>New job</h2>
    <div class="card"><h3>1. Upload a dataset (optional)</h3>
      <input type="file" id="file" accept=".jsonl,.json,.csv,.parquet"> <button id="upload">Upload</button>
      <span id="uploaded" class="muted"></span></div>
    <div class="card"><h3>2. Job spec (JSON)</h3>
      <textarea id="spec" spellcheck="false">${esc(JSON.stringify(EXAMPLE_SPEC, null, 2))}</textarea>
      <p><button id="preview">Preview</button> <button class="primary" id="submit">Submit</button></p>
      <p id="submiterr" class="error"></p><div id="previewout"></div></div>`;
  $("#upload").onclick = async () => {
    const f = $("#file").files[0];
    if (!f) return;
    const form = new FormData();
    form.append("file", f);
    try {
      const obj = await (await api("/v1/files", { method: "POST", body: form })).json();
      $("#uploaded").textContent = `${obj.id}: ${obj.rows} rows, columns ${obj.columns.join(", ")}`;
      const spec = JSON.parse($("#spec").value);
      spec.dataset = Object.assign(spec.dataset || {}, { file_id: obj.id });
      $("#spec").value = JSON.stringify(spec, null, 2);
      idempotencyKey = newIdempotencyKey();
    } catch (e) { $("#uploaded").textContent = e.message; }
  };
  $("#spec").oninput = () => { idempotencyKey = newIdempotencyKey(); };
  $("#preview").onclick = async () => {
    $("#submiterr").textContent = "";
    $("#previewout").innerHTML = "";
    let spec;
    try { spec = JSON.parse($("#spec").value); } catch (e) { $("#submiterr").textContent = `Not JSON: ${e.message}`; return; }
    try {
      const est = await (await api("/v1/jobs?dry_run=true&preview=3", {
        method: "POST", body: JSON.stringify(spec), headers: { "Content-Type": "application/json" },
      })).json();
      $("#previewout").innerHTML = previewHTML(est);
    } catch (e) { $("#submiterr").textContent = e.message; }
  };
  $("#submit").onclick = async () => {
    $("#submiterr").textContent = "";
    let spec;
    try { spec = JSON.parse($("#spec").value); } catch (e) { $("#submiterr").textContent = `Not JSON: ${e.message}`; return; }
    const btn = $("#submit");
    btn.disabled = true;
    try {
      const job = await (await api("/v1/jobs", {
        method: "POST", body: JSON.stringify(spec),
        headers: { "Content-Type": "application/json", "Idempotency-Key": idempotencyKey },
      })).json();
      location.hash = `#/jobs/${job.id}`;
    } catch (e) { $("#submiterr").textContent = e.message; }
    btn.disabled = false;
  };
}

async function route() {
  const gen = ++generation;
  const current = () => gen === generation;
  clearTimeout(timer);
  const view = $("#view");
  if (!apiKey()) { view.innerHTML = '<p class="muted">Enter an API key above to begin.</p>'; return; }
  const hash = location.hash || "#/";
  // Busy until this render is on screen (or a newer one took over): assistive technology
  // waits for it, and so can a test that reads the page once the render it caused is done.
  view.setAttribute("aria-busy", "true");
  try {
    const m = hash.match(/^#\/jobs\/([\w-]+)$/);
    const evalView = evalRoute(hash, current);  // evals.js
    if (evalView) await evalView;
    else if (m) await showJob(m[1], current);
    else if (hash === "#/new") showNew();
    else if (hash === "#/workers") await showWorkers(current);
    else await showJobs(current);
  } catch (e) {
    if (current()) view.innerHTML = `<p class="error">${esc(e.message)}</p>`;
  } finally {
    if (current()) view.removeAttribute("aria-busy");
  }
}

$("#keyform").onsubmit = (ev) => {
  ev.preventDefault();
  const v = $("#apikey").value.trim();
  if (v) localStorage.setItem("ftune.apiKey", v);
  $("#apikey").value = "";
  route();
};
window.addEventListener("hashchange", route);
route();
