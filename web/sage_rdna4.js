// Shows the A/B report of "Sage Attention Benchmark (RDNA4)" on the node: a summary that always stays in view
// (speed-up, PSNR, what ran, against what), then a bounded, scrollable part with the per-step table, sampled
// accuracy and fallback reasons. The node sends the report as JSON in its UI output (key "sage_rdna4_report");
// text goes in with textContent only, never as HTML, since fallback reasons are free text. The report is drawn
// again from the node's stored output (app.nodeOutputs) after a tab switch or a cached re-run, and from the copy
// in the node's properties after a page reload.
import { app } from "../../scripts/app.js";

const NODE_ID = "SageAttentionBenchmarkRDNA4";
const WIDGET_NAME = "sage_rdna4_report";
const REPORT_KEY = "sage_rdna4_report";
// The last report is also kept in the node's properties, which the workflow saves: after a page reload the
// frontend has no outputs (app.nodeOutputs is empty) but restores the workflow.
const PROPERTY = "sage_rdna4_last_report";

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

// One line that never wraps: cut with an ellipsis, the whole text on hover.
function line(doc, text, style = "") {
  const node = el(doc, "div", text, `white-space:nowrap;overflow:hidden;text-overflow:ellipsis;${style}`);
  node.title = String(text);
  return node;
}

// Cells never wrap (a number or a word split over two lines reads as two values); a column given a width in
// `clip` (in ch) is cut with an ellipsis instead, its whole text on hover.
const CELL = "text-align:right;padding:1px 4px;white-space:nowrap";

function table(doc, header, rows, clip = {}) {
  const t = el(doc, "table", undefined, "border-collapse:collapse;margin:4px 0");
  const head = el(doc, "tr");
  header.forEach((h, i) => head.appendChild(
    el(doc, "th", h, `${CELL};border-bottom:1px solid #888${clip[i] ? ";text-align:left" : ""}`)));
  t.appendChild(head);
  for (const row of rows) {
    const tr = el(doc, "tr");
    if (row.warmup) tr.style.opacity = "0.55";
    if (row.flagged) tr.style.color = "#e05a4f";
    row.cells.forEach((cell, i) => {
      const td = el(doc, "td", cell, CELL);
      if (row.titles?.[i]) td.title = String(row.titles[i]);
      if (clip[i]) {
        td.style.cssText += `;max-width:${clip[i]}ch;overflow:hidden;text-overflow:ellipsis;text-align:left`;
        td.title = String(cell);
      }
      tr.appendChild(td);
    });
    t.appendChild(tr);
  }
  return t;
}

// "own attention (sub-quadratic)": what the baseline run ran, as the report names it.
export function baselineLabel(report) {
  return report?.baseline_name ? `own attention (${report.baseline_name})` : "own attention";
}

// What served the patched run's calls: "triton_int8_fp8 40, 8 fallbacks".
function whatRan(report) {
  const calls = Object.entries(report.calls?.patched || {}).sort((a, b) => b[1] - a[1]);
  const fallbacks = Object.values(report.fallbacks || {}).reduce((a, n) => a + n, 0);
  const routed = Object.values(report.routed || {}).reduce((a, n) => a + n, 0);
  const parts = calls.map(([name, n]) => `${name} ${n}`);
  if (!calls.length && (fallbacks || routed)) parts.push("no kernel of the pack:");
  if (fallbacks) parts.push(`${fallbacks} fallback${fallbacks === 1 ? "" : "s"}`);
  if (routed) parts.push(`${routed} exact by policy`);
  return parts.length ? parts.join(", ").replace(":,", ":") : `kernel ${report.kernel ?? "?"}`;
}

// The summary lines, also what the browser test reads: speed-up and ratio, PSNR, what ran against what.
export function summaryLines(report) {
  const t = report.totals || {};
  const f = report.fidelity || {};
  const psnr = f.image_psnr_db === null || f.image_psnr_db === undefined
    ? `latent PSNR ${fmt(f.latent_psnr_db, 1)} dB` : `image PSNR ${fmt(f.image_psnr_db, 1)} dB`;
  const speed = t.measured_steps
    ? `speed-up ${fmt(t.speedup, 3)}x (ratio ${fmt(t.ratio, 3)})` : "no measured steps (sample at least 2)";
  return [`${speed}, ${psnr}`, `ran ${whatRan(report)} vs ${baselineLabel(report)}`];
}

// Builds the report's DOM (a <div>); exported so it can be checked without a ComfyUI page.
export function renderReport(report, doc = document) {
  // A column: the summary keeps its lines, the body below takes the rest of the height and scrolls. border-box:
  // the padding stays inside the height LiteGraph gives the widget.
  const root = el(doc, "div", undefined,
    "font:12px monospace;color:var(--fg-color,#ddd);display:flex;flex-direction:column;height:100%;" +
    "max-height:100%;padding:4px;box-sizing:border-box;overflow:hidden");
  root.className = "sage-rdna4-report";
  if (!report || typeof report !== "object") {
    root.appendChild(el(doc, "div", "no report"));
    return root;
  }
  const t = report.totals || {};
  const summary = el(doc, "div", undefined, "flex:none;padding-bottom:3px");
  summary.className = "sage-rdna4-summary";
  const [headline, ran] = summaryLines(report);
  // Above the speed-up: on the CPU the figures are no speed result.
  if (report.timing_caveat) summary.appendChild(line(doc, report.timing_caveat, "color:#e9a23b;font-weight:bold"));
  summary.appendChild(line(doc, headline, "font-weight:bold"));
  summary.appendChild(line(doc, ran));
  root.appendChild(summary);

  // The rest scrolls inside a visible frame; free text wraps between words, a long path anywhere.
  const body = el(doc, "div", undefined,
    "flex:1 1 auto;min-height:0;overflow:auto;border-top:1px solid #666;padding-top:3px;overflow-wrap:break-word");
  body.className = "sage-rdna4-body";
  root.appendChild(body);
  body.appendChild(el(doc, "div",
    `kernel ${report.kernel} vs the model's ${baselineLabel(report)}, ${report.model ?? "?"} on ${report.device ?? "?"}`));
  if (t.measured_steps) {
    body.appendChild(el(doc, "div", `${t.measured_steps} steps measured; warm-up (dimmed) excluded: ` +
      `${t.warmup_steps_excluded} step`));
  }
  if (t.attention_speedup !== undefined && t.attention_speedup !== null) {
    body.appendChild(el(doc, "div",
      `attention: ${pct(t.sdpa_attention_share)} of an own-attention step, ${pct(t.patched_attention_share)} ` +
      `patched; attention speed-up ${fmt(t.attention_speedup, 3)}x`));
  }
  const steps = report.per_step || [];
  // Short headers, so the table fits a node of 400 px without wrapping or scrolling sideways.
  body.appendChild(table(doc, ["step", "own ms", "patch ms", "ratio", "attn own", "attn patch"], steps.map((s) => ({
    warmup: s.warmup,
    cells: [s.index, fmt(s.sdpa_ms), fmt(s.patched_ms), fmt(s.ratio, 3), pct(s.sdpa_attention_share),
      pct(s.patched_attention_share)],
  }))));
  if (steps.some((s) => s.sdpa_attention_share == null || s.patched_attention_share == null)) {
    body.appendChild(el(doc, "div", "attn: the step's share spent in attention the pack timed; '-' where it timed " +
      "none (calls that fell back to ComfyUI's attention are not timed)", "opacity:0.7"));
  }
  const f = report.fidelity || {};
  body.appendChild(el(doc, "div",
    `fidelity vs the ${baselineLabel(report)} run: latent PSNR ${fmt(f.latent_psnr_db, 2)} dB, cosine ` +
    `${fmt(f.latent_cosine, 6)}, image PSNR ` +
    (f.image_psnr_db === null || f.image_psnr_db === undefined ? "n/a (no VAE)" : `${fmt(f.image_psnr_db, 2)} dB`)));
  const acc = report.attention_accuracy || [];
  if (acc.length) {
    // The call's shape is on hover (and in the JSON): with it the table would not fit a node of 400 px.
    const rows = acc.map((a) => ({
      flagged: a.flagged,
      cells: [`${a.step}/${a.call}`, a.backend, fmt(a.cosine, 5), fmt(a.rel_l1, 4) + (a.flagged ? " !" : "")],
      titles: { 0: a.shape },
    }));
    body.appendChild(el(doc, "div", "sampled calls vs exact attention (step/call; hover for the shape):",
      "margin-top:4px"));
    body.appendChild(table(doc, ["call", "ran", "cosine", "rel L1"], rows, { 1: 16 }));
  }
  for (const msg of report.accuracy_flags || []) {
    body.appendChild(el(doc, "div", `warning: ${msg}`, "color:#e05a4f;font-weight:bold"));
  }
  const fallbacks = Object.entries(report.fallbacks || {});
  if (fallbacks.length) {
    body.appendChild(el(doc, "div", "fallbacks to ComfyUI's own attention:", "margin-top:4px;color:#e9a23b"));
    for (const [reason, n] of fallbacks) body.appendChild(el(doc, "div", `${n} × ${reason}`, "color:#e9a23b"));
  }
  for (const [policy, n] of Object.entries(report.routed || {})) {
    body.appendChild(el(doc, "div", `exact by policy (${policy}): ${n}`));
  }
  if (report.json_path) {
    body.appendChild(el(doc, "div", `saved: ${report.json_path}`, "opacity:0.7;overflow-wrap:anywhere"));
  }
  if (report.save_error) body.appendChild(el(doc, "div", `warning: ${report.save_error}`, "color:#e05a4f"));
  return root;
}

// Sizing: the node grows to show the whole report, into free canvas space (never over another node's box,
// title bar included) and at most to MAX_W x MAX_H; what does not fit scrolls inside the report's frame. It
// always keeps room for the summary and two lines below it (MIN_BODY), since a report reduced to a sliver is
// unreadable. The node never shrinks here: a size the user chose stays.
const MAX_W = 720;
const MAX_H = 640; // the report's area, graph units
const MIN_BODY = 34; // two lines of the scrolled part below the summary
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

// The report's natural size in CSS px, unconstrained or at a given width, and its summary's height. Measured
// off-screen with the body unbounded.
function measure(view, width) {
  const probe = document.createElement("div");
  probe.style.cssText = "position:absolute;left:-100000px;top:0;visibility:hidden;" +
    (width ? `width:${width}px` : "width:max-content");
  const copy = view.cloneNode(true);
  copy.style.maxHeight = "none";
  copy.style.height = "auto";
  const body = copy.querySelector(".sage-rdna4-body");
  if (body) body.style.overflow = "visible";
  probe.appendChild(copy);
  document.body.appendChild(probe);
  const summary = copy.querySelector(".sage-rdna4-summary");
  const size = [Math.ceil(copy.scrollWidth), Math.ceil(copy.scrollHeight),
    summary ? Math.ceil(summary.getBoundingClientRect().height) : 0];
  probe.remove();
  return size;
}

function fitNode(node, widget, view) {
  const margin = widget.margin ?? 10;
  const wantW = Math.min(MAX_W, Math.max(node.size?.[0] ?? 0, measure(view)[0] + 2 * margin + 4));
  // The report area that shows all of the report at node width `nodeW` (LiteGraph lays the widget out at
  // the node's width less its margins), and the least area that still shows the summary and two lines.
  const areaAt = (nodeW) => {
    const [, h, summaryH] = measure(view, nodeW - 2 * margin);
    return [Math.min(MAX_H, h + 2 * margin + SPARE), summaryH + 8 + MIN_BODY + 2 * margin];
  };
  // The node height that shows a report area of `reportH`: LiteGraph's own layout (sockets, the other
  // widgets) with the report at that height.
  const nodeHeightFor = (reportH) => {
    const keep = widget.sageMinHeight;
    widget.sageMinHeight = reportH;
    const h = typeof node.computeSize === "function" ? node.computeSize()[1] : (node.size?.[1] ?? 0) + reportH;
    widget.sageMinHeight = keep;
    return h;
  };
  let [reportH, leastH] = areaAt(wantW);
  widget.sageMinHeight = Math.min(leastH, reportH);
  let [w, h] = roomFor(node, [wantW, nodeHeightFor(reportH)]);
  if (w < wantW) {
    // A node on the right keeps this one narrower: the report wraps onto more lines at the width it gets,
    // so its height is measured again there (measured at wantW, its last lines were cut off).
    [reportH, leastH] = areaAt(w);
    widget.sageMinHeight = Math.min(leastH, reportH);
    [w, h] = roomFor(node, [w, nodeHeightFor(reportH)]);
  }
  widget.sageMaxHeight = reportH;
  // Never less than the summary and two lines, even where a node below is close.
  h = Math.max(h, typeof node.computeSize === "function" ? node.computeSize()[1] : h);
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
      getMinHeight: () => widget?.sageMinHeight ?? 80,
      getMaxHeight: () => widget?.sageMaxHeight ?? MAX_H,
    });
  }
  if (widget) fitNode(node, widget, widget.element ?? view); // the report now lives in widget.element
  node.setDirtyCanvas?.(true, true);
}

// Draws `raw` (the JSON string of the node's UI output) on the node, once per distinct report.
function showRaw(node, raw) {
  if (raw === undefined || raw === null || raw === node.sageShownReport) return;
  let report;
  try {
    report = typeof raw === "string" ? JSON.parse(raw) : raw;
  } catch (err) {
    console.warn("[sage_rdna4] unreadable benchmark report", err);
    node.sageShownReport = raw;
    return;
  }
  node.sageShownReport = raw;
  if (typeof raw === "string") {
    node.properties ??= {};
    node.properties[PROPERTY] = raw;
  }
  showOnNode(node, report);
}

// The node's stored UI output, as the frontend keeps it (app.nodeOutputs, by node locator id: the node id in
// the root graph, "<subgraph id>:<node id>" inside a subgraph).
export function storedReport(node, outputs = app.nodeOutputs) {
  if (!outputs || node?.id === undefined) return undefined;
  const keys = [String(node.id)];
  const graph = node.graph;
  if (graph && graph !== app.graph && graph.id) keys.unshift(`${graph.id}:${node.id}`);
  for (const key of keys) {
    const raw = outputs[key]?.[REPORT_KEY]?.[0];
    if (raw !== undefined) return raw;
  }
  return undefined;
}

// After a reload or a tab switch the node is new and empty while the frontend still holds its output (or the
// workflow its properties): draw it.
function restore(node) {
  if (node.sageRestorePending) return;
  const raw = storedReport(node) ?? node.properties?.[PROPERTY];
  if (raw === undefined || raw === node.sageShownReport) return;
  node.sageRestorePending = true;
  setTimeout(() => { // not inside a canvas draw: adding the widget resizes the node
    node.sageRestorePending = false;
    showRaw(node, storedReport(node) ?? node.properties?.[PROPERTY]);
  }, 0);
}

function benchmarkNodes() {
  const nodes = app.graph?.nodes ?? app.graph?._nodes ?? [];
  return [...nodes].filter((n) => n?.type === NODE_ID || n?.comfyClass === NODE_ID);
}

const EXTENSION_NAME = "sage_rdna4.benchmark_report";

const extension = {
  name: EXTENSION_NAME,
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_ID) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      showRaw(this, message?.[REPORT_KEY]?.[0]);
    };
    const previousDraw = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function () {
      const r = previousDraw?.apply(this, arguments);
      restore(this); // cheap when nothing changed: one lookup
      return r;
    };
  },
  // The frontend replaced its stored outputs (a tab switch, a loaded workflow): redraw from them.
  onNodeOutputsUpdated() {
    for (const node of benchmarkNodes()) restore(node);
  },
  loadedGraphNode(node) {
    if (node?.type === NODE_ID || node?.comfyClass === NODE_ID) restore(node);
  },
};

// The pack registers web/ once (WEB_DIRECTORY). Should this file still be loaded a second time (say, another
// copy of the pack), that copy stays out instead of making the frontend throw "already registered".
if (!app.extensions?.some?.((e) => e?.name === EXTENSION_NAME)) {
  app.registerExtension(extension);
}
