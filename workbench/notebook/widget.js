// The swarm widget's front end (anywidget ESM, shipped inside the package: no CDN).
// It renders the `snapshot` trait and sends commands by setting the `command` trait; Python
// handles them through the same steering API the terminal UI uses.

const CSS = `
.swb { font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 13px; color: var(--jp-ui-font-color1, #222); }
.swb-title { font-weight: 600; margin-bottom: 4px; }
.swb-summary { display: flex; flex-wrap: wrap; gap: 14px; padding: 6px 8px; background: var(--jp-layout-color2, #f3f3f3); border-radius: 4px; }
.swb-summary b { font-variant-numeric: tabular-nums; }
.swb-row { display: flex; gap: 12px; flex-wrap: wrap; margin-top: 8px; align-items: flex-start; }
.swb table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
.swb th, .swb td { padding: 2px 8px; text-align: right; border-bottom: 1px solid var(--jp-border-color2, #ddd); }
.swb th:first-child, .swb td:first-child, .swb td.stage { text-align: left; }
.swb td.stage-paused { color: #b58900; font-weight: 600; }
.swb td.stage-training { color: #2aa198; }
.swb td.stage-averaging { color: #d33682; }
.swb td.stage-finishing { color: #268bd2; }
.swb tr.swb-departed td { color: #93a1a1; }
.swb button { font-size: 12px; padding: 1px 8px; cursor: pointer; }
.swb button:disabled { cursor: not-allowed; }
.swb-controls { display: flex; gap: 8px; align-items: center; margin-top: 8px; flex-wrap: wrap; }
.swb-controls input { width: 70px; }
.swb-reason { color: #b00; margin-top: 4px; }
.swb-message { color: #555; margin-top: 4px; min-height: 1em; }
.swb svg text { font-size: 10px; fill: var(--jp-ui-font-color2, #666); }
`;

const COLORS = ["#268bd2", "#2aa198", "#d33682", "#b58900", "#6c71c4", "#cb4b16", "#859900", "#dc322f"];

function bytes(n) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return i === 0 ? `${n.toFixed(0)} B` : `${n.toFixed(1)} ${units[i]}`;
}

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.appendChild(child);
  return node;
}

function chart(series, width = 360, height = 160) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "swb-chart");
  const points = Object.values(series).flatMap((s) => s.points);
  if (points.length < 2) return svg;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => 36 + ((x - x0) / (x1 - x0 || 1)) * (width - 44);
  const sy = (y) => 8 + (1 - (y - y0) / (y1 - y0 || 1)) * (height - 24);
  Object.values(series).forEach(({ label, points: pts }, i) => {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLORS[i % COLORS.length]);
    line.setAttribute("stroke-width", "1.2");
    const title = document.createElementNS(ns, "title");
    title.textContent = label;
    line.appendChild(title);
    svg.appendChild(line);
  });
  for (const [y, label] of [[y0, y0.toFixed(2)], [y1, y1.toFixed(2)]]) {
    const text = document.createElementNS(ns, "text");
    text.setAttribute("x", 2);
    text.setAttribute("y", sy(y) + 3);
    text.textContent = label;
    svg.appendChild(text);
  }
  const caption = document.createElementNS(ns, "text");
  caption.setAttribute("x", width / 2 - 20);
  caption.setAttribute("y", height - 2);
  caption.textContent = "loss over time";
  svg.appendChild(caption);
  return svg;
}

// A number as text: "-" for none, and whatever else came (a diverged run's NaN arrives as
// "nan") as it is, never a TypeError that leaves the widget blank.
function fixed(x, digits) {
  if (x == null) return "-";
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : String(x);
}

function render({ model, el: root }) {
  const style = el("style", { text: CSS });
  const box = el("div", { class: "swb" });
  root.appendChild(style);
  root.appendChild(box);

  function send(command) {
    model.set("command", { ...command, nonce: Date.now() + Math.random() });
    model.save_changes();
  }

  // The view is drawn again at every reading (about once a second on a live run); the steering
  // form is made once, so what the user is typing (and the focus) survives the readings.
  const view = el("div");
  const controls = el("div", { class: "swb-controls" });
  const lr = el("input", { type: "number", step: "0.05", min: "0", placeholder: "outer lr", class: "swb-lr" });
  const h = el("input", { type: "number", step: "1", min: "1", placeholder: "H", class: "swb-h" });
  const seconds = el("input", { type: "number", step: "1", min: "0", placeholder: "round s", class: "swb-round-seconds" });
  const steer = el("button", { class: "swb-steer", text: "steer" });
  const reasonLine = el("div", { class: "swb-reason" });
  const message = el("div", { class: "swb-message" });
  steer.addEventListener("click", () => {
    const command = { action: "steer" };
    for (const [node, key, what, whole] of [[lr, "outer_lr", "outer lr", false], [h, "inner_steps", "H", true],
      [seconds, "round_seconds", "round s", false]]) {
      if (node.value.trim() === "") continue;
      const value = Number(node.value);  // parseInt("2.5") sent H=2, and "1e3" H=1
      if (!Number.isFinite(value) || (whole && !Number.isInteger(value))) {
        message.textContent = `${what} must be ${whole ? "a whole number" : "a number"}, not ${node.value}`;
        return;
      }
      command[key] = value;
    }
    send(command);
  });
  controls.appendChild(el("span", { text: "steer:" }));
  controls.append(lr, h, seconds, steer);
  box.append(view, controls, reasonLine, message);

  function drawView() {
    const snap = model.get("snapshot") || {};
    const reason = model.get("steer_reason");
    const parts = [el("div", { class: "swb-title", text: model.get("title") || "swarm" })];
    const peers = snap.peers || [];
    const summary = el("div", { class: "swb-summary" });
    const facts = [
      ["round", snap.outer_round ?? 0],
      ["peers", peers.length],
      ["samples/s", fixed(snap.samples_per_second || 0, 0)],
      ["mean loss", fixed(snap.mean_loss, 3)],
      ["sent", bytes(peers.reduce((a, p) => a + (p.bytes_sent || 0), 0))],
    ];
    if (snap.control) {
      // A paused peer applies nothing until it is resumed: not counted (swarm.records.applied).
      const active = peers.filter((p) => p.stage !== "paused");
      const applied = active.filter((p) => (p.control_version || 0) >= snap.control.version).length;
      const paused = peers.length - active.length;
      facts.push(["control", `${applied}/${active.length} applied v${snap.control.version}` + (paused ? ` (${paused} paused)` : "")]);
    }
    for (const [k, v] of facts) summary.appendChild(el("span", {}, [document.createTextNode(`${k} `), el("b", { text: String(v) })]));
    parts.push(summary);
    // Peers caught lying (swarm.claims): left out of the table, said here with the reason.
    for (const liar of snap.ignored || []) {
      parts.push(el("div", { class: "swb-ignored", text: `ignored ${liar.peer_id.slice(-8)}: ${liar.reason}` }));
    }

    const row = el("div", { class: "swb-row" });
    const table = el("table", { class: "swb-peers" });
    const head = el("tr");
    for (const t of ["name", "stage", "outer", "inner", "last H", "loss", "samples/s", "sent", "group", "ctl", ""]) head.appendChild(el("th", { text: t }));
    table.appendChild(head);
    const paused = (snap.control && snap.control.paused) || [];
    for (const p of peers) {
      const tr = el("tr", { "data-peer": p.peer_id });
      const cells = [p.name, p.stage, p.outer_step, `${p.inner_step}/${p.inner_steps}`, p.last_round_steps || "-",
        fixed(p.loss, 3), p.idle ? "-" : fixed(p.samples_per_second || 0, 1),  // idle: its last round's
        bytes(p.bytes_sent || 0), p.group_size || "-", p.control_version ? `v${p.control_version}` : "-"];
      if (p.stage === "downloading" && p.download_progress > 0) {
        cells[1] = `download ${Math.round(100 * p.download_progress)}%` + (p.download_donors > 1 ? ` from ${p.download_donors} donors` : "");
      }
      cells.forEach((c, i) => tr.appendChild(el("td", { text: String(c), class: i === 1 ? `stage stage-${p.stage}` : "" })));
      const isPaused = paused.includes(p.peer_id) || paused.includes(p.name);
      const button = el("button", { class: isPaused ? "swb-resume" : "swb-pause", text: isPaused ? "resume" : "pause" });
      if (reason) { button.disabled = true; button.title = reason; }
      button.addEventListener("click", () => send({ action: isPaused ? "resume" : "pause", peer: p.peer_id }));
      const td = el("td");
      td.appendChild(button);
      tr.appendChild(td);
      table.appendChild(tr);
    }
    // Peers that left (the last 5 minutes): dimmed below the live ones, with how and when.
    for (const d of [...(snap.departed || [])].reverse()) {
      const when = new Date(d.time * 1000).toLocaleTimeString();
      const tr = el("tr", { class: "swb-departed", "data-peer": d.peer_id });
      const cells = [d.name, `left ${when} (${d.how})`, d.outer_step, "-", "-", "-", "-", "-", "-", "-", ""];
      cells.forEach((c, i) => tr.appendChild(el("td", { text: String(c), class: i === 1 ? "stage" : "" })));
      table.appendChild(tr);
    }
    row.appendChild(table);
    row.appendChild(chart(model.get("loss_series") || {}));
    parts.push(row);
    view.replaceChildren(...parts);
  }

  function drawControls() {
    const reason = model.get("steer_reason");
    for (const node of [lr, h, seconds, steer]) { node.disabled = Boolean(reason); node.title = reason || ""; }
    reasonLine.textContent = reason ? `steering disabled: ${reason}` : "";
    reasonLine.hidden = !reason;
  }

  function drawMessage() {
    message.textContent = model.get("message") || "";
  }

  drawView();
  drawControls();
  drawMessage();
  for (const name of ["snapshot", "loss_series", "title"]) model.on(`change:${name}`, drawView);
  model.on("change:steer_reason", () => { drawView(); drawControls(); });
  model.on("change:message", drawMessage);
}

export default { render };
