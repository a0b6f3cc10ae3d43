// llm-pool status page: the small DOM helpers the other scripts share (window.LlmPool). Loaded
// first; no framework, no build step.
"use strict";
(() => {
  // -- small DOM helpers ------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  function setText(node, text) {
    const value = text === null || text === undefined ? "" : String(text);
    if (node.textContent !== value) node.textContent = value;
  }

  let uid = 0;
  const newId = (prefix) => `${prefix}-${++uid}`;

  // Rows of `tbody` kept in step with `items`: a row per key, made once by `make` (which returns
  // an object of named cells), updated by `update`; rows of keys no longer there are removed.
  function syncRows(tbody, items, key, make, update) {
    const existing = new Map();
    for (const row of tbody.rows) existing.set(row.dataset.key, row);
    let previous = null;
    for (const item of items) {
      const k = String(key(item));
      let row = existing.get(k);
      if (row === undefined) {
        row = el("tr", {"data-key": k});
        row.cells_ = make(row, item);
        alignHeaders(tbody.parentNode, row);
      }
      existing.delete(k);
      update(row.cells_, item, row);
      const wanted = previous === null ? tbody.firstChild : previous.nextSibling;
      if (row !== wanted) tbody.insertBefore(row, wanted);   // only moved when out of order
      previous = row;
    }
    for (const row of existing.values()) row.remove();
    tbody.parentNode.hidden = items.length === 0;   // an empty table says nothing its caption would not
  }

  // A column of numbers has its header aligned as its values are.
  function alignHeaders(table, row) {
    const head = table.tHead && table.tHead.rows[0];
    if (!head) return;
    Array.from(row.cells).forEach((cell, i) => {
      if (cell.classList.contains("num") && head.cells[i]) head.cells[i].classList.add("num");
    });
  }

  function cells(row, names, numeric) {
    const out = {};
    for (const name of names) {
      out[name] = row.appendChild(el("td", {class: numeric && numeric.includes(name) ? "num" : null}));
    }
    return out;
  }


  function fmtValue(value) {
    if (value === null || value === undefined) return "null";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }


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
  const fmtAgo = (s) => (s === null || s === undefined ? "–" : s < 60 ? `${Math.round(s)} s ago` :
    s < 3600 ? `${Math.round(s / 60)} min ago` : `${(s / 3600).toFixed(1)} h ago`);
  const fmtClock = (epoch) => new Date(epoch * 1000).toLocaleTimeString([], {hour12: false});

  // A state as a badge: its words written out (never colour alone); its class is made of the
  // words, so a state the page does not know yet ("host unreachable") still gets one.
  function stateBadge(node, value, shown) {
    setText(node, shown === undefined ? value : shown);
    node.className = `state s-${String(value).toLowerCase().replace(/[^a-z0-9]+/g, "-")}`;
  }

  // Whether a device name of the admin API ("gpu0", "node-b:gpu1", "cpu") is a GPU.
  const isGpu = (device) => /(^|:)gpu\d*$/.test(String(device));

  window.LlmPool = {el, setText, newId, syncRows, cells, fmtValue, fmtMiB, fmtBytes, fmtSeconds, fmtRate, fmtAgo,
                    fmtClock, stateBadge, isGpu};
})();
