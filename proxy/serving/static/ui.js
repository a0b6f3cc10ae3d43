// llm-pool status page: reads the admin API every POLL_MS and acts through it. No framework, no
// build step. One screen holds the overview (a row per model), the hosts, memory and the events
// feed; a model's details (its card: actions, load form, replicas, keys) open on demand.
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
    cards: new Map(),           // model id -> its card's elements, while its details are open
    open: new Set(),            // the models whose details are open
    models: [],
    log: null,                  // {model, replica, offset, follow, timer}
  };
  window.LlmPool.token = state.token;

  const {el, setText, newId, syncRows, cells, fmtValue, fmtMiB, fmtBytes, fmtSeconds, fmtRate, stateBadge, isGpu,
         api, modelPath, renderCards, refusing, readEvents, noteModels, renderHosts, readUsage} = window.LlmPool;

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
      const [models, traffic, memory, hosts, processes, gpu, batches] = await Promise.all([
        api("GET", "v1/admin/models"), api("GET", "v1/admin/traffic"), api("GET", "v1/admin/memory"),
        api("GET", "v1/admin/hosts"), api("GET", "v1/admin/processes"),
        withGpu ? api("GET", "v1/admin/gpu-memory") : Promise.resolve(null),
        // engine.batches.enabled false: no such route (404), and no line for it.
        api("GET", "v1/admin/batches").catch((err) => { if (err.status === 404) return null; throw err; })]);
      showProblem(null);
      noteReading(traffic);
      state.models = models.data;
      renderOverview(models.data);
      renderHosts(hosts.data);
      renderProcesses(processes.data);
      renderBatches(batches);
      renderMemory(models.data, memory, gpu);
      renderDetails();
      noteModels(models.data);
      await readEvents();
      if (withGpu) await readUsage();   // the ledger's sums change slowly: every few polls
      setText(document.getElementById("updated"), `updated ${new Date().toLocaleTimeString()}` +
        (models.supervisord && models.supervisord.answering === false ? " · supervisord is not answering" : ""));
    } catch (err) {
      showProblem(err);
      if (err.status === 401) state.polls = 0;   // read the GPUs too as soon as the token works
    }
  }

  // One line: the proxy's process, or its controller and workers (/v1/admin/processes).
  function renderProcesses(rows) {
    const count = (n, what) => n === null ? `? ${what}` : `${n} ${what}`;
    const of = (r) => `pid ${r.pid} · ${count(r.connections, "connections")} · ${count(r.requests, "requests")}`;
    const [first, ...workers] = rows;
    let text = first.role === "single" ? `one process: ${of(first)}` : `controller ${of(first)}`;
    if (workers.length) {
      text += ` · ${workers.length} workers: ` + workers.map((w) =>
        `#${w.index} ${w.state === "running" ? of(w) : w.state}` + (w.restarts ? ` (${w.restarts} restarts)` : ""))
        .join("; ");
    }
    setText(document.getElementById("processes"), text);
  }

  // One line: the batches still running, each with its progress and rate, and each model's batch
  // class queue (/v1/admin/batches, docs/batches.md).
  function renderBatches(view) {
    const line = document.getElementById("batches");
    const running = view ? view.data.filter((b) => ["in_progress", "cancelling", "finalizing"].includes(b.status)) : [];
    line.hidden = !view;
    if (!view) return;
    const ended = view.data.length - running.length;
    let text = running.length ? `batches: ` + running.map((b) => `${b.id} (${b.owner || "no tenant"}, ${b.model}) ` +
      `${b.status === "in_progress" ? "" : b.status + " "}${b.completed + b.failed}/${b.total} done` +
      (b.failed ? `, ${b.failed} failed` : "") + (b.lines_per_s === null ? "" : `, ${b.lines_per_s} lines/s`)).join("; ")
      : "batches: none running";
    text += ended ? ` · ${ended} ended` : "";
    for (const [model, q] of Object.entries(view.queues || {})) {
      text += ` · ${model}: batch class ${q.running || 0} running, ${q.waiting || 0} waiting`;
    }
    setText(line, text);
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

  // -- the overview: a row per model, its details on demand ----------------------------------------

  const cardIds = new Map();
  function cardId(id) {
    if (!cardIds.has(id)) cardIds.set(id, newId("model"));
    return cardIds.get(id);
  }

  function toggleDetails(id) {
    if (state.open.has(id)) state.open.delete(id); else state.open.add(id);
    renderOverview(state.models);
    renderDetails();
    const card = state.cards.get(id);
    if (card) {
      card.root.scrollIntoView({block: "nearest"});
      card.root.focus({preventScroll: true});
    }
  }

  const hooks = {poll: () => poll(), openLog: (model, replica) => openLog(model, replica), cardId,
                 closeCard: (id) => { toggleDetails(id); focusDetailsButton(id); }};

  function focusDetailsButton(id) {
    const row = document.querySelector(`#overview tbody tr[data-key="${CSS.escape(id)}"]`);
    if (row) row.querySelector("button.details").focus();
  }

  function renderDetails() {
    const holder = document.getElementById("model-cards");
    renderCards(holder, state.cards, state.models, state.open, hooks);
    document.getElementById("models").hidden = state.open.size === 0;
  }

  const hostsOf = (m) => [...new Set(m.replicas.map((r) => r.host || "local"))].join(", ");

  function needText(m) {
    const fp = m.footprint || {};
    // What the estimate of a missing file says (the engine process alone) is no need: the file is missing.
    if ((fp.missing_files || []).length) return "file missing";
    return Object.entries(fp.needed_mib || {}).map(([d, v]) => `${fmtMiB(v)} ${d}`).join(", ") || "–";
  }

  function renderOverview(models) {
    const tbody = document.querySelector("#overview tbody");
    syncRows(tbody, models, (m) => m.id, (row) => {
      const c = cells(row, ["name", "state", "ready", "active", "waiting", "capacity", "rate", "errors", "p50",
                            "p95", "wait", "total", "hosts", "memory", "last"],
                      ["ready", "active", "waiting", "capacity", "rate", "errors", "p50", "p95", "wait", "total"]);
      c.toggle = c.name.appendChild(el("button", {type: "button", class: "details", "aria-expanded": "false"}));
      c.toggle.addEventListener("click", () => toggleDetails(row.dataset.key));
      c.badge = c.state.appendChild(el("span", {}));
      c.refusing = c.state.appendChild(el("span", {class: "error-text"}));
      c.last.className = "last";
      return c;
    }, (c, m) => {
      const open = state.open.has(m.id);
      setText(c.toggle, `${open ? "▾" : "▸"} ${m.id}`);
      c.toggle.setAttribute("aria-expanded", String(open));
      c.toggle.setAttribute("aria-label", `Details of ${m.id}`);
      if (open) c.toggle.setAttribute("aria-controls", cardId(m.id)); else c.toggle.removeAttribute("aria-controls");
      // Unloaded but loaded by its next request: not the same as unloaded until an admin loads it.
      stateBadge(c.badge, m.state, m.state === "unloaded" && m.load_on_demand ? "loads on demand" : m.state);
      const closed = refusing(m);
      setText(c.refusing, closed ? ` refusing (${closed.code})` : "");
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
      setText(c.hosts, hostsOf(m) || "–");
      setText(c.memory, needText(m));
      c.memory.title = ((m.footprint || {}).missing_files || []).join("; ");
      c.memory.className = c.memory.title ? "error-text" : "";
      // The last error, or why a replica is not serving: one line here, whole in the details.
      const why = m.last_error || (m.replicas.find((r) => r.last_error) || {}).last_error || "";
      setText(c.last, why.split("\n")[0]);
      c.last.title = why;
    });
  }

  // -- memory -------------------------------------------------------------------------------------

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
    // Models that take each other's room in turn (a `thrash` within engine.lifecycle.thrash_window_s).
    const thrash = memory.thrash ? memory.thrash.recent : null;
    const warning = document.getElementById("memory-warning");
    setText(warning, thrash ? `Working set too big: ${thrash.message}` : "");
    warning.hidden = !thrash;
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
      // A model that counts on no GPU has no GPU figures: the report's estimate for it is what its
      // files would take on one, not anything it holds or needs here.
      const onGpu = (fp.devices || []).some(isGpu);
      const g = onGpu && report && report.models ? report.models[m.id] : null;
      setText(c.name, m.id);
      setText(c.devices, (fp.devices || []).join(", ") || "none");
      c.devices.title = fp.why || "";
      setText(c.by, fp.admitted_by || "–");
      setText(c.measured, fmtMiB(fp.measured_mib_per_replica));
      setText(c.estimated, fmtMiB(fp.estimated_mib_per_replica));
      setText(c.gpuMeasured, g && g.measured ? (g.measured.used_mib === null ? g.measured.reason : fmtMiB(g.measured.used_mib)) : "");
      setText(c.gpuEstimate, g && g.estimate ? fmtMiB(g.estimate.total_mib) : "");
      setText(c.fits, g && g.fits !== null && g.fits !== undefined ? fmtValue(g.fits) : "");
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
    window.LlmPool.token = state.token;
    if (state.token) sessionStorage.setItem(TOKEN_KEY, state.token);
    else sessionStorage.removeItem(TOKEN_KEY);
    poll();
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    state.token = "";
    window.LlmPool.token = "";
    tokenInput.value = "";
    sessionStorage.removeItem(TOKEN_KEY);
    poll();
  });

  setText(document.getElementById("window"), WINDOW_MS / 1000);
  schedule();
})();
