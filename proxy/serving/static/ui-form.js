// llm-pool status page: the load form, built from a model's `load_constraints` (the schema's type,
// range and choices of each temporary override its backend takes), checked before it is sent.
"use strict";
(() => {
  const {el, setText, newId, fmtValue} = window.LlmPool;

  function typesOf(rule) {
    let types = rule.type === undefined ? [] : Array.isArray(rule.type) ? rule.type.slice() : [rule.type];
    if (rule.enum) {
      for (const v of rule.enum) {
        const t = v === null ? "null" : Number.isInteger(v) ? "integer" : typeof v;
        if (!types.includes(t)) types.push(t);
      }
    }
    const nullable = rule.nullable === true || types.includes("null");
    types = types.filter((t) => t !== "null");
    return {types, nullable};
  }

  // One input for the override at `path` (["sim", "ttft_ms"]); returns its reader.
  function makeField(container, path, rule, configured, readers) {
    const {types, nullable} = typesOf(rule);
    const name = path.join(".");
    if (types.length === 1 && types[0] === "object" && rule.properties) {
      const fieldset = container.appendChild(el("fieldset", {}, el("legend", {text: name})));
      if (rule.description) fieldset.append(el("p", {class: "note", text: rule.description}));
      for (const [key, sub] of Object.entries(rule.properties)) {
        makeField(fieldset, [...path, key], sub, configured && typeof configured === "object" ? configured[key] : undefined,
                  readers);
      }
      return;
    }
    const id = newId("field");
    const hintId = `${id}-hint`;
    const problemId = `${id}-problem`;
    const wrap = container.appendChild(el("div", {class: "field"}));
    wrap.append(el("label", {for: id, text: name}));
    let input;
    const shown = configured === undefined || configured === null ? "not set" : fmtValue(configured);
    if (rule.enum || (types.length === 1 && types[0] === "boolean")) {
      const options = rule.enum ? rule.enum.filter((v) => v !== null) : [true, false];
      input = el("select", {id, "aria-describedby": `${hintId} ${problemId}`},
        el("option", {value: "", text: `keep (configured: ${shown})`}),
        ...options.map((v) => el("option", {value: JSON.stringify(v), text: v === "" ? '"" (empty)' : String(v)})));
    } else if (types.length === 1 && (types[0] === "integer" || types[0] === "number")) {
      input = el("input", {id, type: "number", step: types[0] === "integer" ? 1 : "any",
        min: rule.minimum, max: rule.maximum, placeholder: shown, "aria-describedby": `${hintId} ${problemId}`});
    } else if (types.includes("object") || types.includes("array")) {
      input = el("textarea", {id, rows: 2, cols: 40, placeholder: `JSON; configured: ${shown}`, spellcheck: "false",
        "aria-describedby": `${hintId} ${problemId}`});
    } else {
      input = el("input", {id, type: "text", placeholder: shown, spellcheck: "false",
        "aria-describedby": `${hintId} ${problemId}`});
    }
    wrap.append(input);
    const hint = [types.join(" or ") || "any"];
    if (rule.minimum !== undefined) hint.push(`≥ ${rule.minimum}`);
    if (rule.exclusiveMinimum !== undefined) hint.push(`> ${rule.exclusiveMinimum}`);
    if (rule.maximum !== undefined) hint.push(`≤ ${rule.maximum}`);
    if (rule.exclusiveMaximum !== undefined) hint.push(`< ${rule.exclusiveMaximum}`);
    if (rule.description) hint.push(rule.description);
    wrap.append(el("span", {class: "hint", id: hintId, text: hint.join("; ")}));
    let nullBox = null;
    if (nullable) {
      const boxId = `${id}-null`;
      nullBox = el("input", {id: boxId, type: "checkbox"});
      nullBox.addEventListener("change", () => { input.disabled = nullBox.checked; });
      wrap.append(el("label", {class: "null", for: boxId}, nullBox, " send null (unset it for this load)"));
    }
    const problem = wrap.appendChild(el("span", {class: "problem", id: problemId}));
    readers.push({path, input, problem, read: () => readField(input, nullBox, rule, types)});
  }

  // {set, value} or {error}: a value typed into a field, checked against its rule.
  function readField(input, nullBox, rule, types) {
    if (nullBox && nullBox.checked) return {set: true, value: null};
    const raw = input.value.trim();
    if (raw === "") return {set: false};
    let value;
    if (input.tagName === "SELECT") {
      value = JSON.parse(raw);
    } else if (types.length === 1 && (types[0] === "integer" || types[0] === "number")) {
      value = Number(raw);
      if (!Number.isFinite(value)) return {error: "must be a number"};
    } else if (types.includes("object") || types.includes("array") || types.length !== 1) {
      try { value = JSON.parse(raw); } catch (err) {
        if (types.includes("string")) value = raw;
        else return {error: "must be JSON"};
      }
    } else {
      value = raw;
    }
    const kind = value === null ? "null" : Array.isArray(value) ? "array" :
      Number.isInteger(value) ? "integer" : typeof value;
    const fits = types.length === 0 || types.includes(kind) || (kind === "integer" && types.includes("number"));
    if (!fits) return {error: `must be ${types.join(" or ")}`};
    if (typeof value === "number") {
      if (rule.minimum !== undefined && value < rule.minimum) return {error: `must be at least ${rule.minimum}`};
      if (rule.maximum !== undefined && value > rule.maximum) return {error: `must be at most ${rule.maximum}`};
      if (rule.exclusiveMinimum !== undefined && value <= rule.exclusiveMinimum) return {error: `must be more than ${rule.exclusiveMinimum}`};
      if (rule.exclusiveMaximum !== undefined && value >= rule.exclusiveMaximum) return {error: `must be less than ${rule.exclusiveMaximum}`};
    }
    if (rule.enum && !rule.enum.some((v) => JSON.stringify(v) === JSON.stringify(value))) {
      return {error: `must be one of ${rule.enum.map(fmtValue).join(", ")}`};
    }
    return {set: true, value};
  }

  // The form for loading model `m` (a row of GET /v1/admin/models). `actions.submit(body)` sends
  // the load and resolves to the text to show (or throws the error to show); `actions.cancel()`.
  function loadForm(m, actions) {
    const constraints = m.load_constraints;
    const readers = [];
    const form = el("form", {class: "load", novalidate: true, "aria-label": `Load ${m.id}`});
    const fieldset = form.appendChild(el("fieldset", {}, el("legend", {text: `Load ${m.id} with temporary overrides`})));
    fieldset.append(el("p", {class: "note",
      text: "Empty fields keep the configured value; nothing is written to the settings files."}));
    const names = Object.keys(constraints.overrides);
    if (!names.length) fieldset.append(el("p", {class: "note", text: "This backend takes no load overrides."}));
    for (const name of names) {
      const rule = constraints.overrides[name];
      makeField(fieldset, [name], rule, rule.configured, readers);
    }
    const r = constraints.replicas;
    makeField(fieldset, ["replicas"], {type: "integer", minimum: r.minimum, maximum: r.maximum,
      description: `configured ${r.configured}`}, r.configured, readers);
    const submit = el("button", {type: "submit", class: "primary"}, `Load ${m.id}`);
    const cancel = el("button", {type: "button"}, "Cancel");
    const output = el("output", {class: "result", role: "status", "aria-live": "polite"});
    const why = el("p", {class: "note", "data-role": "load-refused"});
    form.append(el("div", {class: "actions"}, submit, cancel, output), why);
    // Whether a load can work now (the card says, as the model's state changes): null, or why not.
    let allowed = null, sending = false;
    form.allow = (reason) => {
      allowed = reason;
      submit.disabled = sending || reason !== null;
      submit.title = reason || "";
      setText(why, reason || "");
    };
    cancel.addEventListener("click", () => actions.cancel());
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const overrides = {};
      let replicas;
      let firstBad = null;
      for (const reader of readers) {
        const got = reader.read();
        setText(reader.problem, got.error || "");
        if (got.error) reader.input.setAttribute("aria-invalid", "true");
        else reader.input.removeAttribute("aria-invalid");
        if (got.error && firstBad === null) firstBad = reader;
        if (!got.set) continue;
        if (reader.path.length === 1 && reader.path[0] === "replicas") { replicas = got.value; continue; }
        let at = overrides;
        for (const key of reader.path.slice(0, -1)) at = (at[key] = at[key] || {});
        at[reader.path[reader.path.length - 1]] = got.value;
      }
      if (firstBad !== null) {
        output.className = "result error";
        setText(output, `${firstBad.path.join(".")} ${firstBad.problem.textContent}`);
        firstBad.input.focus();
        return;
      }
      const body = {overrides};
      if (replicas !== undefined) body.replicas = replicas;
      if (allowed !== null) return;
      sending = true;
      submit.disabled = true;
      output.className = "result";
      setText(output, `loading ${m.id}… (answers once it is ready)`);
      try {
        const text = await actions.submit(body);
        output.className = "result ok";
        setText(output, text);
      } catch (err) {
        output.className = "result error";
        setText(output, String(err));
      } finally {
        sending = false;
        form.allow(allowed);
      }
    });
    return form;
  }


  window.LlmPool.loadForm = loadForm;
})();
