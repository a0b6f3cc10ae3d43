// llm-pool status page: the admin API as the page calls it, with the token typed into the page
// (window.LlmPool.token). Every answer is data: the page renders it as text, never as HTML.
"use strict";
(() => {
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
    const token = window.LlmPool.token;
    if (token) headers.Authorization = `Bearer ${token}`;
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

  Object.assign(window.LlmPool, {api, modelPath, ApiError, token: ""});
})();
