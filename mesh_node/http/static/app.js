// mesh-node status page: renders the status document (/api/status) and keeps it live
// through server-sent events (/api/events), or by polling once a second if those fail.
// Read-only: it only ever GETs. Every value from the node (some come from peers) is put in
// the page as text, never as HTML.
"use strict";

(() => {
  const POLL_MS = 1000;
  const STALE_MS = 5000;
  const $ = (id) => document.getElementById(id);

  function h(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("data-") || k === "title") e.setAttribute(k, String(v));
      else e[k] = v;
    }
    for (const kid of kids) {
      if (kid === undefined || kid === null) continue;
      e.append(kid instanceof Node ? kid : String(kid));
    }
    return e;
  }

  const short = (id) => (id ? String(id).slice(0, 12) : "-");
  // A node's colour, the same wherever it appears and for as long as the page is open: the
  // n-th node this page sees gets hue n x 137.5 degrees (the golden angle), so any few nodes
  // get well-separated colours.
  const hues = new Map();

  function assignHues(doc) {
    const ids = new Set([doc.node_id, ...(doc.peers || []).map((p) => p.node_id)]);
    for (const s of (doc.topology && doc.topology.stages) || []) ids.add(s.node_id);
    for (const id of [...ids].sort()) {
      if (!hues.has(id)) hues.set(id, Math.round((hues.size * 137.508) % 360));
    }
  }

  const hue = (id) => hues.get(id) ?? 0;

  function swatch(id) {
    const s = h("span", { class: "swatch" });
    s.style.setProperty("--h", String(hue(id)));
    return s;
  }

  function fmtBytes(n) {
    if (n === undefined || n === null) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n);
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }

  function fmtDuration(s) {
    s = Math.max(0, Math.floor(Number(s) || 0));
    const d = Math.floor(s / 86400);
    const hh = Math.floor((s % 86400) / 3600);
    const mm = Math.floor((s % 3600) / 60);
    const ss = s % 60;
    if (d) return `${d}d ${hh}h ${mm}m`;
    if (hh) return `${hh}h ${mm}m ${ss}s`;
    if (mm) return `${mm}m ${ss}s`;
    return `${ss}s`;
  }

  function fill(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  function show(id, visible) {
    $(id).hidden = !visible;
  }

  // --- this node ---------------------------------------------------------------------------
  function renderNode(doc) {
    show("node", true);
    $("title-id").textContent = short(doc.node_id);
    $("node-id").textContent = doc.node_id;
    $("node-id").dataset.nodeId = doc.node_id;
    $("node-owner").replaceChildren(
      doc.owner_id ? short(doc.owner_id) + " " : "none ",
      h("span", { class: doc.owner_status === "verified" ? "ok" : "warn" }, `(${doc.owner_status})`),
    );
    $("node-owner").title = doc.owner_id || "";
    $("node-features").textContent = featureText(doc.features);
    $("node-memory").textContent = fmtBytes(doc.memory_budget);
    $("node-devices").textContent = deviceText(doc.devices);
    $("node-uptime").textContent = fmtDuration(doc.uptime_s);
    $("node-listen").textContent = doc.listen || "-";
    $("node-transfer").textContent = doc.artifact_transfer;
  }

  // The node's devices as its hello advertises them (docs/devices.md).
  function deviceText(devices) {
    if (!devices) return "-";
    const parts = devices.list.map(
      (d) => `${d.name} ${d.type} ${fmtBytes(d.free_bytes)} free of ${fmtBytes(d.total_bytes)}`,
    );
    const moe = devices.experts_on_cpu ? " · experts in RAM" : "";
    return `${parts.join("; ")} · stages on ${devices.stage}${moe}`;
  }

  // Where a stage sits: as planned (device, mode, bytes on the device and in RAM), and for
  // this node's loaded stage, what it holds in device memory now.
  function placementText(planned, loaded) {
    const parts = [];
    if (planned) {
      parts.push(`${planned.device}: ${planned.mode}`);
      if (planned.device_bytes) parts.push(`${fmtBytes(planned.device_bytes)} on device`);
      if (planned.host_bytes) parts.push(`${fmtBytes(planned.host_bytes)} in RAM`);
    }
    if (loaded) {
      parts.push(
        `running on ${loaded.device} (${loaded.placement}), ` +
          `${fmtBytes(loaded.device_memory_bytes || 0)} in device memory`,
      );
    }
    return parts.length ? parts.join(" · ") : "-";
  }

  function featureText(features) {
    const parts = Object.entries(features || {}).map(([k, bits]) => `${k}: ${bits.join(", ")}`);
    return parts.length ? parts.join("; ") : "-";
  }

  // --- peers -----------------------------------------------------------------------------
  const lastBytes = new Map(); // node id -> {t, rx, tx, rxRate, txRate}

  function throughput(p, nowMs) {
    const prev = lastBytes.get(p.node_id);
    let rxRate = prev ? prev.rxRate : null;
    let txRate = prev ? prev.txRate : null;
    if (prev && nowMs - prev.t >= 500) {
      const dt = (nowMs - prev.t) / 1000;
      rxRate = Math.max(0, (p.bytes_received - prev.rx) / dt);
      txRate = Math.max(0, (p.bytes_sent - prev.tx) / dt);
    }
    if (!prev || nowMs - prev.t >= 500) {
      lastBytes.set(p.node_id, { t: nowMs, rx: p.bytes_received, tx: p.bytes_sent, rxRate, txRate });
    }
    return { rxRate, txRate };
  }

  function renderPeers(doc) {
    const peers = doc.peers || [];
    show("peers", peers.length > 0);
    const up = peers.filter((p) => p.connected).length;
    $("peers-count").textContent = `${up} up / ${peers.length} known`;
    const now = performance.now();
    fill(
      $("peers-rows"),
      peers.map((p) => {
        const t = throughput(p, now);
        const rate = (r) => (r === null ? "…" : fmtBytes(Math.round(r)) + "/s");
        return h(
          "tr",
          { "data-node-id": p.node_id, "data-connected": String(p.connected) },
          h("td", { title: p.node_id }, swatch(p.node_id), short(p.node_id)),
          h("td", {}, p.address || "-"),
          h(
            "td",
            { title: p.owner_id || "" },
            (p.owner_id ? short(p.owner_id) : "none") + " ",
            h("span", { class: p.owner_status === "verified" ? "dim" : "warn" }, `(${p.owner_status})`),
          ),
          h(
            "td",
            { class: "wrap" },
            h("span", { class: p.trusted ? "ok" : "warn" }, p.trusted ? "trusted" : "untrusted"),
            p.trust_reason ? h("span", { class: "dim" }, " · " + p.trust_reason) : null,
          ),
          h("td", { class: "wrap" }, featureText(p.features)),
          h(
            "td",
            {},
            p.connected
              ? h("span", { class: "ok" }, `up · ${Number(p.last_seen_s).toFixed(1)}s ago`)
              : h("span", { class: "bad" }, `down · ${fmtDuration(p.last_seen_s)} ago`),
          ),
          h(
            "td",
            { title: p.relay ? `relayed via ${p.relay}` : "direct link" },
            p.rtt_ms === null || p.rtt_ms === undefined ? "-" : `${Number(p.rtt_ms).toFixed(1)} ms`,
            p.connected && p.relay ? h("span", { class: "dim" }, ` · relayed via ${short(p.relay)}`) : null,
          ),
          h(
            "td",
            { title: `total in ${fmtBytes(p.bytes_received)}, out ${fmtBytes(p.bytes_sent)}` },
            `${rate(t.rxRate)} / ${rate(t.txRate)}`,
          ),
        );
      }),
    );
  }

  // --- topology --------------------------------------------------------------------------
  function renderTopology(doc) {
    const topo = doc.topology;
    show("topology", !!topo);
    if (!topo) return;
    const status = topo.stage_status || [];
    const lost = new Set(topo.lost_nodes || []);
    $("topology-summary").textContent =
      `${topo.topology_id} · ${topo.role} · ${topo.state} · ${topo.package_ref}` +
      (lost.size ? ` · lost ${[...lost].map(short).join(", ")}` : "");
    $("topology-layers").textContent = String(topo.layer_count);
    const segments = [];
    const rows = [];
    topo.stages.forEach((s, i) => {
      const st = status[i] || {};
      const ready = st.ready === true;
      const classes = ["stage"];
      if (!ready) classes.push("not-ready");
      if (st.state === "lost") classes.push("lost");
      // Readiness first: a narrow segment still shows it (details in the title and table).
      const failed = st.state === "lost" || st.state === "failed" || st.state === "rejected";
      const mark = ready ? "✓" : failed ? "✗" : st.ready === false ? "…" : "?";
      const seg = h(
        "div",
        {
          class: classes.join(" "),
          "data-node-id": s.node_id,
          "data-stage": String(s.stage_index),
          "data-ready": String(st.ready),
          title:
            `stage ${s.stage_index}: layers ${s.layer_start}..${s.layer_end} on ${s.node_id}` +
            ` · ${fmtBytes(st.bytes)} · ${st.state || "?"}`,
        },
        h("div", {}, `${mark} S${s.stage_index} ${s.layer_start}–${s.layer_end}`),
        h("div", {}, short(s.node_id).slice(0, 8)),
        h("div", {}, st.bytes === null || st.bytes === undefined ? "" : fmtBytes(st.bytes)),
      );
      seg.style.flexGrow = String(Math.max(1, s.layer_end - s.layer_start));
      seg.style.flexBasis = "0";
      seg.style.setProperty("--h", String(hue(s.node_id)));
      segments.push(seg);
      const self = s.node_id === doc.node_id ? " (this node)" : "";
      const loaded =
        self && doc.stage && doc.stage.topology_id === topo.topology_id ? doc.stage : null;
      rows.push(
        h(
          "tr",
          { "data-stage": String(s.stage_index) },
          h("td", {}, String(s.stage_index)),
          h("td", {}, `${s.layer_start}..${s.layer_end}`),
          h("td", { title: s.node_id }, swatch(s.node_id), short(s.node_id) + self),
          h("td", {}, fmtBytes(st.bytes)),
          h("td", { class: "placement wrap" }, placementText(st.placement, loaded)),
          h(
            "td",
            { class: ready ? "ok" : failed ? "bad" : "warn" },
            (st.state || "?") + (st.code ? ` (${st.code})` : ""),
          ),
        ),
      );
    });
    $("topology-bar").replaceChildren(...segments);
    fill($("topology-rows"), rows);
  }

  // --- artifact transfers (the document's `transfers`) ----------------------------------------
  const MAX_TRANSFER_ROWS = 40;

  function transferRow(r, active) {
    const total = r.total === null || r.total === undefined ? null : Number(r.total);
    const done = Number(r.bytes_done) || 0;
    const failed = !active && (r.error || !r.verified);
    const state = active ? "active" : failed ? "failed" : "done";
    const bar = h("span", { class: `progress ${state}` }, h("span"));
    const pct = total ? Math.min(100, (100 * done) / total) : active ? 0 : 100;
    bar.firstChild.style.width = `${pct}%`;
    let where;
    if (r.direction === "serve") where = ["↑ to ", r.peer_id ? swatch(r.peer_id) : null, short(r.peer_id)];
    else if (r.source === "peer") where = ["↓ peer ", r.peer_id ? swatch(r.peer_id) : null, short(r.peer_id)];
    else if (r.source === "cache") where = ["= cache"];
    else where = [`↓ ${r.source || "?"}`];
    let verified;
    if (active) verified = h("span", { class: "dim" }, r.direction === "serve" ? "sending…" : "receiving…");
    else if (!failed) verified = h("span", { class: "ok" }, "✓ sha256");
    else verified = h("span", { class: "bad" }, "✗ " + (r.error || "not verified"));
    const title = [r.peer_id || "", r.fallback ? `hub because: ${r.fallback}` : "",
      r.resumed_from ? `resumed at ${fmtBytes(r.resumed_from)}` : ""].filter(Boolean).join(" · ");
    return h(
      "tr",
      { "data-state": state, "data-direction": r.direction, "data-source": r.source, "data-path": r.path },
      h("td", { class: "wrap" }, r.path),
      h("td", { title }, ...where, r.fallback ? h("span", { class: "dim" }, " (fallback)") : null),
      h("td", {}, `${fmtBytes(done)} / ${total === null ? "?" : fmtBytes(total)}`),
      h("td", {}, bar),
      h("td", {}, r.mb_per_s === undefined || r.mb_per_s === null ? "-" : Number(r.mb_per_s).toFixed(1)),
      h("td", { class: "wrap" }, verified),
    );
  }

  function stageLine(stage) {
    const cls = stage.state === "ready" ? "ok" : stage.state === "failed" ? "bad" : "warn";
    return [
      `this node's stage ${stage.stage_index} (layers ${stage.layer_start}..${stage.layer_end}): `,
      h("span", { class: cls }, stage.state + (stage.error ? ` (${stage.error})` : "")),
      ` · ${(stage.required || []).length} artifacts, ${fmtBytes(stage.bytes_required)}`,
      stage.report ? ` · coordinator's answer: ${stage.report}` : "",
    ];
  }

  function renderTransfers(doc) {
    const t = doc.transfers;
    const active = (t && t.active) || [];
    const recent = (t && t.recent) || [];
    const stage = t && t.stage;
    show("transfers", !!t && (!!stage || active.length + recent.length > 0));
    if (!t) return;
    const c = t.counters || {};
    const parts = [];
    for (const [src, n] of Object.entries(c.fetched_bytes || {})) if (n) parts.push(`${src} ${fmtBytes(n)}`);
    if (c.served_bytes) parts.push(`served ${fmtBytes(c.served_bytes)}`);
    const refused = Object.values(c.refusals || {}).reduce((a, b) => a + b, 0);
    if (refused) parts.push(`refused ${refused}`);
    if (c.verification_failures) parts.push(`verification failures ${c.verification_failures}`);
    $("transfers-summary").textContent =
      `${active.length} in progress, ${recent.length} recent` + (parts.length ? ` · ${parts.join(" · ")}` : "");
    $("transfers-stage").hidden = !stage;
    if (stage) $("transfers-stage").replaceChildren(...stageLine(stage).filter((x) => x !== ""));
    const rows = [...active.map((r) => transferRow(r, true)), ...recent.map((r) => transferRow(r, false))];
    const shown = rows.slice(0, MAX_TRANSFER_ROWS);
    if (rows.length > shown.length) {
      shown.push(h("tr", { class: "more" }, h("td", { colSpan: 6 }, `… ${rows.length - shown.length} older`)));
    }
    fill($("transfers-rows"), shown);
  }

  // --- serving -------------------------------------------------------------------------------
  function renderServing(doc) {
    const s = doc.serving;
    show("serving", !!s);
    if (!s) return;
    $("serving-inflight").textContent = String(s.requests_in_flight ?? "-");
    $("serving-tps").textContent = s.tokens_per_s === undefined || s.tokens_per_s === null ? "-" : Number(s.tokens_per_s).toFixed(1);
    $("serving-ttft").textContent =
      s.ttft_ms_median === undefined || s.ttft_ms_median === null ? "-" : `${Number(s.ttft_ms_median).toFixed(0)} ms (median, recent)`;
    $("serving-requests").textContent = Object.entries(s.requests || {})
      .map(([k, v]) => `${k} ${v}`)
      .join(" · ") || "-";
    $("serving-tokens").textContent =
      s.prompt_tokens === undefined ? "-" : `prompt ${s.prompt_tokens} · completion ${s.completion_tokens}`;
    const sp = s.speculative || {};
    $("serving-speculative").textContent = !s.speculative_strategy
      ? "off"
      : `${s.speculative_strategy}: accepted ${sp.accepted ?? 0} of ${sp.proposed ?? 0} drafted tokens in ${sp.verify_passes ?? 0} verify windows`;
    // each replica's state, requests in flight, outstanding tokens and total
    $("serving-replicas").textContent = (s.replicas || [])
      .map((r) => `#${r.replica} ${r.state} (in flight ${r.requests_in_flight}, ` +
        `outstanding ${r.outstanding_tokens} tok, total ${r.requests_total})`)
      .join(" · ") || "-";
  }

  // --- live updates --------------------------------------------------------------------------
  let updates = 0;
  let lastUpdate = 0;

  function render(doc) {
    assignHues(doc);
    renderNode(doc);
    renderPeers(doc);
    renderTopology(doc);
    renderTransfers(doc);
    renderServing(doc);
    updates += 1;
    lastUpdate = Date.now();
    document.body.dataset.updates = String(updates);
    $("updated").textContent = "updated " + new Date(lastUpdate).toLocaleTimeString();
    setLive(true, "live");
  }

  function setLive(ok, text) {
    const live = $("live");
    live.classList.toggle("stale", !ok);
    live.textContent = text;
  }

  // --- API key: asked for once, kept in this tab's sessionStorage ----------------------------
  const KEY_ITEM = "mesh-node-api-key";
  function storedKey() {
    try {
      return sessionStorage.getItem(KEY_ITEM);
    } catch (err) {
      return null;
    }
  }
  let apiKey = storedKey();
  function authHeaders() {
    return apiKey ? { Authorization: "Bearer " + apiKey } : {};
  }
  function askForKey(message) {
    show("login", true);
    $("login-error").textContent = message || "";
    setLive(false, "needs a key");
    $("api-key").focus();
  }
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("api-key").value.trim();
    $("api-key").value = "";
    try {
      sessionStorage.setItem(KEY_ITEM, apiKey);
    } catch (err) {
      /* no storage: the key lasts for this page only */
    }
    start();
  });

  let polling = false;
  async function poll() {
    polling = true;
    for (;;) {
      try {
        const response = await fetch("/api/status", { cache: "no-store", headers: authHeaders() });
        if (response.status === 401) {
          polling = false;
          askForKey(apiKey ? "that key was refused" : "");
          return;
        }
        if (response.ok) render(await response.json());
        else setLive(false, `error ${response.status}`);
      } catch (err) {
        setLive(false, "unreachable");
      }
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  }

  // EventSource cannot send a header: with a key, the events are read through fetch.
  async function streamEvents() {
    const response = await fetch("/api/events", { cache: "no-store", headers: authHeaders() });
    if (response.status === 401) {
      askForKey("that key was refused");
      return;
    }
    if (!response.ok || !response.body) {
      if (!polling) poll();
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) render(JSON.parse(line.slice(6)));
        }
      }
    }
    setLive(false, "reconnecting");
    setTimeout(connect, POLL_MS);
  }

  function connect() {
    if (apiKey) {
      streamEvents().catch(() => {
        setLive(false, "reconnecting");
        setTimeout(connect, POLL_MS);
      });
      return;
    }
    if (!window.EventSource) {
      poll();
      return;
    }
    const events = new EventSource("/api/events");
    events.onmessage = (e) => render(JSON.parse(e.data));
    events.onerror = () => {
      if (events.readyState === EventSource.CLOSED && !polling) {
        poll(); // refused (e.g. too many open pages, or a key is needed): poll instead
      } else {
        setLive(false, "reconnecting");
      }
    };
  }

  // First ask once whether this node needs a key (and whether ours works).
  async function start() {
    try {
      const response = await fetch("/api/status", { cache: "no-store", headers: authHeaders() });
      if (response.status === 401) {
        askForKey(apiKey ? "that key was refused" : "");
        return;
      }
      show("login", false);
      if (response.ok) render(await response.json());
    } catch (err) {
      setLive(false, "unreachable");
    }
    connect();
  }

  setInterval(() => {
    if (lastUpdate && Date.now() - lastUpdate > STALE_MS) {
      setLive(false, `stale ${Math.round((Date.now() - lastUpdate) / 1000)}s`);
    }
  }, 1000);

  // --- theme -----------------------------------------------------------------------------------
  function applyTheme(theme) {
    if (theme) document.documentElement.dataset.theme = theme;
    else delete document.documentElement.dataset.theme;
  }
  let stored = null;
  try {
    stored = localStorage.getItem("mesh-node-theme");
  } catch (err) {
    stored = null;
  }
  applyTheme(stored);
  $("theme").addEventListener("click", () => {
    const current =
      document.documentElement.dataset.theme ||
      (window.matchMedia("(prefers-color-scheme: light)").matches ? "light" : "dark");
    const next = current === "dark" ? "light" : "dark";
    applyTheme(next);
    try {
      localStorage.setItem("mesh-node-theme", next);
    } catch (err) {
      /* private mode: the choice lasts for this page only */
    }
  });

  start();
})();
