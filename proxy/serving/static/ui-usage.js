// llm-pool status page: what each tenant used and spent today (GET /v1/admin/usage, grouped by
// tenant and model since midnight UTC), read every few polls. A pool without tenants answers 409
// tenants_not_configured: the section stays hidden.
"use strict";
(() => {
  const {setText, syncRows, cells, api} = window.LlmPool;
  const section = document.getElementById("usage");
  const body = () => document.querySelector("#usage tbody");
  const NUMBERS = ["requests", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "cost"];

  async function readUsage() {
    const midnight = new Date();
    midnight.setUTCHours(0, 0, 0, 0);
    let got;
    try {
      got = await api("GET", `v1/admin/usage?group_by=tenant,model&from=${midnight.getTime() / 1000}`);
    } catch (err) {
      if (err.code === "tenants_not_configured") {
        section.hidden = true;
        return;
      }
      throw err;
    }
    section.hidden = false;
    syncRows(body(), got.data, (r) => `${r.tenant}\u0000${r.model}`,
      (row) => cells(row, ["tenant", "model", ...NUMBERS], NUMBERS),
      (c, r) => {
        setText(c.tenant, r.tenant);
        setText(c.model, r.model);
        for (const name of NUMBERS) setText(c[name], name === "cost" ? r.cost.toFixed(4) : r[name]);
      });
    setText(document.getElementById("usage-note"), got.data.length ? "" : "no requests by a tenant today");
  }

  Object.assign(window.LlmPool, {readUsage});
})();
