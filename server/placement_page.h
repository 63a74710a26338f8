// The placement page (GET /placement on the HTTP front): a read-only view of each device's memory,
// drawn from GET /v1/placement (every device's GetPlacement) and refreshed every second. Plain
// HTML, CSS and JavaScript, no framework and nothing fetched from elsewhere. With an API key the
// page reads it from the URL's fragment (/placement#key=sk-...), which browsers never send.
//
// What it draws per device: a bar as wide as the budget (the whole device without one) with the
// memory outside the allocator ("context"), each component's device bytes (resident: solid;
// group-offloaded or partially resident: striped) and what is free, the budget line, and a table of
// the components (state, lifecycle — LOADING shows while a pipeline loads —, weight and device
// bytes, compute). Elements carry data-* attributes with the exact numbers (tests read them).
#ifndef STOWAGE_SERVER_PLACEMENT_PAGE_H_
#define STOWAGE_SERVER_PLACEMENT_PAGE_H_

namespace stowage {

inline constexpr char kPlacementPage[] = R"html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Stowage placement</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .updated { color: #666; margin-bottom: 16px; }
  .device { margin-bottom: 28px; }
  .device h2 { font-size: 16px; margin: 8px 0; }
  .bar { position: relative; display: flex; height: 36px; border: 1px solid #444; background: #f4f4f4; }
  .seg { height: 100%; overflow: hidden; white-space: nowrap; font-size: 11px; color: #fff; line-height: 36px; }
  .seg.context { background: #7a7a7a; }
  .seg.resident { background: #2f6fd6; }
  .seg.streamed { background: repeating-linear-gradient(45deg, #e08a1e, #e08a1e 6px, #f2b766 6px, #f2b766 12px); }
  .seg.other { background: #8e44ad; }
  .budget { position: absolute; top: -4px; bottom: -4px; width: 2px; background: #c0392b; }
  table { border-collapse: collapse; margin-top: 10px; }
  th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .LOADING { color: #b9770e; font-weight: bold; }
  .error { color: #c0392b; }
</style>
</head>
<body>
<h1>Stowage placement</h1>
<div class="updated" id="updated">loading&hellip;</div>
<div id="devices"></div>
<script>
"use strict";
const MiB = 1 << 20;
function human(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(bytes), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
}
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function headers() {
  const m = /(?:^|[#&])key=([^&]+)/.exec(location.hash);
  return m ? { Authorization: "Bearer " + decodeURIComponent(m[1]) } : {};
}
function drawDevice(d) {
  const budget = Number(d.budget_bytes || 0);
  const context = Number(d.context_bytes || 0);
  const components = d.components || [];
  const used = context + components.reduce((s, c) => s + Number(c.device_bytes || 0), 0);
  const scale = Math.max(budget, used, 1);
  const box = el("section", { class: "device", "data-device": d.device, "data-budget-bytes": String(budget),
                               "data-context-bytes": String(context),
                               "data-allocated-bytes": String(d.allocated_bytes || 0) });
  box.appendChild(el("h2", {}, d.device + " — budget " + (budget ? human(budget) : "none") + ", context " +
                     human(context) + ", allocated " + human(d.allocated_bytes || 0) + ", strategy " + (d.strategy || "")));
  const bar = el("div", { class: "bar", "data-bar": d.device });
  const seg = (cls, bytes, label, id) => {
    if (bytes <= 0) return;
    const s = el("div", { class: "seg " + cls, title: label + ": " + human(bytes), "data-bytes": String(bytes) }, label);
    if (id) s.setAttribute("data-component", id);
    s.style.width = (100 * bytes / scale) + "%";
    bar.appendChild(s);
  };
  seg("context", context, "context");
  for (const c of components) {
    const state = c.state || "STATE_UNSPECIFIED";
    const cls = state === "RESIDENT" ? "resident" : (state === "GROUP_OFFLOADED" || state === "PARTIALLY_RESIDENT") ? "streamed" : "other";
    seg(cls, Number(c.device_bytes || 0), c.id, c.id);
  }
  if (budget > 0) {
    const line = el("div", { class: "budget", title: "budget " + human(budget), "data-budget-line": String(budget) });
    line.style.left = (100 * budget / scale) + "%";
    bar.appendChild(line);
  }
  box.appendChild(bar);
  const table = el("table", { "data-components": d.device });
  const head = el("tr");
  for (const h of ["component", "state", "lifecycle", "weights", "on device", "compute"]) head.appendChild(el("th", {}, h));
  table.appendChild(head);
  for (const c of components) {
    const row = el("tr", { "data-id": c.id, "data-state": c.state || "", "data-lifecycle": c.lifecycle || "",
                           "data-weight-bytes": String(c.weight_bytes || 0), "data-device-bytes": String(c.device_bytes || 0) });
    row.appendChild(el("td", {}, c.id));
    row.appendChild(el("td", {}, c.state || ""));
    row.appendChild(el("td", { class: c.lifecycle || "" }, c.lifecycle || ""));
    row.appendChild(el("td", { class: "num" }, human(c.weight_bytes || 0)));
    row.appendChild(el("td", { class: "num" }, human(c.device_bytes || 0)));
    row.appendChild(el("td", {}, c.compute || ""));
    table.appendChild(row);
  }
  box.appendChild(table);
  for (const w of d.warnings || []) box.appendChild(el("div", { class: "error" }, w));
  return box;
}
async function refresh() {
  try {
    const reply = await fetch("/v1/placement", { headers: headers(), cache: "no-store" });
    const body = await reply.json();
    if (!reply.ok) throw new Error((body.error && body.error.message) || reply.status);
    const root = document.getElementById("devices");
    root.replaceChildren(...body.devices.map(drawDevice));
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.setAttribute("data-ready", "1");
  } catch (e) {
    document.getElementById("updated").textContent = "cannot read /v1/placement: " + e.message;
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
)html";

}  // namespace stowage

#endif  // STOWAGE_SERVER_PLACEMENT_PAGE_H_
