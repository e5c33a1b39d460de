// The dashboard's eval views (a run's report_url points here): an eval's runs with a compare
// of two of them, and one run's counts, criteria, usage and output items. Loaded before
// app.js, whose helpers ($, esc, getJSON, fmt, statusBadge) it uses when called.
"use strict";

const EVAL_UNFINISHED = new Set(["queued", "in_progress", "canceling"]);

function evalCounts(c) {
  return `${esc(c.passed)} passed, ${esc(c.failed)} failed, ${esc(c.errored)} errored of ${esc(c.total)}`;
}

async function showEval(evalId, current) {
  const [ev, runs] = await Promise.all([
    getJSON(`/v1/evals/${encodeURIComponent(evalId)}`),
    getJSON(`/v1/evals/${encodeURIComponent(evalId)}/runs?limit=100&order=desc`)]);
  if (!current()) return;
  const rows = runs.data.map((r) => `<tr><td><a href="#/evals/${esc(evalId)}/runs/${esc(r.id)}">${esc(r.id)}</a></td>
    <td>${esc(r.name)}</td><td>${esc(r.model || "given answers")}</td><td>${statusBadge(r.status)}</td>
    <td>${evalCounts(r.result_counts)}</td></tr>`).join("");
  const options = runs.data.map((r) => `<option value="${esc(r.id)}">${esc(r.name || r.id)} (${esc(r.model || "jsonl")})</option>`).join("");
  $("#view").innerHTML = `<h2>Eval ${esc(ev.name || ev.id)}</h2>
    <p class="muted">${esc(ev.id)} · criteria: ${ev.testing_criteria.map((c) => esc(c.name)).join(", ")}</p>
    <table id="evalruns"><thead><tr><th>run</th><th>name</th><th>model</th><th>status</th><th>results</th></tr></thead>
    <tbody>${rows || '<tr><td colspan="5" class="muted">No runs yet.</td></tr>'}</tbody></table>
    <h3>Compare two runs</h3>
    <form id="compareform"><select id="cmpbase" aria-label="base run">${options}</select>
      <select id="cmpcand" aria-label="candidate run">${options}</select>
      <button type="submit">Compare</button></form><div id="comparison"></div>`;
  $("#compareform").onsubmit = async (e) => {
    e.preventDefault();
    const q = new URLSearchParams({ base_run_id: $("#cmpbase").value, candidate_run_id: $("#cmpcand").value });
    try {
      const c = await getJSON(`/v1/evals/${encodeURIComponent(evalId)}/compare?${q}`);
      const iv = (x) => `[${fmt(x[0], 3)}, ${fmt(x[1], 3)}]`;
      const crit = c.criteria.map((r) => `<tr><td>${esc(r.testing_criteria)}</td><td>${esc(r.items)}</td>
        <td>${fmt(r.base_pass_rate, 3)}</td><td>${fmt(r.candidate_pass_rate, 3)}</td>
        <td>${fmt(r.pass_rate_difference, 3)} ${iv(r.pass_rate_interval)}</td>
        <td>${fmt(r.mean_score_difference, 3)} ${iv(r.mean_score_interval)}</td></tr>`).join("");
      const flips = c.flipped.slice(0, 50).map((f) => `<tr><td>${esc(f.datasource_item_id)}</td>
        <td>${esc(f.testing_criteria)}</td><td>${esc(f.direction)}</td><td>${esc(f.base_answer)}</td>
        <td>${esc(f.candidate_answer)}</td></tr>`).join("");
      $("#comparison").innerHTML = `<table><thead><tr><th>criterion</th><th>items</th><th>pass base</th>
        <th>pass candidate</th><th>Δ pass (95% CI)</th><th>Δ score (95% CI)</th></tr></thead><tbody>${crit}</tbody></table>
        <p>${esc(c.flipped.length)} items flipped</p><table><thead><tr><th>item</th><th>criterion</th>
        <th></th><th>base answer</th><th>candidate answer</th></tr></thead><tbody>${flips}</tbody></table>`;
    } catch (err) { $("#comparison").innerHTML = `<p class="error">${esc(err.message)}</p>`; }
  };
}

async function showEvalRun(evalId, runId, current) {
  const base = `/v1/evals/${encodeURIComponent(evalId)}/runs/${encodeURIComponent(runId)}`;
  const [run, items] = await Promise.all([getJSON(base), getJSON(`${base}/output_items?limit=100`)]);
  if (!current()) return;
  const crit = run.per_testing_criteria_results.map((c) => `<tr><td>${esc(c.testing_criteria)}</td>
    <td>${esc(c.passed)}</td><td>${esc(c.failed)}</td><td>${esc(c.errored)}</td></tr>`).join("");
  const usage = run.per_model_usage.map((u) => `<tr><td>${esc(u.model_name)}</td><td>${esc(u.invocation_count)}</td>
    <td>${esc(u.prompt_tokens)}</td><td>${esc(u.completion_tokens)}</td></tr>`).join("");
  const rows = items.data.map((it) => {
    const out = (it.sample.output[0] || {}).content;
    const why = it.sample.error.message || it.results.map((r) => r.error).filter(Boolean).join("; ");
    return `<tr><td>${esc(it.datasource_item_id)}</td><td>${statusBadge(it.status)}</td>
      <td>${esc(out ?? "")}</td><td>${it.results.map((r) => `${esc(r.name)}: ${fmt(r.score, 3)}`).join("<br>")}</td>
      <td class="muted">${esc(why)}</td></tr>`;
  }).join("");
  $("#view").innerHTML = `<h2>Run ${esc(run.name || run.id)} ${statusBadge(run.status)}</h2>
    <p><a href="#/evals/${esc(evalId)}">eval ${esc(evalId)}</a> · model ${esc(run.model || "given answers")} ·
      ${evalCounts(run.result_counts)}${run.error.message ? ` · <span class="error">${esc(run.error.message)}</span>` : ""}</p>
    <table><thead><tr><th>criterion</th><th>passed</th><th>failed</th><th>errored</th></tr></thead><tbody>${crit}</tbody></table>
    ${usage ? `<table><thead><tr><th>model</th><th>requests</th><th>prompt tokens</th><th>completion tokens</th></tr></thead><tbody>${usage}</tbody></table>` : ""}
    <h3>Output items${items.has_more ? " (first 100)" : ""}</h3>
    <table id="outputitems"><thead><tr><th>item</th><th>status</th><th>answer</th><th>scores</th><th>error</th></tr></thead>
    <tbody>${rows || '<tr><td colspan="5" class="muted">None yet.</td></tr>'}</tbody></table>`;
  if (EVAL_UNFINISHED.has(run.status)) timer = setTimeout(() => route(), 3000);
}

// Which eval view a hash names, or null (app.js's route() asks).
function evalRoute(hash, current) {
  let m = hash.match(/^#\/evals\/([\w-]+)\/runs\/([\w-]+)$/);
  if (m) return showEvalRun(m[1], m[2], current);
  m = hash.match(/^#\/evals\/([\w-]+)$/);
  if (m) return showEval(m[1], current);
  return null;
}
