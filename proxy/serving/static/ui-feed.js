// llm-pool status page: the events feed (GET /v1/admin/events, read after the last id seen) and the
// hosts (GET /v1/admin/hosts). Every message is the pool's text about requests and replicas:
// rendered as text, never as HTML.
"use strict";
(() => {
  const {el, setText, syncRows, cells, fmtBytes, fmtAgo, fmtClock, stateBadge, api} = window.LlmPool;
  const KEEP = 300;            // events the page holds (the proxy keeps more: `ctl events`)
  const FIRST = 200;

  const feed = {events: [], lastId: 0, model: "", known: new Set()};
  const body = () => document.querySelector("#events tbody");
  const filter = document.getElementById("events-model");

  async function readEvents() {
    const query = feed.lastId ? `after=${feed.lastId}&limit=1000` : `limit=${FIRST}`;
    const got = await api("GET", `v1/admin/events?${query}`);
    if (got.last_id < feed.lastId) {   // another proxy answers now (a restart): its ids start again
      feed.events = [];
      feed.lastId = 0;
      return readEvents();
    }
    // An action's own refresh may run beside the timer's: an event is taken once.
    feed.events.push(...got.data.filter((e) => e.id > feed.lastId));
    if (feed.events.length > KEEP) feed.events.splice(0, feed.events.length - KEEP);
    feed.lastId = Math.max(feed.lastId, got.last_id);
    renderEvents();
    return got;
  }

  function renderEvents() {
    const shown = feed.events.filter((e) => !feed.model || e.model === feed.model).slice().reverse();
    syncRows(body(), shown, (e) => e.id, (row) => {
      const c = cells(row, ["time", "kind", "model", "message"]);
      c.badge = c.kind.appendChild(el("span", {}));
      return c;
    }, (c, e) => {
      setText(c.time, fmtClock(e.time));
      c.time.title = new Date(e.time * 1000).toISOString();
      stateBadge(c.badge, e.kind, e.kind.replace("_", " "));
      setText(c.model, (e.model || e.host || "–") + (e.replica !== null && e.replica !== undefined ? `/r${e.replica}` : ""));
      setText(c.message, e.message);
      c.message.title = [e.reason && `reason: ${e.reason}`, e.cause && `cause: ${e.cause}`,
                         e.actor && `by: ${e.actor}`].filter(Boolean).join("; ");
    });
    document.getElementById("events").hidden = false;   // an empty feed says so below, with the table
    setText(document.getElementById("events-note"), shown.length ? `${shown.length} shown, newest first` :
      feed.model ? `nothing yet about ${feed.model}` : "nothing has happened yet");
  }

  function noteModels(models) {
    for (const m of models) {
      if (feed.known.has(m.id)) continue;
      feed.known.add(m.id);
      filter.append(el("option", {value: m.id, text: m.id}));
    }
  }

  filter.addEventListener("change", () => { feed.model = filter.value; renderEvents(); });

  // -- hosts ------------------------------------------------------------------------------------

  function hostState(h) {
    if (h.state) return h.state;                     // a state the API names, shown as it is
    return h.answering ? "answering" : "not answering";
  }

  function devicesText(h) {
    const parts = [];
    const gpus = (h.devices && h.devices.gpus) || [];
    if (gpus.length) parts.push(`${gpus.length} GPU${gpus.length > 1 ? "s" : ""} (${gpus.map((g) => g.name).join(", ")})`);
    for (const d of h.memory || []) {
      parts.push(d.budget_bytes === null ? `${d.device}: no budget` :
        `${d.device}: ${fmtBytes(d.free_bytes)} free of ${fmtBytes(d.budget_bytes)}`);
    }
    return parts.join("; ") || (h.answering ? "–" : "unknown while it does not answer");
  }

  function renderHosts(hosts) {
    syncRows(document.querySelector("#hosts tbody"), hosts, (h) => h.name, (row) => {
      const c = cells(row, ["name", "state", "contact", "devices", "replicas"]);
      c.badge = c.state.appendChild(el("span", {}));
      c.error = c.state.appendChild(el("span", {class: "error-text"}));
      c.count = c.replicas.appendChild(el("span", {}));
      c.list = c.replicas.appendChild(el("span", {class: "note"}));
      return c;
    }, (c, h) => {
      setText(c.name, h.name + (h.url ? ` (${h.url})` : h.local ? " (this machine)" : ""));
      stateBadge(c.badge, hostState(h));
      setText(c.error, h.answering ? "" : ` for ${h.down_for_s} s: ${h.error || "no answer"}`);
      c.error.className = h.answering ? "" : "error-text block";
      c.state.classList.toggle("down", !h.answering);
      setText(c.contact, h.answering && h.last_contact_s === undefined ? "now" : fmtAgo(h.last_contact_s));
      setText(c.devices, devicesText(h));
      setText(c.count, h.replicas);
      setText(c.list, h.replica_names && h.replica_names.length ? ` ${h.replica_names.join(", ")}` : "");
    });
  }

  Object.assign(window.LlmPool, {readEvents, noteModels, renderHosts});
})();
