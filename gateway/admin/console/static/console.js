// The admin console's only script: send changes to the admin API with the session's
// CSRF token, show a new raw key once (with a copy button), keep the providers table live.
// Served from /ui/static/ under a CSP of 'self': no inline script anywhere.
"use strict";

(function () {
  const meta = (name) => {
    const el = document.querySelector(`meta[name="${name}"]`);
    return el ? el.getAttribute("content") : null;
  };
  const csrf = meta("csrf-token");

  async function api(method, path, body) {
    const headers = { "X-CSRF-Token": csrf || "", Accept: "application/json" };
    const init = { method, headers, credentials: "same-origin" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    return { ok: resp.ok, status: resp.status, data };
  }

  // A form's fields as the admin API's JSON: data-type says how to read each one; an
  // empty optional field is left out on create and sent as null on edit (clears it).
  function formBody(form, method) {
    const body = {};
    const path = { value: form.dataset.apiPath };
    for (const el of form.elements) {
      if (!el.name || el.disabled) continue;
      if (el.type === "checkbox" && !el.checked) continue;
      const raw = el.value.trim();
      const type = el.dataset.type;
      if (type === "path") { path.value = path.value.replace(`{${el.name}}`, encodeURIComponent(raw)); continue; }
      if (raw === "") { if (method === "PATCH") body[el.name] = null; continue; }
      if (type === "int") body[el.name] = parseInt(raw, 10);
      else if (type === "number") body[el.name] = Number(raw);
      else if (type === "list") body[el.name] = raw.split(",").map((s) => s.trim()).filter(Boolean);
      else body[el.name] = raw;
    }
    return { body, path: path.value };
  }

  function status(text, isError) {
    const el = document.getElementById("form-status");
    if (!el) { if (isError) window.alert(text); return; }
    el.textContent = text;
    el.className = isError ? "error" : "ok";
  }

  function showKey(data) {
    const panel = document.getElementById("raw-key");
    if (!panel || !data || !data.api_key) return false;
    document.getElementById("raw-key-value").textContent = data.api_key;
    document.getElementById("raw-key-link").setAttribute("href", `/ui/keys/${data.api_key_id}`);
    panel.hidden = false;
    document.getElementById("copy-key").focus();
    return true;
  }

  document.addEventListener("submit", async (event) => {
    const form = event.target;
    if (!form.dataset || !form.dataset.apiMethod) return;
    event.preventDefault();
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
    const method = form.dataset.apiMethod;
    let { body, path } = formBody(form, method);
    if (method === "PATCH") {
      for (const name of ["name", "rate_limit_requests", "rate_limit_window_seconds"]) {
        if (body[name] === null) delete body[name];  // required fields: empty means unchanged
      }
    }
    if (form.dataset.query !== undefined) {  // DELETE /admin/cache?...: the fields go in the query
      path += "?" + new URLSearchParams(body).toString();
      body = undefined;
    }
    const button = form.querySelector("button[type=submit]");
    if (button) button.disabled = true;
    try {
      const result = await api(method, path, method === "DELETE" ? undefined : body);
      if (!result.ok) {
        const msg = result.data && result.data.error ? result.data.error.message : `HTTP ${result.status}`;
        status(`Refused: ${msg}`, true);
        return;
      }
      if (form.dataset.showKey !== undefined && showKey(result.data)) { form.reset(); return; }
      if (method === "DELETE" && result.data && result.data.purged) {
        status(`Purged ${result.data.purged.memory} here, ${result.data.purged.shared} shared.`, false);
        return;
      }
      status("Saved.", false);
      window.location.reload();
    } finally {
      if (button) button.disabled = false;
    }
  });

  document.addEventListener("click", async (event) => {
    if (event.target.id !== "copy-key") return;
    const value = document.getElementById("raw-key-value").textContent;
    const state = document.getElementById("copy-state");
    try {
      await navigator.clipboard.writeText(value);
      state.textContent = "Copied.";
    } catch (e) {
      const range = document.createRange();  // no clipboard access: select it for Ctrl+C
      range.selectNodeContents(document.getElementById("raw-key-value"));
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      state.textContent = "Selected: press Ctrl+C.";
    }
  });

  // Providers: the table follows GET /admin/providers every 3 seconds.
  const providers = document.querySelector("#providers tbody");
  if (providers) {
    const pct = (v) => (v === null || v === undefined ? "—" : `${(v * 100).toFixed(1)}%`);
    const ms = (v) => (v === null || v === undefined ? "—" : `${Math.round(v).toLocaleString()} ms`);
    const cell = (text, cls) => { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; return td; };
    const refresh = async () => {
      const result = await api("GET", "/admin/providers");
      if (!result.ok) return;
      const rows = result.data.deployments.map((d) => {
        const tr = document.createElement("tr");
        tr.append(cell(d.id), cell(d.model_groups.map((g) => g.name).join(", ")));
        const state = document.createElement("td");
        const badge = document.createElement("span");
        badge.className = `circuit circuit-${d.circuit_state}`;
        badge.textContent = d.circuit_state;
        state.append(badge);
        tr.append(state, cell(ms(d.latency_ms), "num"), cell(pct(d.error_rate), "num"),
          cell(d.recent_requests === null ? "—" : String(d.recent_requests), "num"));
        return tr;
      });
      if (rows.length) providers.replaceChildren(...rows);
      const stamp = document.getElementById("refreshed");
      if (stamp) stamp.textContent = `Updated ${new Date().toLocaleTimeString()}.`;
    };
    window.setInterval(refresh, 3000);
  }
})();
