// relax-agent view: a small single-page viewer over the JSON API (/api/...). No external assets.
// Routes (location.hash): #/ overview, #/step/N?filters, #/episode/N/SAMPLE, #/compare/N/A/B,
// #/eval/NAME?filters. Every render re-fetches, so a run in progress shows what is on disk now.
"use strict";

const app = document.getElementById("app");
const crumbs = document.getElementById("crumbs");

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : String(x));
const fmtR = x => (typeof x === "number" ? x.toFixed(3) : fmt(x));  // rewards, accuracies: always 3 decimals
const enc = encodeURIComponent;
const badge = (cls, text, title) => h("span", { class: "badge " + cls, title }, text);

async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  const body = await r.json().catch(() => ({ detail: r.statusText }));
  if (!r.ok) throw new Error(body.detail || r.statusText);
  return body;
}

function route() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(query || "") };
}

function setCrumbs(...items) {
  crumbs.replaceChildren(...items.flatMap((it, i) => [i ? " / " : "", it]));
}

async function render() {
  const { parts, params } = route();
  app.dataset.state = "loading";
  try {
    let view;
    if (parts[0] === "step") view = await stepPage(Number(parts[1]), params);
    else if (parts[0] === "episode") view = await episodePage(Number(parts[1]), parts.slice(2).join("/"));
    else if (parts[0] === "compare") view = await comparePage(Number(parts[1]), parts[2], parts[3]);
    else if (parts[0] === "eval") view = await evalPage(parts[1], params);
    else view = await overviewPage();
    app.replaceChildren(view);
    app.dataset.state = "ready";
  } catch (err) {
    app.replaceChildren(h("p", { class: "error", id: "load-error" }, "could not load: " + err.message));
    app.dataset.state = "error";
  }
}

// -- overview ------------------------------------------------------------------------------------
async function overviewPage() {
  const ov = await api("/api/overview");
  setCrumbs(h("span", {}, ov.run_dir));
  const out = h("div", { id: "overview" },
    h("h1", {}, "Run ", h("code", {}, ov.run_dir), " ",
      ov.in_progress ? badge("warn", "in progress", "no summary.json yet") : badge("ok", "finished")));
  if (ov.partial_files.length)
    out.append(h("p", { class: "note" }, "Still being written (last line skipped): " + ov.partial_files.join(", ")));
  for (const [file, lines] of Object.entries(ov.bad_lines))
    out.append(h("p", { class: "note" }, `${file}: lines ${lines.join(", ")} did not parse and are skipped`));
  if (ov.summary) {
    const s = ov.summary;
    const heldout = ["eval_start", "eval_warmup", "eval_end"].filter(k => s[k]).map(k => {
      const e = Object.fromEntries(Object.entries(s[k]).map(([key, v]) => [key.split("/").pop(), v]));
      return h("li", {}, `${k.replace("_", " ")}: accuracy ${fmtR(e.accuracy)}` + (e.accuracy_std ? ` ± ${fmtR(e.accuracy_std)}` : "") +
        `, reward ${fmtR(e.reward)}, well-formed ${fmtR(e.well_formed)}`);
    });
    out.append(h("h2", {}, "Summary"), heldout.length ? h("ul", { id: "heldout" }, heldout) : null,
      s.checkpoint ? h("p", {}, "checkpoint ", h("code", {}, s.checkpoint)) : null,
      h("details", {}, h("summary", {}, "everything in summary.json"), summaryTable(s)));
  }
  if (ov.has_curves) out.append(h("h2", {}, "Curves"), h("img", { class: "curves", src: "/curves.png?t=" + Date.now(), alt: "training curves" }));
  out.append(h("h2", {}, "Steps"));
  if (!ov.steps.length) out.append(h("p", { class: "muted" }, "No step yet."));
  else out.append(h("table", { id: "steps" },
    h("tr", {}, ["step", "reward", "accuracy", "well-formed", "episodes", "failed", "trained", "dropped (stale)", "filtered"].map(t => h("th", {}, t))),
    ov.steps.map(s => h("tr", { class: "step", "data-step": s.step },
      h("td", {}, s.has_rollouts ? h("a", { href: `#/step/${s.step}` }, `step ${s.step}`) : `step ${s.step}`),
      [s.reward, s.accuracy, s.well_formed].map(x => h("td", { class: "num" }, fmtR(x))),
      [s.episodes, s.failed, s.trained, s.dropped_stale, s.filtered].map(x => h("td", { class: "num" }, fmt(x)))))));
  out.append(h("h2", {}, "Held-out evaluations"));
  const listed = new Set(ov.evals.map(e => e.name));
  if (!ov.evals.length && !ov.eval_files.length) out.append(h("p", { class: "muted" }, "No evaluation yet."));
  else out.append(h("table", { id: "evals" },
    h("tr", {}, ["evaluation", "after step", "accuracy", "reward", "well-formed"].map(t => h("th", {}, t))),
    ov.evals.map(e => h("tr", {},
      h("td", {}, e.has_samples ? h("a", { href: `#/eval/${enc(e.name)}` }, e.name) : e.name),
      h("td", { class: "num" }, e.step),
      h("td", { class: "num" }, fmtR(e.accuracy) + (e.accuracy_std ? " ± " + fmtR(e.accuracy_std) : "")),
      h("td", { class: "num" }, fmtR(e.reward)), h("td", { class: "num" }, fmtR(e.well_formed)))),
    ov.eval_files.filter(n => !listed.has(n)).map(n => h("tr", {},
      h("td", {}, h("a", { href: `#/eval/${enc(n)}` }, n)), h("td", { colspan: 4, class: "muted" }, "samples only")))));
  if (ov.sft.length) {
    out.append(h("h2", {}, "Supervised warm-up"),
      h("p", {}, `${ov.sft.length} updates; loss ${fmt(ov.sft[0]["sft/loss"])} → ${fmt(ov.sft[ov.sft.length - 1]["sft/loss"])}`));
  }
  return out;
}

function summaryTable(summary) {
  const rows = [];
  const walk = (prefix, v) => {
    if (v && typeof v === "object" && !Array.isArray(v)) for (const [k, x] of Object.entries(v)) walk(prefix ? `${prefix}.${k}` : k, x);
    else if (!Array.isArray(v)) rows.push([prefix, v]);
  };
  walk("", summary);
  return h("table", { id: "summary" }, rows.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", { class: typeof v === "number" ? "num" : "" }, fmt(v, 4)))));
}

// -- step ----------------------------------------------------------------------------------------
const FILTER_KEYS = ["failed", "min_reward", "max_reward", "stop_reason", "crossed", "reason"];

function filterForm(params, stopReasons, base, extra) {
  const sel = (name, options) => h("select", { name, id: "f-" + name },
    options.map(([v, label]) => h("option", { value: v, selected: (params.get(name) || "") === v }, label)));
  const num = name => h("input", { name, id: "f-" + name, type: "number", step: "any", value: params.get(name) || "" });
  const form = h("form", { class: "filters", id: "filters", onsubmit: ev => {
      ev.preventDefault();
      const q = new URLSearchParams();
      for (const el of form.elements) if (el.name && el.value !== "") q.set(el.name, el.value);
      location.hash = base + (q.toString() ? "?" + q : "");
    } },
    h("label", {}, "outcome", sel("failed", [["", "any"], ["true", "failed"], ["false", "not failed"]])),
    h("label", {}, "min reward", num("min_reward")),
    h("label", {}, "max reward", num("max_reward")),
    h("label", {}, "stop reason", sel("stop_reason", [["", "any"], ...stopReasons.map(s => [s, s])])),
    extra || [],
    h("button", { type: "submit", id: "apply" }, "filter"),
    h("a", { href: base, id: "clear" }, "clear"));
  return form;
}

function apiQuery(params) {
  const q = new URLSearchParams();
  for (const k of FILTER_KEYS) if (params.get(k)) q.set(k, params.get(k));
  return q.toString() ? "?" + q : "";
}

function flags(e) {
  return [
    e.failed ? badge("bad", "failed", e.error || `reward status ${e.reward_status}`) : null,
    e.trained ? badge("ok", "trained", "entered the gradient (non-zero advantage)") : null,
    e.dropped_stale ? badge("warn", "dropped (stale)", "its group finished too late for max_staleness") : null,
    e.filtered ? badge("plain", "filtered", "dynamic sampling retired its group: rewards did not vary") : null,
    e.crossed_update ? badge("info", "crossed update", "a weight update landed inside a turn") : null,
  ];
}

async function stepPage(step, params) {
  const st = await api(`/api/steps/${step}` + apiQuery(params));
  setCrumbs(h("a", { href: "#/" }, "run"), `step ${step}`);
  const base = `#/step/${step}`;
  const compare = new Set();
  const compareLink = h("a", { id: "compare-link", class: "muted" }, "tick two episodes of a group to compare them");
  const updateCompare = () => {
    const ids = [...compare];
    if (ids.length === 2) { compareLink.href = `#/compare/${step}/${enc(ids[0])}/${enc(ids[1])}`; compareLink.textContent = `compare ${ids[0]} and ${ids[1]}`; compareLink.className = ""; }
    else { compareLink.removeAttribute("href"); compareLink.textContent = "tick two episodes to compare them"; compareLink.className = "muted"; }
  };
  const m = st.metrics || {};
  const out = h("div", { id: "step" },
    h("h1", {}, `Step ${step}`),
    h("p", {}, `reward ${fmtR(m["rollout/reward"])} · accuracy ${fmtR(m["rollout/accuracy"])} · well-formed ${fmtR(m["rollout/well_formed"])} · `,
      h("span", { id: "shown-count" }, `${st.shown} of ${st.total} episodes shown`), ` in ${st.groups.length} groups`),
    st.partial ? h("p", { class: "note" }, "The dump's last line is still being written; it is skipped.") : null,
    filterForm(params, st.stop_reasons, base,
      h("label", {}, "update", h("select", { name: "crossed", id: "f-crossed" },
        [["", "any"], ["true", "crossed an update"], ["false", "one version"]].map(([v, l]) => h("option", { value: v, selected: (params.get("crossed") || "") === v }, l))))),
    h("p", {}, compareLink));
  for (const g of st.groups) {
    out.append(h("div", { class: "card group", "data-group": g.group_id },
      h("h3", {}, `group ${g.group_id}`, h("span", { class: "muted" }, ` · task ${g.task_id} · ${g.size} episodes · reward mean ${fmt(g.reward_mean)} ± ${fmt(g.reward_std)}`)),
      h("table", {},
        h("tr", {}, ["", "episode", "reward", "vs group mean", "status", "stop reason", "flags", "versions (sampled → trained; per turn)", "turns"].map(t => h("th", {}, t))),
        g.episodes.map(e => h("tr", { class: "episode" + (e.failed ? " failed" : ""), "data-sample": e.sample_id },
          h("td", {}, h("input", { type: "checkbox", title: "compare", class: "pick", onchange: ev => {
            if (ev.target.checked) compare.add(e.sample_id); else compare.delete(e.sample_id);
            updateCompare(); } })),
          h("td", {}, h("a", { href: episodeHref(step, e.sample_id) }, e.sample_id)),
          h("td", { class: "num reward" }, fmtR(e.reward)),
          h("td", { class: "num" }, (e.vs_group_mean > 0 ? "+" : "") + fmtR(e.vs_group_mean)),
          h("td", {}, e.reward_status, e.error ? h("div", { class: "error" }, e.error) : null),
          h("td", { class: "stop" }, e.stop_reason),
          h("td", {}, flags(e)),
          h("td", {}, `${fmt(e.sample_version)} → ${fmt(e.trained_at_version)}; [${(e.policy_versions || []).join(", ")}]`),
          h("td", { class: "num" }, e.turns))))));
  }
  if (!st.groups.length) out.append(h("p", { class: "muted", id: "no-match" }, "No episode matches the filters."));
  return out;
}

// -- episode -------------------------------------------------------------------------------------
function messageView(m) {
  const parts = [h("div", { class: "role" }, m.role + (m.name ? ` · ${m.name}` : ""))];
  if (typeof m.content === "string") { if (m.content) parts.push(h("div", { class: "text" }, m.content)); }
  else if (Array.isArray(m.content)) {
    for (const c of m.content) {
      if (c && c.type === "text") parts.push(h("div", { class: "text" }, c.text));
      else parts.push(badge("info", c && c.type ? `[${c.type}]` : "[part]", "media item (not stored in the dump)"));
    }
  }
  for (const call of m.tool_calls || []) {
    const fn = call.function || call;
    const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments);
    parts.push(h("div", { class: "text tool-call" }, `→ ${fn.name}(${args})`));
  }
  for (const err of m.parse_errors || []) parts.push(h("div", { class: "error" }, "parse error: " + (typeof err === "string" ? err : JSON.stringify(err))));
  if (m.error) parts.push(h("div", { class: "error" }, "error: " + m.error));
  if (m.role === "system" && parts.length > 1)  // long tool schemas: folded
    return h("div", { class: "msg system" }, parts[0], h("details", {}, h("summary", {}, "system prompt"), parts.slice(1)));
  return h("div", { class: "msg " + m.role }, parts);
}

function tokenView(t) {
  const lp2color = lp => `hsl(${Math.round(120 * Math.exp(Math.max(lp, -20)))}, 75%, 82%)`;
  const spans = t.token_ids.map((id, i) => {
    const mask = t.loss_mask[i] ? 1 : 0;
    const lp = t.logprobs[i];
    const text = t.text ? String(t.text[i]).replace(/\n/g, "↵\n") : `⟨${id}⟩`;  // newlines visible
    const where = t.turn[i] !== null ? ` · turn ${t.turn[i] + 1}, policy version ${fmt(t.policy_version[i])}`
      : (t.prompt_len !== null && i < t.prompt_len ? " · prompt" : " · observation");
    return h("span", { class: "tok", "data-i": i, "data-mask": mask, "data-logprob": lp, "data-turn": t.turn[i],
      style: mask ? `background:${lp2color(lp)}` : null,
      title: `#${i} id ${id} · loss mask ${mask}` + (mask ? ` · log-prob ${fmt(lp, 4)}` : "") + where }, text);
  });
  const sampled = t.loss_mask.filter(Boolean).length;
  return h("div", { id: "tokens" },
    h("p", { class: "legend" }, `${t.token_ids.length} tokens (from ${t.source}), ${sampled} in the loss: underlined, background from red (improbable) to green (certain) by rollout log-prob; grey: prompt and observations (mask 0). Hover a token for its id, log-prob, turn and policy version.`,
      t.advantage !== null ? ` Advantage ${fmt(t.advantage, 4)}.` : "",
      t.text ? "" : h("span", { id: "no-tokenizer" }, t.tokenizer_error ? ` Ids shown: ${t.tokenizer_error}.` :
        " Ids shown: no tokenizer (the run has no checkpoint with one; pass --tokenizer PATH).")),
    t.prompt_len ? h("details", { class: "tokens", id: "prompt-tokens" },
      h("summary", {}, `prompt: ${t.prompt_len} tokens`), spans.slice(0, t.prompt_len)) : null,
    h("div", { class: "tokens" }, t.prompt_len ? spans.slice(t.prompt_len) : spans));
}

function episodePanel(ep) {
  const out = h("div", { class: "episode-panel", "data-sample": ep.sample_id },
    h("h2", {}, `Episode ${ep.sample_id}`, " ", flags(ep)),
    h("dl", { class: "facts" },
      h("dt", {}, "task"), h("dd", {}, ep.task_id),
      h("dt", {}, "reward"), h("dd", { class: "reward" }, fmtR(ep.reward), ep.vs_group_mean !== null ? h("span", { class: "muted" }, ` (${ep.vs_group_mean >= 0 ? "+" : ""}${fmtR(ep.vs_group_mean)} vs its group's mean)`) : null),
      h("dt", {}, "reward status"), h("dd", {}, ep.reward_status),
      h("dt", {}, "stop reason"), h("dd", { class: "stop" }, ep.stop_reason),
      ep.error ? [h("dt", {}, "error"), h("dd", { class: "error" }, ep.error)] : null,
      h("dt", {}, "policy versions"), h("dd", {}, `sampled at ${fmt(ep.sample_version)}, trained at ${fmt(ep.trained_at_version)}; per turn [${ep.policy_versions.join(", ")}]`),
      h("dt", {}, "metrics"), h("dd", {}, Object.entries(ep.metrics).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ") || "–")));
  if (ep.contexts && ep.contexts.length) {
    out.append(h("h3", {}, `Contexts (${ep.contexts.length}; each trained once with the episode's advantage)`),
      h("ol", { id: "contexts" }, ep.contexts.map(c => h("li", { class: "context", "data-sample": c.sample_id },
        c.sample_id === ep.sample_id ? h("b", {}, c.sample_id) : h("a", { href: episodeHref(ep.step, c.sample_id) }, c.sample_id),
        ` · ${c.turns} turn(s) · ${c.stop_reason === "context" ? "full: the episode went on in a new context" : `ended: ${c.stop_reason}`}`,
        c.stop_reason === "context" && ep.metrics["context/summaries"] ? h("div", { class: "text response summary" }, `summary: ${c.last_response}`) : null))));
  }
  if (ep.tokens) out.append(h("h3", {}, "Tokens"), tokenView(ep.tokens));
  else out.append(h("p", { class: "muted", id: "no-tokens" },
    `Token view unavailable: neither the rollout dump nor a token record (logging.token_record) has ${ep.tokens_missing.join(", ")} for this step.`));
  if (ep.messages) {
    out.append(h("h3", {}, "Conversation"), h("div", { id: "messages" }, ep.messages.map(messageView)));
  }
  if (ep.media_kinds.length) out.append(h("p", { class: "muted", id: "media" }, `media items: ${ep.media_kinds.join(", ")} (their pixels and samples are not recorded)`));
  out.append(h("h3", {}, "Turns (sampled responses)"));
  for (const t of ep.turn_list) {
    out.append(h("div", { class: "turn", "data-turn": t.index },
      h("div", { class: "muted" }, `turn ${t.index + 1} · policy version ${fmt(t.policy_version)}`,
        t.token_versions.length ? ` · token versions ${[...new Set(t.token_versions)].join("→")} (an update landed inside)` : ""),
      h("div", { class: "text response" }, t.response)));
  }
  return out;
}

const episodeHref = (step, sid) => `#/episode/${step}/${sid.split("/").map(enc).join("/")}`;

async function episodePage(step, sample) {
  const ep = await api(`/api/steps/${step}/episode?sample=${enc(sample)}`);
  setCrumbs(h("a", { href: "#/" }, "run"), h("a", { href: `#/step/${step}` }, `step ${step}`), sample);
  return h("div", { id: "episode" }, episodePanel(ep),
    h("h3", {}, `Its group ${ep.group_id}`, h("span", { class: "muted" }, ` · reward mean ${fmtR(ep.group_reward_mean)}`)),
    h("table", { id: "siblings" },
      h("tr", {}, ["episode", "reward", "stop reason", "flags", ""].map(t => h("th", {}, t))),
      ep.siblings.map(e => h("tr", { class: "sibling", "data-sample": e.sample_id },
        h("td", {}, e.sample_id === sample ? h("b", {}, e.sample_id) : h("a", { href: episodeHref(step, e.sample_id) }, e.sample_id)),
        h("td", { class: "num" }, fmtR(e.reward)), h("td", {}, e.stop_reason), h("td", {}, flags(e)),
        h("td", {}, e.sample_id === sample ? "" : h("a", { href: `#/compare/${step}/${enc(sample)}/${enc(e.sample_id)}`, class: "compare" }, "side by side"))))));
}

async function comparePage(step, a, b) {
  const [ea, eb] = await Promise.all([a, b].map(s => api(`/api/steps/${step}/episode?sample=${enc(s)}`)));
  setCrumbs(h("a", { href: "#/" }, "run"), h("a", { href: `#/step/${step}` }, `step ${step}`), `${a} vs ${b}`);
  return h("div", { id: "compare", class: "side" }, episodePanel(ea), episodePanel(eb));
}

// -- evaluation ----------------------------------------------------------------------------------
function reasonsTable(reasons, base, id) {
  return h("table", { id }, h("tr", {}, h("th", {}, "count"), h("th", {}, "reason (click: samples with it)")),
    reasons.map(([r, n]) => h("tr", {}, h("td", { class: "num" }, n),
      h("td", {}, h("a", { href: `${base}?reason=${enc(r)}` }, r)))));
}

async function evalPage(name, params) {
  const ev = await api(`/api/evals/${enc(name)}` + apiQuery(params));
  setCrumbs(h("a", { href: "#/" }, "run"), `evaluation ${name}`);
  const base = `#/eval/${enc(name)}`;
  const out = h("div", { id: "eval" },
    h("h1", {}, `Held-out evaluation ${name}`),
    h("p", {}, `${ev.correct} of ${ev.total} correct · `, h("span", { id: "shown-count" }, `${ev.samples.length} shown`), " · ", h("code", {}, ev.file)),
    ev.partial ? h("p", { class: "note" }, "The last line is still being written; it is skipped.") : null,
    filterForm(params, ev.stop_reasons, base,
      h("label", {}, "verdict reason contains", h("input", { name: "reason", id: "f-reason", value: params.get("reason") || "" }))),
    h("h2", {}, "Verdict reasons"),
    reasonsTable(ev.reasons.slice(0, 8), base, "reasons"),
    ev.reasons.length > 8 ? h("details", {}, h("summary", {}, `all ${ev.reasons.length} reasons`), reasonsTable(ev.reasons.slice(8), base, "more-reasons")) : null,
    h("h2", {}, "Samples"));
  for (const s of ev.samples) {
    const v = s.verdict || {};
    out.append(h("div", { class: "card sample", "data-task": s.task_id, "data-sample": s.sample_id },
      h("h3", {}, `${s.task_id}`, h("span", { class: "muted" }, ` · ${s.sample_id} · seed ${s.seed} · `),
        v.correct ? badge("ok", "correct") : badge("bad", "wrong"), h("span", { class: "muted" }, ` reward ${fmtR(v.reward)} · stop ${v.stop_reason}`)),
      h("div", { class: "verdict-reason" + (v.correct ? "" : " error") }, v.reason),
      v.error ? h("div", { class: "error" }, "error: " + v.error) : null,
      h("details", {}, h("summary", {}, "prompt"), (s.prompt || []).map(messageView)),
      (s.response || []).map((r, i) => h("div", {},
        h("div", { class: "muted" }, `response ${i + 1}`), h("div", { class: "text response" }, r),
        ((s.parsed_calls || [])[i] || { calls: [] }).calls.map(c => h("div", { class: "text tool-call" }, `parsed → ${c.name}(${JSON.stringify(c.arguments)})`)),
        (((s.parsed_calls || [])[i] || {}).parse_errors || []).map(e => h("div", { class: "error" }, "parse error: " + (typeof e === "string" ? e : JSON.stringify(e)))))),
      (s.conversation || []).length ? h("div", {}, h("div", { class: "muted" }, "tool results and later turns"), s.conversation.map(messageView)) : null));
  }
  if (!ev.samples.length) out.append(h("p", { class: "muted", id: "no-match" }, "No sample matches the filters."));
  return out;
}

window.addEventListener("hashchange", render);
document.getElementById("reload").addEventListener("click", render);
render();
