// llm-pool status page: a model's details, on demand (its card: definition, actions, load form,
// replicas, fairness keys), and which of its controls can work now. Made once per model, then only
// their text changes, so a form being filled in or a focused button survives every refresh.
"use strict";
(() => {
  const {el, setText, newId, syncRows, cells, fmtValue, fmtMiB, stateBadge, api, modelPath} = window.LlmPool;

  function fmtOverrides(overrides, prefix) {
    const parts = [];
    for (const [key, value] of Object.entries(overrides || {})) {
      const path = prefix ? `${prefix}.${key}` : key;
      if (value !== null && typeof value === "object" && !Array.isArray(value)) parts.push(fmtOverrides(value, path));
      else parts.push(`${path}=${fmtValue(value)}`);
    }
    return parts.filter(Boolean).join(", ");
  }

  // A loaded model whose queue is closed refuses every request although its state says it serves; in
  // any other state the state itself says what a request gets (refused, or loaded on demand).
  const refusing = (m) => m.state === "loaded" && m.admission && !m.admission.open ? m.admission : null;

  // Which actions can work on the model now: null where one can, else why not (shown on the
  // disabled control). What the pool answers to each state: a load of a loaded model is refused
  // (409 model_already_loaded) unless its settings are the same, when it does nothing; an unload
  // of an unloaded or unloading one is 409 model_not_loaded; only a loaded model scales.
  function controls(m) {
    const loadable = m.load_constraints && m.load_constraints.loadable;
    const s = m.state;
    return {
      load: !loadable ? "this version of llm-pool cannot run its backend" :
        s === "loaded" ? `${m.id} is loaded: unload it first to load it with other settings` :
        s === "loading" ? `${m.id} is loading` : s === "unloading" ? `${m.id} is unloading` : null,
      unload: s === "unloaded" ? `${m.id} is not loaded` : s === "unloading" ? `${m.id} is unloading` : null,
      scale: s !== "loaded" ? "only a loaded model scales (a load takes a replica count)" :
        m.replica_max <= 1 ? `replica_max of ${m.id} is 1` : null,
    };
  }

  function allow(button, why) {
    button.disabled = why !== null;
    button.title = why || "";
  }

  const ready = (m) => m.replicas.filter((r) => r.state === "ready").length;
  const described = (m) => `${m.id} is ${m.state}: ${ready(m)} of ${m.replica_count} replicas ready` +
    (m.last_error ? `; ${m.last_error}` : "");

  const SUMMARY = [["backend", "Backend"], ["replicas", "Replicas"], ["capacity", "Capacity"],
    ["classes", "Priority classes"], ["adapters", "LoRA adapters"], ["routing", "Routing"], ["overrides", "Overrides"],
    ["memory", "Memory"], ["lifecycle", "Lifecycle"],
    ["loads", "Loads / unloads"], ["kv", "Slots kept across swaps"], ["error", "Last error"]];
  const REPLICA_COLUMNS = ["#", "Host", "State", "PID", "Port", "In flight", "Backend running / waiting", "KV cache",
    "Restarts", "Ejections", "Failures in a row", "Prefix cache hits", "Affinity keys / picks / spills",
    "Last error", "Log"];

  // hooks: {poll(), openLog(model, replica), closeCard(model)}
  function makeCard(m, id, hooks) {
    const title = el("h3", {id: `${id}-title`}, el("span", {class: "name", text: m.id}));
    const badge = title.appendChild(el("span", {class: "state"}));
    const close = title.appendChild(el("button", {type: "button", class: "close", "aria-label": `Close ${m.id}`}, "Close"));
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
                  form: null, model: m, hooks};
    close.addEventListener("click", () => hooks.closeCard(m.id));
    loadButton.addEventListener("click", () => toggleLoadForm(card));
    unloadButton.addEventListener("click", () => unload(card));
    scaleButton.addEventListener("click", () => scale(card));
    scaleInput.addEventListener("keydown", (ev) => { if (ev.key === "Enter" && !scaleButton.disabled) scale(card); });
    scaleInput.addEventListener("input", () => { scaleInput.dataset.edited = "1"; });
    const actions = el("div", {class: "actions"}, loadButton, unloadButton,
      el("label", {for: scaleId}, "Replicas"), scaleInput, scaleButton, result);
    const replicaTable = el("table", {class: "replicas"},
      el("caption", {text: "Replicas"}),
      el("thead", {}, el("tr", {}, ...REPLICA_COLUMNS.map((h) => el("th", {scope: "col", text: h})))),
      el("tbody", {}));
    const keyCaption = el("caption", {});
    const keyTable = el("table", {class: "keys"}, keyCaption,
      el("thead", {}, el("tr", {}, ...["Fairness key", "Active", "Waiting", "Weight", "Running time (s)"]
        .map((h) => el("th", {scope: "col", text: h})))),
      el("tbody", {}));
    card.replicaBody = replicaTable.tBodies[0];
    card.keyBody = keyTable.tBodies[0];
    card.keyCaption = keyCaption;
    card.root = el("section", {class: "model", id, "data-model": m.id, "aria-labelledby": `${id}-title`, tabindex: "-1"},
      title, dl, actions, formHolder, replicaTable, keyTable);
    return card;
  }

  // The slot store's figures for a llama-server model (docs/lifecycle.md: KV cache across swaps); "–" for others.
  function kvStore(kv) {
    if (!kv) return "–";
    const r = kv.restored || {};
    const lost = [kv.cut_short ? `${kv.cut_short} cut short` : "", kv.over_budget ? `${kv.over_budget} over budget` : ""]
      .filter(Boolean).join(", ");
    return `${kv.stored_slots} stored (${fmtMiB(kv.stored_bytes / 1048576)}); saved ${kv.saved}` +
      (lost ? ` (not saved: ${lost})` : "") + `; restored ${r.hit || 0} hit, ${r.miss || 0} missed, ${r.stale || 0} stale` +
      (kv.restore_unverified ? "; restores showed no reuse: no longer saved" : "");
  }

  // Each LoRA adapter with its model id and the replicas that serve it now (docs/adapters.md).
  function fmtAdapters(m) {
    return (m.adapters || []).map((a) => {
      const holding = m.replicas.filter((r) => (r.adapters || []).includes(a.name)).map((r) => r.index);
      return `${a.id} (on ${holding.length ? "replica " + holding.join(", ") : "no replica"})`;
    }).join("; ") || "none";
  }

  // Each priority class, highest first (docs/routing.md#priority-classes): what runs and waits, and
  // for one with an aging bound how long its oldest request has waited against it.
  function fmtClasses(classes) {
    return Object.entries(classes || {}).map(([name, c]) => `${name} ${c.running} active, ${c.waiting} waiting` +
      (c.waiting && c.max_wait_s !== null ? ` (oldest ${Number(c.oldest_wait_s).toFixed(0)} s of ${c.max_wait_s} s)` :
        "")).join(" · ") || "–";
  }

  function updateCard(card, m) {
    card.model = m;
    stateBadge(card.badge, m.state);
    const f = card.fields;
    setText(f.backend, m.backend);
    setText(f.replicas, `${ready(m)} ready of ${m.replica_count} (at most ${m.replica_max})`);
    setText(f.capacity, `${m.capacity} slots (${m.target_inflight} per replica); ${m.active} active, ${m.waiting} waiting`);
    setText(f.classes, fmtClasses(m.classes));
    setText(f.adapters, fmtAdapters(m));
    setText(f.routing, m.routing || "–");
    setText(f.overrides, fmtOverrides(m.overrides) || "none");
    const fp = m.footprint || {};
    const missing = fp.missing_files || [];
    setText(f.memory, missing.length ? `file missing: ${missing.join(", ")}` :
      `${(fp.devices || []).join(", ") || "none"}: needs ` +
      Object.entries(fp.needed_mib || {}).map(([d, v]) => `${fmtMiB(v)} on ${d}`).join(", ") +
      ` (${fp.admitted_by || "–"})`);
    f.memory.className = missing.length ? "error-text" : "";
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
    setText(f.kv, kvStore(m.kv_store));
    setText(f.error, m.last_error || "none");
    f.error.className = m.last_error ? "error-text" : "";

    const can = controls(m);
    if (!card.busy) {
      allow(card.loadButton, can.load);
      allow(card.unloadButton, can.unload);
      allow(card.scaleButton, can.scale);
    }
    if (card.form) card.form.allow(can.load);
    card.scaleInput.disabled = can.scale !== null;
    card.scaleInput.max = m.replica_max;
    if (document.activeElement !== card.scaleInput && !card.scaleInput.dataset.edited) {
      card.scaleInput.value = m.replica_count;
    }

    syncRows(card.replicaBody, m.replicas, (r) => r.index, (row) => {
      const c = cells(row, ["index", "host", "state", "pid", "port", "inflight", "reported", "kv", "restarts",
                            "ejections", "failures", "cache", "affinity", "error", "log"],
                      ["index", "pid", "port", "inflight", "restarts", "ejections", "failures"]);
      c.badge = c.state.appendChild(el("span", {}));
      c.logButton = c.log.appendChild(el("button", {type: "button"}, "Log"));
      c.logButton.addEventListener("click", () => card.hooks.openLog(card.model.id, Number(row.dataset.key)));
      return c;
    }, (c, r) => {
      setText(c.index, r.index);
      setText(c.host, r.host || "local");
      stateBadge(c.badge, r.state, r.state + (r.ejected_for_s > 0 ? ` (ejected ${r.ejected_for_s} s)` : "") +
        (r.outdated ? " (out of date)" : ""));
      // Adopted with other settings than it is configured with now: its roll replaces it (docs/operating.md,
      // "What a reload keeps"); the title names the settings.
      c.badge.title = r.outdated ? String(r.outdated) : "";
      setText(c.pid, r.pid === null ? "–" : r.pid);
      setText(c.port, r.port === null ? "–" : r.port);
      setText(c.inflight, r.inflight);
      setText(c.reported, backendReading(r));
      const rep = r.reported || {};
      setText(c.kv, rep.kv_cache === undefined ? "–" : `${(rep.kv_cache * 100).toFixed(1)} %`);
      setText(c.restarts, r.restarts);
      setText(c.ejections, r.ejections);
      setText(c.failures, r.consecutive_failures);
      setText(c.cache, r.cache_hit_rate === null || r.cache_hit_rate === undefined ? "–" :
        `${(r.cache_hit_rate * 100).toFixed(0)} % (${r.cached_prompt_tokens} tokens)`);
      setText(c.affinity, `${r.affinity_keys} / ${r.affinity_picks} / ${r.affinity_spills}`);
      setText(c.error, r.last_error || "");
      c.error.className = "error-text";
      allow(c.logButton, r.program === null ? "a remote endpoint has no process log" : null);
      c.logButton.setAttribute("aria-label", `Log of ${card.model.id} replica ${r.index}`);
    });

    const keys = Object.entries(m.keys || {}).map(([key, v]) => ({key, ...v}));
    setText(card.keyCaption, `Fairness keys: ${m.key_counts.total} known, ${m.key_counts.active} active` +
      (keys.length < m.key_counts.total ? ` (the ${keys.length} most active shown)` : ""));
    syncRows(card.keyBody, keys, (k) => k.key, (row) =>
      cells(row, ["key", "active", "waiting", "weight", "usage"], ["active", "waiting", "weight", "usage"]), (c, k) => {
      // The anonymous queue: requests that name no fairness key (with tenants, every one has its tenant's).
      setText(c.key, k.key === "" ? "(none)" : k.key);
      c.key.title = k.key === "" ? "requests that name no fairness_key" : "";
      setText(c.active, k.active);
      setText(c.waiting, k.waiting);
      setText(c.weight, k.weight);
      setText(c.usage, k.usage_s === undefined ? "–" : Number(k.usage_s).toFixed(2));
    });
  }

  // What the engine said on /metrics is one instant, up to a scrape interval old, and the proxy's
  // "in flight" is now: shown bare side by side they disagree (0 / 0 beside 2 in flight when
  // short requests come and go between readings). The reading says when it was taken and how many
  // of the proxy's requests were there then.
  function backendReading(r) {
    const rep = r.reported || {};
    if (rep.running === undefined) return "–";
    let text = `${rep.running} / ${rep.waiting === undefined ? "–" : rep.waiting}`;
    if (r.reported_age_s !== null && r.reported_age_s !== undefined) {
      text += ` (${r.reported_age_s} s ago, ${r.inflight_at_scrape} of ours then)`;
    }
    return text;
  }

  function report(card, text, ok) {
    card.result.className = `result${ok === true ? " ok" : ok === false ? " error" : ""}`;
    setText(card.result, text);
  }

  // An action's answer is the model's row as the action left it: shown at once, so no control stays
  // enabled for a state the model has already left.
  async function act(card, button, text, send) {
    card.busy = true;
    button.disabled = true;
    report(card, text);
    try {
      const answer = await send();
      report(card, described(answer), true);
      updateCard(card, {...card.model, ...answer});
    } catch (err) {
      report(card, String(err), false);
    } finally {
      card.busy = false;
      updateCard(card, card.model);
      card.hooks.poll();
    }
  }

  function unload(card) {
    const id = card.model.id;
    if (!window.confirm(`Unload ${id}? Running requests finish first; new ones are refused.`)) return;
    act(card, card.unloadButton, `unloading ${id}…`, () => api("POST", modelPath(id, "unload")));
  }

  function scale(card) {
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
    delete input.dataset.edited;
    act(card, card.scaleButton, `scaling ${id} to ${count}…`,
        () => api("POST", modelPath(id, "scale"), {replicas: count}));
  }

  function toggleLoadForm(card) {
    if (card.form) {
      card.form.remove();
      card.form = null;
      card.loadButton.setAttribute("aria-expanded", "false");
      return;
    }
    card.form = window.LlmPool.loadForm(card.model, {
      submit: async (body) => {
        try {
          const answer = await api("POST", modelPath(card.model.id, "load"), body);
          updateCard(card, {...card.model, ...answer});
          return described(answer);
        } finally {
          card.hooks.poll();
        }
      },
      cancel: () => { toggleLoadForm(card); card.loadButton.focus(); },
    });
    card.form.allow(controls(card.model).load);
    card.formHolder.append(card.form);
    card.loadButton.setAttribute("aria-expanded", "true");
    const first = card.form.querySelector("input, select, textarea");
    if (first) first.focus();
  }

  // The cards of the models whose details are open (`open`: model ids), in the overview's order.
  function renderCards(holder, cards, models, open, hooks) {
    const seen = new Set();
    let previous = null;
    for (const m of models) {
      if (!open.has(m.id)) continue;
      seen.add(m.id);
      let card = cards.get(m.id);
      if (card === undefined) {
        card = makeCard(m, hooks.cardId(m.id), hooks);
        cards.set(m.id, card);
      }
      const wanted = previous === null ? holder.firstChild : previous.nextSibling;
      if (card.root !== wanted) holder.insertBefore(card.root, wanted);   // moved only when out of order
      previous = card.root;
      updateCard(card, m);
    }
    for (const [id, card] of cards) {
      if (!seen.has(id)) { card.root.remove(); cards.delete(id); }
    }
  }

  Object.assign(window.LlmPool, {renderCards, controls, refusing});
})();
