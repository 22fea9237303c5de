// Shows the A/B report of "Sage Attention Benchmark (RDNA4)" on the node as a table:
// kernel, per-step times, ratio, fidelity, sampled accuracy and fallback reasons.
// The node sends the report as JSON in its UI output (key "sage_rdna4_report"); text goes in with
// textContent only, never as HTML, since fallback reasons are free text.
import { app } from "../../scripts/app.js";

const NODE_ID = "SageAttentionBenchmarkRDNA4";
const WIDGET_NAME = "sage_rdna4_report";

function fmt(x, digits = 1) {
  if (x === null || x === undefined) return "-";
  if (typeof x === "string") return x; // "inf" from the JSON writer
  return Number(x).toFixed(digits);
}

function pct(x) {
  return x === null || x === undefined ? "-" : `${Math.round(100 * x)}%`;
}

function el(doc, tag, text, style) {
  const node = doc.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (style) node.style.cssText = style;
  return node;
}

function table(doc, header, rows) {
  const t = el(doc, "table", undefined, "border-collapse:collapse;width:100%;margin:4px 0");
  const head = el(doc, "tr");
  for (const h of header) head.appendChild(el(doc, "th", h, "text-align:right;padding:1px 6px;border-bottom:1px solid #888"));
  t.appendChild(head);
  for (const row of rows) {
    const tr = el(doc, "tr");
    if (row.warmup) tr.style.opacity = "0.55";
    if (row.flagged) tr.style.color = "#e05a4f";
    for (const cell of row.cells) tr.appendChild(el(doc, "td", cell, "text-align:right;padding:1px 6px"));
    t.appendChild(tr);
  }
  return t;
}

// Builds the report's DOM (a <div>); exported so it can be checked without a ComfyUI page.
export function renderReport(report, doc = document) {
  // border-box: the padding stays inside the height LiteGraph gives the widget; overflow-wrap: a long saved
  // path wraps rather than bringing a horizontal scrollbar that would cover the last line.
  const root = el(doc, "div", undefined,
    "font:12px monospace;color:var(--fg-color,#ddd);overflow:auto;max-height:100%;padding:4px;" +
    "box-sizing:border-box;overflow-wrap:anywhere");
  root.className = "sage-rdna4-report";
  if (!report || typeof report !== "object") {
    root.appendChild(el(doc, "div", "no report"));
    return root;
  }
  const t = report.totals || {};
  root.appendChild(el(doc, "div", `kernel ${report.kernel} vs exact SDPA — ${report.model ?? "?"} on ${report.device ?? "?"}`,
    "font-weight:bold"));
  // Above the speed-up: on the CPU the figures below are no speed result.
  if (report.timing_caveat) root.appendChild(el(doc, "div", report.timing_caveat, "color:#e9a23b;font-weight:bold"));
  if (t.measured_steps) {
    root.appendChild(el(doc, "div",
      `speed-up ${fmt(t.speedup, 3)}x (ratio ${fmt(t.ratio, 3)}) over ${t.measured_steps} steps; ` +
      `${t.warmup_steps_excluded} warm-up step excluded`, "font-weight:bold"));
  } else {
    root.appendChild(el(doc, "div", "no measured steps: sample at least 2 steps (the first is warm-up)"));
  }
  if (t.attention_speedup !== undefined && t.attention_speedup !== null) {
    root.appendChild(el(doc, "div",
      `attention: ${pct(t.sdpa_attention_share)} of a SDPA step, ${pct(t.patched_attention_share)} patched; ` +
      `attention speed-up ${fmt(t.attention_speedup, 3)}x`));
  }
  const rows = (report.per_step || []).map((s) => ({
    warmup: s.warmup,
    cells: [s.index + (s.warmup ? " (warm-up)" : ""), fmt(s.sdpa_ms), fmt(s.patched_ms), fmt(s.ratio, 3),
      pct(s.sdpa_attention_share), pct(s.patched_attention_share)],
  }));
  root.appendChild(table(doc, ["step", "SDPA ms", "patched ms", "ratio", "attn SDPA", "attn patched"], rows));
  const f = report.fidelity || {};
  root.appendChild(el(doc, "div",
    `fidelity vs SDPA: latent PSNR ${fmt(f.latent_psnr_db, 2)} dB, cosine ${fmt(f.latent_cosine, 6)}, image PSNR ` +
    (f.image_psnr_db === null || f.image_psnr_db === undefined ? "n/a (no VAE)" : `${fmt(f.image_psnr_db, 2)} dB`)));
  const acc = report.attention_accuracy || [];
  if (acc.length) {
    root.appendChild(table(doc, ["call", "shape", "ran", "cosine", "rel L1"], acc.map((a) => ({
      flagged: a.flagged,
      cells: [`${a.step}/${a.call}`, a.shape, a.backend, fmt(a.cosine, 5), fmt(a.rel_l1, 4) + (a.flagged ? " !" : "")],
    }))));
  }
  for (const msg of report.accuracy_flags || []) {
    root.appendChild(el(doc, "div", `warning: ${msg}`, "color:#e05a4f;font-weight:bold"));
  }
  const fallbacks = Object.entries(report.fallbacks || {});
  if (fallbacks.length) {
    root.appendChild(el(doc, "div", "fallbacks to ComfyUI's own attention:", "margin-top:4px;color:#e9a23b"));
    for (const [reason, n] of fallbacks) root.appendChild(el(doc, "div", `${n} × ${reason}`, "color:#e9a23b"));
  }
  for (const [policy, n] of Object.entries(report.routed || {})) {
    root.appendChild(el(doc, "div", `exact by policy (${policy}): ${n}`));
  }
  if (report.json_path) root.appendChild(el(doc, "div", `saved: ${report.json_path}`, "opacity:0.7"));
  if (report.save_error) root.appendChild(el(doc, "div", `warning: ${report.save_error}`, "color:#e05a4f"));
  return root;
}

// Sizing: the node grows to show the whole report, but only into free canvas space (never over another
// node's box, title bar included) and at most to MAX_W x MAX_H; what does not fit scrolls inside the widget.
// The node never shrinks here: a size the user chose stays.
const MAX_W = 720;
const MAX_H = 480; // the report's area, graph units
const MIN_H = 60; // the smallest report area LiteGraph keeps when the node is resized by hand
const GAP = 10; // space kept free next to other nodes
const SPARE = 16; // one line of the report's 12px font beyond its measured height: a rounding in the
// frontend's layout must not hide the last line

function boxOf(node) {
  const title = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  return { x: node.pos[0], y: node.pos[1] - title, w: node.size[0], h: node.size[1] + title };
}

// The largest body size [w, h], up to `want`, that `node` can grow to where it stands without reaching
// another node of `others`; never less than its present size.
export function roomFor(node, want, others = node.graph?._nodes ?? node.graph?.nodes ?? []) {
  let [w, h] = want;
  if (!node.pos || !node.size) return [w, h];
  const me = boxOf(node);
  const boxes = [...others].filter((o) => o !== node && o.pos && o.size).map(boxOf);
  for (const o of boxes) { // widen only up to the nearest node on the right in the rows the node will take
    const sharesRows = o.y < node.pos[1] + h + GAP && o.y + o.h > me.y;
    if (sharesRows && o.x >= me.x + me.w) w = Math.min(w, o.x - GAP - me.x);
  }
  w = Math.max(w, me.w);
  for (const o of boxes) { // grow down only up to the nearest node below in the columns it will take
    const sharesColumns = o.x < me.x + w + GAP && o.x + o.w + GAP > me.x;
    if (sharesColumns && o.y > me.y) h = Math.min(h, o.y - GAP - node.pos[1]);
  }
  return [w, Math.max(h, node.size[1])];
}

// The report's natural size in CSS px: unconstrained, or its height at a given width. Measured off-screen.
function measure(view, width) {
  const probe = document.createElement("div");
  probe.style.cssText = "position:absolute;left:-100000px;top:0;visibility:hidden;" +
    (width ? `width:${width}px` : "width:max-content");
  const copy = view.cloneNode(true);
  copy.style.maxHeight = "none";
  copy.style.overflow = "visible";
  probe.appendChild(copy);
  document.body.appendChild(probe);
  const size = [Math.ceil(copy.scrollWidth), Math.ceil(copy.scrollHeight)];
  probe.remove();
  return size;
}

function fitNode(node, widget, view) {
  const margin = widget.margin ?? 10;
  const wantW = Math.min(MAX_W, Math.max(node.size?.[0] ?? 0, measure(view)[0] + 2 * margin + 4));
  // The report area that shows all of the report at node width `nodeW` (LiteGraph lays the widget out at
  // the node's width less its margins).
  const reportAt = (nodeW) => Math.min(MAX_H, measure(view, nodeW - 2 * margin)[1] + 2 * margin + SPARE);
  // The node height that shows a report area of `reportH`: LiteGraph's own layout (sockets, the other
  // widgets) with the report at that height.
  const nodeHeightFor = (reportH) => {
    widget.sageMinHeight = reportH;
    const h = typeof node.computeSize === "function" ? node.computeSize()[1] : (node.size?.[1] ?? 0) + reportH;
    widget.sageMinHeight = Math.min(MIN_H, reportH);
    return h;
  };
  let reportH = reportAt(wantW);
  let [w, h] = roomFor(node, [wantW, nodeHeightFor(reportH)]);
  if (w < wantW) {
    // A node on the right keeps this one narrower: the report wraps onto more lines at the width it gets,
    // so its height is measured again there (measured at wantW, its last lines were cut off).
    reportH = reportAt(w);
    [w, h] = roomFor(node, [w, nodeHeightFor(reportH)]);
  }
  widget.sageMaxHeight = reportH;
  node.setSize?.([w, h]);
}

function showOnNode(node, report) {
  const view = renderReport(report);
  let widget = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (widget?.element) {
    widget.element.replaceChildren(...view.childNodes);
  } else if (typeof node.addDOMWidget === "function") {
    widget = node.addDOMWidget(WIDGET_NAME, "sage_rdna4_report", view, {
      serialize: false,
      hideOnZoom: false,
      // LiteGraph gives the report a height between these from the node's free space; the rest scrolls.
      getMinHeight: () => widget?.sageMinHeight ?? MIN_H,
      getMaxHeight: () => widget?.sageMaxHeight ?? MAX_H,
    });
  }
  if (widget) fitNode(node, widget, widget.element ?? view); // the report now lives in widget.element
  node.setDirtyCanvas?.(true, true);
}

const EXTENSION_NAME = "sage_rdna4.benchmark_report";

const extension = {
  name: EXTENSION_NAME,
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_ID) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const raw = message?.sage_rdna4_report?.[0];
      if (raw === undefined) return;
      let report;
      try {
        report = typeof raw === "string" ? JSON.parse(raw) : raw;
      } catch (err) {
        console.warn("[sage_rdna4] unreadable benchmark report", err);
        return;
      }
      showOnNode(this, report);
    };
  },
};

// The pack registers web/ once (WEB_DIRECTORY). Should this file still be loaded a second time (say, another
// copy of the pack), that copy stays out instead of making the frontend throw "already registered".
if (!app.extensions?.some?.((e) => e?.name === EXTENSION_NAME)) {
  app.registerExtension(extension);
}
