// llm-pool status page: reads the admin API every POLL_MS and acts through it. No framework, no
// build step: the page's elements are made once per model and replica and then only their text is
// updated, so a form being filled in or a focused button survives every refresh.
"use strict";
(() => {
  const TOKEN_KEY = "llm-pool-admin-token";   // sessionStorage: this tab only, gone when it closes
  const POLL_MS = 1500;
  const GPU_EVERY = 4;          // /v1/admin/gpu-memory walks process trees and NVML: every 4th poll
  const WINDOW_MS = 10000;      // rates and quantiles: over this much of the page's own readings
  const LOG_MS = 1000;
  const LOG_FIRST_BYTES = 16384, LOG_POLL_BYTES = 262144, LOG_KEEP_CHARS = 400000;

  const state = {
    token: sessionStorage.getItem(TOKEN_KEY) || "",
    polls: 0,
    readings: [],               // [{time, models}] from /v1/admin/traffic, newest last
    cards: new Map(),           // model id -> its card's elements
    log: null,                  // {model, replica, offset, follow, timer}
  };

  const {el, setText, newId, syncRows, cells, fmtValue} = window.LlmPool;

  // -- formatting -------------------------------------------------------------------------------

  function fmtMiB(mib) {
    if (mib === null || mib === undefined) return "–";
    if (typeof mib === "object") {   // per device: {"cpu": 29.9, "gpu0": 4100}
      return Object.entries(mib).map(([device, v]) => `${fmtMiB(v)} on ${device}`).join(", ") || "–";
    }
    const n = Number(mib);
    if (!Number.isFinite(n)) return String(mib);
    return n >= 10240 ? `${(n / 1024).toFixed(1)} GiB` : `${n.toFixed(n < 10 ? 1 : 0)} MiB`;
  }
  const fmtBytes = (b) => (b === null || b === undefined ? "–" : fmtMiB(b / 1048576));
  const fmtSeconds = (s) => (s === null || s === undefined || Number.isNaN(s) ? "–" :
    s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);
  const fmtRate = (r) => (r === null || r === undefined ? "–" : r.toFixed(r < 10 ? 2 : 1));

  function fmtOverrides(overrides, prefix) {
    const parts = [];
    for (const [key, value] of Object.entries(overrides || {})) {
      const path = prefix ? `${prefix}.${key}` : key;
      if (value !== null && typeof value === "object" && !Array.isArray(value)) parts.push(fmtOverrides(value, path));
      else parts.push(`${path}=${fmtValue(value)}`);
    }
    return parts.filter(Boolean).join(", ");
  }

  function stateBadge(node, value) {
    setText(node, value);
    node.className = `state ${value}`;
  }

  // A loaded model whose queue is closed refuses every request although its state says it serves; in
  // any other state the state itself says what a request gets (refused, or loaded on demand).
  const refusing = (m) => m.state === "loaded" && m.admission && !m.admission.open ? m.admission : null;

  // -- the admin API ----------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
    toString() {
      return this.status ? `${this.status} ${this.code}: ${this.message}` : this.message;
    }
  }

  async function api(method, path, body) {
    const headers = {};
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    // Every admin POST is JSON, an unload's too ({}): the API refuses any other type (415), which is
    // what a page of another site could send it.
    if (method === "POST") {
      headers["Content-Type"] = "application/json";
      if (body === undefined) body = {};
    }
    let response;
    try {
      // Relative to /ui, so the page works under a reverse proxy's prefix too.
      response = await fetch(path, {method, headers, cache: "no-store",
                                    body: body === undefined ? undefined : JSON.stringify(body)});
    } catch (err) {
      throw new ApiError(0, "unreachable", `the proxy did not answer (${err.message})`);
    }
    let data = null;
    try { data = await response.json(); } catch (err) { data = null; }
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ApiError(response.status, error.code || "error", error.message || response.statusText);
    }
    return data;
  }

  const modelPath = (id, what) => `v1/admin/models/${encodeURIComponent(id)}/${what}`;

  // -- polling ----------------------------------------------------------------------------------

  const banner = document.getElementById("banner");

  function showProblem(err) {
    if (err === null) {
      banner.hidden = true;
      setText(banner, "");
      return;
    }
    let text = String(err);
    if (err.status === 401) text += state.token ? " — the token typed above was refused: check it and use it again." :
      " — type the admin token above.";
    setText(banner, text);
    banner.hidden = false;
  }

  async function poll() {
    const withGpu = state.polls % GPU_EVERY === 0;
    state.polls += 1;
    try {
      const [models, traffic, memory, gpu] = await Promise.all([
        api("GET", "v1/admin/models"), api("GET", "v1/admin/traffic"), api("GET", "v1/admin/memory"),
        withGpu ? api("GET", "v1/admin/gpu-memory") : Promise.resolve(null)]);
      showProblem(null);
      noteReading(traffic);
      renderOverview(models.data);
      renderMemory(models.data, memory, gpu);
      renderCards(models.data);
      setText(document.getElementById("updated"), `updated ${new Date().toLocaleTimeString()}` +
        (models.supervisord && models.supervisord.answering === false ? " · supervisord is not answering" : ""));
    } catch (err) {
      showProblem(err);
      if (err.status === 401) state.polls = 0;   // read the GPUs too as soon as the token works
    }
  }

  function schedule() {
    poll().finally(() => setTimeout(schedule, document.hidden ? POLL_MS * 4 : POLL_MS));
  }

  // -- rates and quantiles from the proxy's counters ---------------------------------------------

  function noteReading(traffic) {
    state.readings.push({time: traffic.time, models: traffic.models});
    while (state.readings.length > 2 && traffic.time - state.readings[1].time >= WINDOW_MS / 1000) {
      state.readings.shift();
    }
  }

  // The q-quantile of the observations between two cumulative histograms, interpolated within its
  // bucket as Prometheus' histogram_quantile does; null when nothing was observed.
  function quantile(q, newer, older) {
    const counts = newer.counts.map((c, i) => c - (older ? older.counts[i] : 0));
    const total = counts[counts.length - 1];
    if (!(total > 0)) return null;
    const rank = q * total;
    for (let i = 0; i < counts.length; i++) {
      if (counts[i] >= rank) {
        if (i === newer.le.length) return newer.le[newer.le.length - 1];   // in +Inf: its lower bound
        const lower = i === 0 ? 0 : newer.le[i - 1];
        const below = i === 0 ? 0 : counts[i - 1];
        const inBucket = counts[i] - below;
        return lower + (newer.le[i] - lower) * (inBucket > 0 ? (rank - below) / inBucket : 1);
      }
    }
    return null;
  }

  function trafficOf(id) {
    const n = state.readings.length;
    if (n === 0) return null;
    const newest = state.readings[n - 1].models[id];
    if (!newest) return null;
    const first = state.readings[0];
    const older = n > 1 ? first.models[id] : null;
    const span = n > 1 ? state.readings[n - 1].time - first.time : 0;
    const errors = (row) => Object.entries(row.by_status)
      .filter(([status]) => !/^[23]/.test(status)).reduce((sum, [, count]) => sum + count, 0);
    return {
      total: newest.requests,
      rate: older && span > 0 ? (newest.requests - older.requests) / span : null,
      errorRate: older && span > 0 ? (errors(newest) - errors(older)) / span : null,
      p50: older ? quantile(0.5, newest.latency_s, older.latency_s) : null,
      p95: older ? quantile(0.95, newest.latency_s, older.latency_s) : null,
      wait95: older ? quantile(0.95, newest.queue_wait_s, older.queue_wait_s) : null,
    };
  }

  // -- overview and memory ----------------------------------------------------------------------

  function renderOverview(models) {
    const tbody = document.querySelector("#overview tbody");
    syncRows(tbody, models, (m) => m.id, (row) => {
      const c = cells(row, ["name", "state", "ready", "active", "waiting", "capacity", "rate", "errors", "p50",
                            "p95", "wait", "total"],
                      ["ready", "active", "waiting", "capacity", "rate", "errors", "p50", "p95", "wait", "total"]);
      c.link = c.name.appendChild(el("a", {}));
      c.badge = c.state.appendChild(el("span", {}));
      c.refusing = c.state.appendChild(el("span", {class: "error-text"}));
      return c;
    }, (c, m) => {
      setText(c.link, m.id);
      c.link.href = `#${cardId(m.id)}`;
      stateBadge(c.badge, m.state);
      const closed = refusing(m);
      setText(c.refusing, closed ? ` refusing requests (${closed.code})` : "");
      c.refusing.title = closed ? closed.reason : "";
      setText(c.ready, `${m.replicas.filter((r) => r.state === "ready").length} / ${m.replica_count}`);
      setText(c.active, m.active);
      setText(c.waiting, m.waiting);
      setText(c.capacity, m.capacity);
      const t = trafficOf(m.id);
      setText(c.rate, t ? fmtRate(t.rate) : "–");
      setText(c.errors, t ? fmtRate(t.errorRate) : "–");
      setText(c.p50, t ? fmtSeconds(t.p50) : "–");
      setText(c.p95, t ? fmtSeconds(t.p95) : "–");
      setText(c.wait, t ? fmtSeconds(t.wait95) : "–");
      setText(c.total, t ? t.total : "–");
    });
  }

  function renderMemory(models, memory, gpu) {
    syncRows(document.querySelector("#devices tbody"), memory.devices, (d) => d.device, (row) =>
      cells(row, ["device", "budget", "used", "reserved", "free", "models"], ["budget", "used", "reserved", "free"]),
    (c, d) => {
      setText(c.device, d.device);
      setText(c.budget, d.budget_bytes === null ? "no budget" : fmtBytes(d.budget_bytes));
      setText(c.used, fmtBytes(d.used_bytes));
      setText(c.reserved, fmtBytes(d.reserved_bytes));
      setText(c.free, d.free_bytes === null ? "–" : fmtBytes(d.free_bytes));
      setText(c.models, d.models.join(", "));
    });
    const notes = [];
    // Why no GPU is visible is said once, under the GPU table.
    if (memory.max_loaded_models !== null) notes.push(`At most ${memory.max_loaded_models} models loaded (${memory.loaded_models} now).`);
    if (memory.loading.length) notes.push(`Loading: ${memory.loading.join(", ")}.`);
    for (const w of memory.waiting_for_room) notes.push(`${w.model} waits for room (${w.waited_s} s).`);
    setText(document.getElementById("memory-note"), notes.join(" "));
    if (gpu !== null) state.gpu = gpu;
    const report = state.gpu;
    if (report) {
      syncRows(document.querySelector("#gpus tbody"), report.gpus, (g) => g.index, (row) =>
        cells(row, ["index", "name", "used", "total", "free"], ["used", "total", "free"]), (c, g) => {
        setText(c.index, g.index);
        setText(c.name, g.name + (g.pids_visible === false ? ` (${g.note})` : ""));
        setText(c.used, fmtMiB(g.used_mib));
        setText(c.total, fmtMiB(g.total_mib));
        setText(c.free, fmtMiB(g.free_mib));
      });
      setText(document.getElementById("gpu-note"), report.available ? "" : `GPU readings unavailable: ${report.reason}`);
    }
    syncRows(document.querySelector("#model-memory tbody"), models, (m) => m.id, (row) =>
      cells(row, ["name", "devices", "by", "measured", "estimated", "gpuMeasured", "gpuEstimate", "fits"],
            ["measured", "estimated", "gpuMeasured", "gpuEstimate"]), (c, m) => {
      const fp = m.footprint || {};
      const g = report && report.models ? report.models[m.id] : null;
      setText(c.name, m.id);
      setText(c.devices, (fp.devices || []).join(", ") || "none");
      c.devices.title = fp.why || "";
      setText(c.by, fp.admitted_by || "–");
      setText(c.measured, fmtMiB(fp.measured_mib_per_replica));
      setText(c.estimated, fmtMiB(fp.estimated_mib_per_replica));
      setText(c.gpuMeasured, g && g.measured ? (g.measured.used_mib === null ? g.measured.reason : fmtMiB(g.measured.used_mib)) : "–");
      setText(c.gpuEstimate, g && g.estimate ? fmtMiB(g.estimate.total_mib) : "–");
      setText(c.fits, g && g.fits !== null && g.fits !== undefined ? fmtValue(g.fits) : "–");
    });
  }

  // -- a card per model -------------------------------------------------------------------------

  const cardIds = new Map();
  function cardId(id) {
    if (!cardIds.has(id)) cardIds.set(id, newId("model"));
    return cardIds.get(id);
  }

  function renderCards(models) {
    const holder = document.getElementById("model-cards");
    const seen = new Set();
    for (const m of models) {
      seen.add(m.id);
      let card = state.cards.get(m.id);
      if (card === undefined) {
        card = makeCard(m);
        state.cards.set(m.id, card);
        holder.append(card.root);
      }
      updateCard(card, m);
    }
    for (const [id, card] of state.cards) {
      if (!seen.has(id)) { card.root.remove(); state.cards.delete(id); }
    }
  }

  const SUMMARY = [["backend", "Backend"], ["replicas", "Replicas"], ["capacity", "Capacity"],
    ["routing", "Routing"], ["overrides", "Overrides"], ["memory", "Memory"], ["lifecycle", "Lifecycle"],
    ["loads", "Loads / unloads"], ["error", "Last error"]];

  function makeCard(m) {
    const id = cardId(m.id);
    const title = el("h3", {id: `${id}-title`}, el("span", {class: "name", text: m.id}));
    const badge = title.appendChild(el("span", {class: "state"}));
    const dl = el("dl", {});
    const fields = {};
    for (const [key, label] of SUMMARY) {
      fields[key] = el("dd", {"data-field": key});
      dl.append(el("div", {}, el("dt", {text: label}), fields[key]));
    }
    const result = el("output", {class: "result", role: "status", "aria-live": "polite", "data-role": "action-result"});
    const loadButton = el("button", {type: "button", "aria-expanded": "false"}, "Load…");
    const unloadButton = el("button", {type: "button", class: "danger"}, "Unload");
    const scaleId = `${id}-scale`;
    const scaleInput = el("input", {id: scaleId, type: "number", min: 1, step: 1, inputmode: "numeric"});
    const scaleButton = el("button", {type: "button"}, "Scale");
    const formHolder = el("div", {});
    const card = {root: null, badge, fields, result, loadButton, unloadButton, scaleInput, scaleButton, formHolder,
                  form: null, model: m};
    loadButton.addEventListener("click", () => toggleLoadForm(card));
    unloadButton.addEventListener("click", () => unload(card));
    scaleButton.addEventListener("click", () => scale(card));
    scaleInput.addEventListener("keydown", (ev) => { if (ev.key === "Enter") scale(card); });
    const actions = el("div", {class: "actions"}, loadButton, unloadButton,
      el("label", {for: scaleId}, "Replicas"), scaleInput, scaleButton, result);
    const replicaTable = el("table", {class: "replicas"},
      el("caption", {text: "Replicas"}),
      el("thead", {}, el("tr", {}, ...["#", "State", "PID", "Port", "In flight", "Restarts", "Ejections",
        "Failures in a row", "Backend running / waiting", "KV cache", "Prefix cache hits", "Affinity keys / picks / spills",
        "Last error", "Log"].map((h) => el("th", {scope: "col", text: h})))),
      el("tbody", {}));
    const keyCaption = el("caption", {});
    const keyTable = el("table", {class: "keys"}, keyCaption,
      el("thead", {}, el("tr", {}, ...["Fairness key", "Active", "Waiting", "Weight", "Running time (s)"]
        .map((h) => el("th", {scope: "col", text: h})))),
      el("tbody", {}));
    card.replicaBody = replicaTable.tBodies[0];
    card.keyBody = keyTable.tBodies[0];
    card.keyCaption = keyCaption;
    card.root = el("section", {class: "model", id, "data-model": m.id, "aria-labelledby": `${id}-title`},
      title, dl, actions, formHolder, replicaTable, keyTable);
    return card;
  }

  function updateCard(card, m) {
    card.model = m;
    stateBadge(card.badge, m.state);
    const f = card.fields;
    const ready = m.replicas.filter((r) => r.state === "ready").length;
    setText(f.backend, m.backend);
    setText(f.replicas, `${ready} ready of ${m.replica_count} (at most ${m.replica_max})`);
    setText(f.capacity, `${m.capacity} slots (${m.target_inflight} per replica); ${m.active} active, ${m.waiting} waiting`);
    setText(f.routing, m.routing || "–");
    setText(f.overrides, fmtOverrides(m.overrides) || "none");
    const fp = m.footprint || {};
    setText(f.memory, `${(fp.devices || []).join(", ") || "none"}: needs ` +
      Object.entries(fp.needed_mib || {}).map(([d, v]) => `${fmtMiB(v)} on ${d}`).join(", ") +
      ` (${fp.admitted_by || "–"})`);
    const life = [];
    const closed = refusing(m);
    if (closed) life.push(`refusing requests: ${closed.reason}`);
    if (m.pinned) life.push("pinned");
    if (m.load_on_demand) life.push("loads on demand");
    if (m.idle_unload_s !== null && m.idle_unload_s !== undefined) life.push(`idle unload after ${m.idle_unload_s} s`);
    if (m.idle_for_s !== null && m.idle_for_s !== undefined) life.push(`idle for ${m.idle_for_s} s`);
    if (m.backoff) life.push(`backing off ${m.backoff.next_attempt_in_s} s: ${m.backoff.reason}`);
    if (m.waiting_for_room) life.push("waiting for room");
    if (m.load_retry) life.push(`load retry ${m.load_retry.attempts}, next in ${m.load_retry.next_retry_in_s} s`);
    setText(f.lifecycle, life.join("; ") || "–");
    setText(f.loads, `${fmtOverrides(m.loads) || "0"} / ${fmtOverrides(m.unloads) || "0"}`);
    setText(f.error, m.last_error || "none");
    f.error.className = m.last_error ? "error-text" : "";

    const loadable = m.load_constraints && m.load_constraints.loadable;
    card.loadButton.disabled = !loadable || !["unloaded", "failed"].includes(m.state);
    card.unloadButton.disabled = !["loaded", "loading", "failed"].includes(m.state);
    card.scaleButton.disabled = m.state !== "loaded";
    card.scaleInput.max = m.replica_max;
    if (document.activeElement !== card.scaleInput && !card.scaleInput.dataset.edited) {
      card.scaleInput.value = m.replica_count;
    }

    syncRows(card.replicaBody, m.replicas, (r) => r.index, (row) => {
      const c = cells(row, ["index", "state", "pid", "port", "inflight", "restarts", "ejections", "failures",
                            "reported", "kv", "cache", "affinity", "error", "log"],
                      ["index", "pid", "port", "inflight", "restarts", "ejections", "failures"]);
      c.badge = c.state.appendChild(el("span", {}));
      c.logButton = c.log.appendChild(el("button", {type: "button"}, "Log"));
      c.logButton.addEventListener("click", () => openLog(card.model.id, Number(row.dataset.key)));
      return c;
    }, (c, r) => {
      setText(c.index, r.index);
      stateBadge(c.badge, r.state + (r.ejected_for_s > 0 ? ` (ejected ${r.ejected_for_s} s)` : ""));
      c.badge.className = `state ${r.state}`;
      setText(c.pid, r.pid === null ? "–" : r.pid);
      setText(c.port, r.port === null ? "–" : r.port);
      setText(c.inflight, r.inflight);
      setText(c.restarts, r.restarts);
      setText(c.ejections, r.ejections);
      setText(c.failures, r.consecutive_failures);
      const rep = r.reported || {};
      setText(c.reported, rep.running === undefined ? "–" : `${rep.running} / ${rep.waiting}`);
      setText(c.kv, rep.kv_cache === undefined ? "–" : `${(rep.kv_cache * 100).toFixed(1)} %`);
      setText(c.cache, r.cache_hit_rate === null || r.cache_hit_rate === undefined ? "–" :
        `${(r.cache_hit_rate * 100).toFixed(0)} % (${r.cached_prompt_tokens} tokens)`);
      setText(c.affinity, `${r.affinity_keys} / ${r.affinity_picks} / ${r.affinity_spills}`);
      setText(c.error, r.last_error || "");
      c.error.className = "error-text";
      c.logButton.disabled = r.program === null;   // a remote endpoint has no process log
      c.logButton.setAttribute("aria-label", `Log of ${card.model.id} replica ${r.index}`);
    });

    const keys = Object.entries(m.keys || {}).map(([key, v]) => ({key, ...v}));
    setText(card.keyCaption, `Fairness keys: ${m.key_counts.total} known, ${m.key_counts.active} active` +
      (keys.length < m.key_counts.total ? ` (the ${keys.length} most active shown)` : ""));
    syncRows(card.keyBody, keys, (k) => k.key, (row) =>
      cells(row, ["key", "active", "waiting", "weight", "usage"], ["active", "waiting", "weight", "usage"]), (c, k) => {
      setText(c.key, k.key);
      setText(c.active, k.active);
      setText(c.waiting, k.waiting);
      setText(c.weight, k.weight);
      setText(c.usage, k.usage_s === undefined ? "–" : Number(k.usage_s).toFixed(2));
    });
  }

  function report(card, text, ok) {
    card.result.className = `result${ok === true ? " ok" : ok === false ? " error" : ""}`;
    setText(card.result, text);
  }

  const described = (m) => `${m.id} is ${m.state}: ${m.replicas.filter((r) => r.state === "ready").length} of ` +
    `${m.replica_count} replicas ready` + (m.last_error ? `; ${m.last_error}` : "");

  async function unload(card) {
    const id = card.model.id;
    if (!window.confirm(`Unload ${id}? Running requests finish first; new ones are refused.`)) return;
    card.unloadButton.disabled = true;
    report(card, `unloading ${id}…`);
    try {
      report(card, described(await api("POST", modelPath(id, "unload"))), true);
    } catch (err) {
      report(card, String(err), false);
    }
    poll();
  }

  async function scale(card) {
    const id = card.model.id;
    const input = card.scaleInput;
    const count = Number(input.value);
    const max = card.model.replica_max;
    if (!Number.isInteger(count) || count < 1 || count > max) {
      input.setAttribute("aria-invalid", "true");
      report(card, `replicas must be a whole number from 1 to ${max} (replica_max)`, false);
      input.focus();
      return;
    }
    input.removeAttribute("aria-invalid");
    card.scaleButton.disabled = true;
    report(card, `scaling ${id} to ${count}…`);
    try {
      report(card, described(await api("POST", modelPath(id, "scale"), {replicas: count})), true);
    } catch (err) {
      report(card, String(err), false);
    }
    delete input.dataset.edited;
    poll();
  }

  // -- the load form, built from load_constraints -----------------------------------------------

  function toggleLoadForm(card) {
    if (card.form) {
      card.form.remove();
      card.form = null;
      card.loadButton.setAttribute("aria-expanded", "false");
      return;
    }
    card.form = buildLoadForm(card);
    card.formHolder.append(card.form);
    card.loadButton.setAttribute("aria-expanded", "true");
    const first = card.form.querySelector("input, select, textarea");
    if (first) first.focus();
  }

  function buildLoadForm(card) {
    return window.LlmPool.loadForm(card.model, {
      submit: async (body) => {
        try {
          return described(await api("POST", modelPath(card.model.id, "load"), body));
        } finally {
          poll();
        }
      },
      cancel: () => { toggleLoadForm(card); card.loadButton.focus(); },
    });
  }

  // -- a replica's log, followed ----------------------------------------------------------------

  const logSection = document.getElementById("log");
  const logText = document.getElementById("log-text");
  const logStatus = document.getElementById("log-status");
  const logFollow = document.getElementById("log-follow");

  function openLog(model, replica) {
    closeLog();
    state.log = {model, replica, offset: null, follow: true, timer: null};
    setText(document.getElementById("log-title"), `Log of ${model} replica ${replica}`);
    setText(logText, "");
    logFollow.setAttribute("aria-pressed", "true");
    setText(logFollow, "Following");
    logSection.hidden = false;
    logSection.scrollIntoView({block: "nearest"});
    logText.focus();
    readLog(state.log);
  }

  function closeLog() {
    if (state.log && state.log.timer) clearTimeout(state.log.timer);
    state.log = null;
    logSection.hidden = true;
  }

  async function readLog(log) {
    const query = log.offset === null ? `replica=${log.replica}&bytes=${LOG_FIRST_BYTES}` :
      `replica=${log.replica}&offset=${log.offset}&bytes=${LOG_POLL_BYTES}`;
    try {
      const got = await api("GET", `${modelPath(log.model, "logs")}?${query}`);
      if (state.log !== log) return;   // closed or another log opened meanwhile
      const atBottom = logText.scrollTop + logText.clientHeight >= logText.scrollHeight - 4;
      let text = got.text;
      if (got.overflow) text = `\n[… more came than one read takes: skipped to the last ${LOG_POLL_BYTES} bytes …]\n${text}`;
      if (text) {
        let all = logText.textContent + text;
        if (all.length > LOG_KEEP_CHARS) all = all.slice(all.length - LOG_KEEP_CHARS);
        logText.textContent = all;
        if (atBottom) logText.scrollTop = logText.scrollHeight;
      }
      log.offset = got.offset;
      setText(logStatus, `${got.program}: ${got.offset} bytes` + (log.follow ? ", following" : ""));
    } catch (err) {
      if (state.log !== log) return;
      setText(logStatus, String(err));
    }
    if (log.follow && state.log === log) log.timer = setTimeout(() => readLog(log), LOG_MS);
  }

  logFollow.addEventListener("click", () => {
    const log = state.log;
    if (!log) return;
    log.follow = !log.follow;
    logFollow.setAttribute("aria-pressed", String(log.follow));
    setText(logFollow, log.follow ? "Following" : "Follow");
    if (log.timer) clearTimeout(log.timer);
    if (log.follow) readLog(log);
  });
  document.getElementById("log-close").addEventListener("click", closeLog);

  // -- the token --------------------------------------------------------------------------------

  const tokenInput = document.getElementById("token");
  tokenInput.value = state.token;
  document.getElementById("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = tokenInput.value.trim();
    if (state.token) sessionStorage.setItem(TOKEN_KEY, state.token);
    else sessionStorage.removeItem(TOKEN_KEY);
    poll();
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    state.token = "";
    tokenInput.value = "";
    sessionStorage.removeItem(TOKEN_KEY);
    poll();
  });
  document.addEventListener("input", (ev) => {
    if (ev.target.type === "number" && ev.target.id.endsWith("-scale")) ev.target.dataset.edited = "1";
  });

  setText(document.getElementById("window"), WINDOW_MS / 1000);
  schedule();
})();
