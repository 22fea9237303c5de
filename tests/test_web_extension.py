"""The frontend extension (web/sage_rdna4.js) in headless Chromium: on a stub page, then in the real ComfyUI.

Stub page (needs only Chromium): the page serves the extension the way ComfyUI does
(/extensions/<pack>/sage_rdna4.js, importing ../../scripts/app.js) and stubs only what the extension touches
of ComfyUI, each part being ComfyUI's documented contract rather than behaviour we invent:
`app.registerExtension(ext)` records the extension and refuses a second one of the same name, as ComfyUI's
extension store does; a node type is a constructor whose prototype has LiteGraph's
`addDOMWidget(name, type, element, options)`; `onExecuted(message)` receives the node's UI output. The report
fed to it is written by the pack's own Python (report_json), so a change of keys on either side fails here.

Real ComfyUI (also needs COMFYUI_PATH): starts ComfyUI's server with this pack (tests/comfy_browser.py), opens
its frontend, loads every example workflow and checks: no missing node types, the extension served and
registered exactly once, no console error or warning about the pack, no overlapping nodes (boxes read from
the page's app.graph, title bars included), every node at least as large as LiteGraph's computeSize, the
template thumbnails served, and the report widget sized to its content without covering other nodes.

Then the A/B template for real (the same server with a test-only node giving a tiny Flux and its conditioning):
wired to the tiny model and queued from the UI on the CPU, its report must show its summary and last line at the
template's layout (screenshots go to $SAGE_BROWSER_SHOTS if set), come back after a tab switch, a cached re-run
and a page reload; a bad exact_blocks queued from the UI, and bad API prompts, must fail at queue time with the
node's name; the Missing Models dialog must list the template's files; the A/B node must run with nothing after it.
The server runs with the Python running the tests, which needs ComfyUI's requirements.

Marked `browser` (skipped when no Chromium is installed; CI: `apt-get install -y chromium`) and, for the
ComfyUI parts, `comfyui` (skipped without COMFYUI_PATH).
"""
import asyncio
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from functools import partial
from pathlib import Path

import pytest

import comfy_browser as cb
from comfyui_sage_rdna4.sage_patch.report import CPU_CAVEAT, report_json, summarize_steps

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p),
                None)

APP_STUB = """export const app = {
  extensions: [],
  nodeOutputs: {},
  registerExtension(ext) {
    if (this.extensions.some((e) => e.name === ext.name)) {
      throw new Error(`Extension named '${ext.name}' already registered.`);
    }
    this.extensions.push(ext);
  },
};
"""

PAGE = """<!doctype html><html><body><div id="canvas"></div><pre id="result">pending</pre>
<script>
  window.__errors = [];
  window.addEventListener("error", (e) => window.__errors.push(String(e.message)));
  window.addEventListener("unhandledrejection", (e) => window.__errors.push(String(e.reason)));
</script>
<script type="module">
const out = document.getElementById("result");
try {
  const { app } = await import("/scripts/app.js");
  await import("/extensions/sage_rdna4/sage_rdna4.js");
  // A second copy under another pack name, as when ComfyUI registers the web folder twice: it must stay out.
  await import("/extensions/second_copy/sage_rdna4.js");
  const ext = app.extensions[0];
  const graph = { _nodes: [] };
  function BenchmarkNode() { this.widgets = []; this.size = [300, 200]; this.pos = [0, 0]; this.graph = graph; }
  BenchmarkNode.prototype.addDOMWidget = function (name, type, element, options) {
    const w = { name, type, element, options };
    this.widgets.push(w);
    document.getElementById("canvas").appendChild(element);
    return w;
  };
  BenchmarkNode.prototype.setSize = function (size) { this.size = size; };
  function OtherNode() {}
  await ext.beforeRegisterNodeDef(BenchmarkNode, { name: "SageAttentionBenchmarkRDNA4" }, app);
  await ext.beforeRegisterNodeDef(OtherNode, { name: "KSampler" }, app);
  const node = new BenchmarkNode();
  // Neighbours: one to the right (its title bar starts 30 px above pos), one below.
  const right = { pos: [420, 40], size: [200, 100] }, below = { pos: [0, 560], size: [300, 100] };
  graph._nodes.push(node, right, below);
  const message = { text: ["plain text"], sage_rdna4_report: [REPORT] };
  node.onExecuted(message);
  node.onExecuted(message);  // a second run updates the same widget
  node.onExecuted({ text: ["no report"] });  // other UI output is ignored
  const canvas = document.getElementById("canvas");
  const w = node.widgets[0];
  const cells = [...canvas.querySelectorAll("th, td")];
  const first = { text: canvas.textContent, rows: canvas.querySelectorAll("tr").length,
                  summary: [...canvas.querySelectorAll(".sage-rdna4-summary > div")].map((d) => d.textContent) };
  // A reload or a tab switch: a new node, empty, while the frontend still holds the node's output.
  const restored = new BenchmarkNode();
  restored.id = 7;
  app.nodeOutputs = { "7": { sage_rdna4_report: [REPORT] } };
  restored.onDrawForeground();  // the first frame drawn after the reload
  await new Promise((r) => setTimeout(r, 50));
  // A page reload: the frontend holds no outputs, the workflow restores the node's properties.
  app.nodeOutputs = {};
  const reloaded = new BenchmarkNode();
  reloaded.id = 9;
  reloaded.properties = JSON.parse(JSON.stringify(node.properties));
  reloaded.onDrawForeground();
  await new Promise((r) => setTimeout(r, 50));
  const other = new BenchmarkNode();
  other.id = 8;  // a node whose output the frontend does not hold stays empty
  other.onDrawForeground();
  await new Promise((r) => setTimeout(r, 50));
  out.textContent = JSON.stringify({
    restoredText: restored.widgets[0]?.element.textContent ?? null, otherWidgets: other.widgets.length,
    reloadedText: reloaded.widgets[0]?.element.textContent ?? null,
    nowrap: cells.filter((c) => c.style.whiteSpace === "nowrap").length, cellCount: cells.length,
    clipped: cells.filter((c) => c.title).map((c) => [c.title, c.style.maxWidth]),
    summary: first.summary,
    extensions: app.extensions.map((e) => e.name),
    widgets: node.widgets.length,
    serialize: w && w.options.serialize,
    minHeight: w && w.options.getMinHeight(), maxHeight: w && w.options.getMaxHeight(),
    otherTouched: "onExecuted" in OtherNode.prototype,
    text: first.text,
    rows: first.rows,
    bold: canvas.querySelectorAll("b").length,
    size: node.size,
    errors: window.__errors,
  });
} catch (err) {
  out.textContent = JSON.stringify({ fatal: String(err && err.stack || err), errors: window.__errors });
}
</script></body></html>
"""


# The report widget laid out as ComfyUI lays out a DOM widget (ComfyUI_frontend DomWidgets.vue and LiteGraph's
# node layout): the element fills a box of (node width - 2 margin) x (computedHeight - 2 margin), where
# computedHeight is the node's free height below the widget's y, kept between getMinHeight() and getMaxHeight().
# A report measured for a width the node does not get, or taller than that box, loses its last lines.
LAYOUT_PAGE = """<!doctype html><html><body><pre id="result">pending</pre>
<script type="module">
const out = document.getElementById("result");
try {
  const { app } = await import("/scripts/app.js");
  await import("/extensions/sage_rdna4/sage_rdna4.js");
  const ext = app.extensions[0];
  const MARGIN = 10, Y0 = 30;  // ComfyUI's DOM widget margin; the widget's y below one row of sockets
  function BenchmarkNode(pos, others) {
    this.widgets = []; this.size = [300, 200]; this.pos = pos; this.graph = { _nodes: [this, ...others] };
  }
  BenchmarkNode.prototype.addDOMWidget = function (name, type, element, options) {
    const w = { name, type, element, options, margin: MARGIN, y: Y0 };
    this.widgets.push(w);
    return w;
  };
  BenchmarkNode.prototype.computeSize = function () {  // LiteGraph: the widgets at their least height
    return [this.size[0], Y0 + (this.widgets[0] ? this.widgets[0].options.getMinHeight() : 0)];
  };
  BenchmarkNode.prototype.setSize = function (size) { this.size = size; };
  await ext.beforeRegisterNodeDef(BenchmarkNode, { name: "SageAttentionBenchmarkRDNA4" }, app);
  function layout(node) {
    const w = node.widgets[0], o = w.options;
    const computed = Math.max(o.getMinHeight(), Math.min(o.getMaxHeight(), node.size[1] - w.y));
    const box = document.createElement("div");
    box.style.cssText = `position:absolute;left:${node.pos[0] + MARGIN}px;top:${node.pos[1] + w.y + MARGIN}px;` +
      `width:${node.size[0] - 2 * MARGIN}px;height:${computed - 2 * MARGIN}px;overflow:hidden`;
    w.element.style.width = "100%";  // ComfyUI adds the classes h-full w-full
    w.element.style.height = "100%";
    box.appendChild(w.element);
    document.body.appendChild(box);
    const el = w.element, body = el.querySelector(".sage-rdna4-body"), last = body.lastElementChild;
    const summary = el.querySelector(".sage-rdna4-summary"), b = box.getBoundingClientRect();
    const lines = [...summary.children];
    const cells = [...el.querySelectorAll("td, th")];
    return { size: node.size, clientHeight: body.clientHeight, scrollHeight: body.scrollHeight,
             clientWidth: body.clientWidth, scrollWidth: body.scrollWidth, last: last.textContent,
             lastBottom: last.getBoundingClientRect().bottom, boxBottom: b.bottom,
             summaryBottom: summary.getBoundingClientRect().bottom, summaryLines: lines.length,
             summaryLineHeights: lines.map((d) => d.getBoundingClientRect().height),
             tallestCell: Math.max(...cells.map((c) => c.getBoundingClientRect().height)),
             oneLine: lines[0].getBoundingClientRect().height,
             tableWidths: [...el.querySelectorAll("table")].map((t) => t.getBoundingClientRect().width) };
  }
  const results = {};
  for (const [name, pos, others] of [
    ["roomy", [0, 0], []],
    // a node on the right: the report is narrower than it would like, and wraps onto more lines
    ["neighbour_right", [0, 2000], [{ pos: [420, 2040], size: [200, 100] }]],
    // a node 58 px below (the spacing of the example workflows): the report gets little room
    ["crowded", [0, 4000], [{ pos: [0, 4000 + 200 + 58], size: [300, 100] }]],
  ]) {
    const node = new BenchmarkNode(pos, others);
    node.onExecuted({ sage_rdna4_report: [REPORT] });
    results[name] = layout(node);
  }
  out.textContent = JSON.stringify(results);
} catch (err) {
  out.textContent = JSON.stringify({ fatal: String(err && err.stack || err) });
}
</script></body></html>
"""


# A fallback reason in the accuracy table's "ran" column (what a CPU run shows): it broke the table's words.
LONG_RAN = "fallback: triton_int8_fp8 needs a GPU (cpu given): the call ran ComfyUI's own attention"


def make_report():
    steps = lambda times, attn: [{"index": i, "step_ms": t, "attention_ms": a} for i, (t, a) in  # noqa: E731
                                 enumerate(zip(times, attn))]
    summary = summarize_steps(steps([100.0, 50.0, 50.0], [40.0, 20.0, 20.0]), steps([300.0, 25.0, 25.0],
                                                                               [290.0, 5.0, 5.0]))
    return {"kernel": "triton_int8_fp8", "model": "Flux", "device": "NVIDIA H200 (sm_90)", **summary,
            "fidelity": {"latent_psnr_db": 43.42, "latent_cosine": 0.998307, "image_psnr_db": None},
            "baseline_name": "sub-quadratic", "calls": {"patched": {"triton_int8_fp8": 40}, "sdpa": {}},
            "attention_accuracy": [{"step": 0, "call": 1, "shape": "B1 H24 Nq4608 Nk4608 D128",
                                    "backend": "triton_int8_fp8", "cosine": 0.99982, "rel_l1": 0.0441},
                                   {"step": 0, "call": 3, "shape": "B1 H24 Nq4608 Nk4608 D128",
                                    "backend": LONG_RAN, "cosine": 1.0, "rel_l1": 0.0}],
            "fallbacks": {"triton_int8_fp8: head_dim 256 <b>too large</b>": 3}, "routed": {},
            "json_path": "/out/sage_rdna4/ab_1.json"}


@pytest.fixture
def served(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP_STUB)
    for pack in ("sage_rdna4", "second_copy"):
        ext_dir = tmp_path / "extensions" / pack
        ext_dir.mkdir(parents=True)
        shutil.copy(ROOT / "web" / "sage_rdna4.js", ext_dir / "sage_rdna4.js")
    (tmp_path / "test.html").write_text(PAGE.replace("REPORT", json.dumps(report_json(make_report()))))
    # A real run's report ends with its saved path: long, and without a space to wrap at.
    long_path = dict(make_report(), json_path="/home/someone/ComfyUI/output/sage_rdna4/" + "x" * 90 + "/ab_1.json")
    (tmp_path / "layout.html").write_text(LAYOUT_PAGE.replace("REPORT", json.dumps(report_json(long_path))))
    cpu = dict(make_report(), device="cpu", cpu_run=True, timing_caveat=CPU_CAVEAT, json_path=None,
               save_error="report not saved: NotADirectoryError: [Errno 20] Not a directory: '/out/x'")
    (tmp_path / "cpu.html").write_text(PAGE.replace("REPORT", json.dumps(report_json(cpu))))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/test.html", tmp_path
    server.shutdown()


def run_page(url, profile):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="result">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"no result in the page; chromium said:\n{proc.stderr[-2000:]}"
    return json.loads(html.unescape(match.group(1)))


@pytest.mark.browser
def test_extension_renders_the_report_table(served):
    url, tmp = served
    result = run_page(url, tmp / "profile")
    assert "fatal" not in result, result.get("fatal")
    assert result["errors"] == []
    assert result["extensions"] == ["sage_rdna4.benchmark_report"]  # the second copy stayed out, silently
    assert result["widgets"] == 1 and result["serialize"] is False
    assert result["otherTouched"] is False
    text = result["text"]
    # The summary first: speed-up and ratio, PSNR, what ran against what.
    assert result["summary"] == ["speed-up 2.000x (ratio 0.500), latent PSNR 43.4 dB",
                                 "ran triton_int8_fp8 40, 3 fallbacks vs own attention (sub-quadratic)"]
    assert text.startswith("speed-up 2.000x (ratio 0.500)")
    assert "kernel triton_int8_fp8 vs the model's own attention (sub-quadratic)" in text
    assert "SDPA" not in text  # the baseline is named for what it is
    assert "2 steps measured; warm-up (dimmed) excluded: 1 step" in text
    assert "300.0" in text and "0.500" in text
    assert "latent PSNR 43.42 dB" in text and "image PSNR n/a (no VAE)" in text
    assert "0.99982" in text
    assert "3 × triton_int8_fp8: head_dim 256 <b>too large</b>" in text  # shown as text, not markup
    assert result["bold"] == 0
    assert result["rows"] == 4 + 3  # step table: header + 3 steps; accuracy table: header + 2 calls
    # No cell wraps (before: 'cosin/e', '1.000 / 00'); a long 'ran' value is cut, its whole text on hover.
    assert result["nowrap"] == result["cellCount"] > 0
    assert [LONG_RAN, "16ch"] in result["clipped"] and ["triton_int8_fp8", "16ch"] in result["clipped"]
    assert ["B1 H24 Nq4608 Nk4608 D128", ""] in result["clipped"]  # the call's shape, on hover
    # Drawn again from the stored output after a reload; a node without one stays empty.
    assert result["restoredText"] == text and result["otherWidgets"] == 0
    assert result["reloadedText"] == text  # after a page reload, from the node's saved properties
    # The node grew for the report, but stays clear of its neighbours (10 px kept free): the one on the right
    # starts at x 420, the one below has its title bar from y 530.
    w, h = result["size"]
    assert 300 < w <= 410 and 200 < h <= 520, result["size"]
    # LiteGraph gives the report between these heights; the report scrolls below its natural height.
    # At least the summary (2 lines of 12 px) and 2 lines below it, with the margins; at most MAX_H.
    assert 80 <= result["minHeight"] <= 120 < result["maxHeight"] <= 640


@pytest.mark.browser
def test_a_cpu_report_says_its_timings_are_no_speed_claims(served):
    """The widget shows the headline speed-up; from a CPU run it must say, above it, that it is no speed claim.
    A report that could not be saved says so where the saved path would be."""
    url, tmp = served
    result = run_page(url.replace("test.html", "cpu.html"), tmp / "profile")
    assert "fatal" not in result, result.get("fatal")
    text = result["text"]
    assert CPU_CAVEAT in text and text.index(CPU_CAVEAT) < text.index("speed-up 2.000x")
    assert "warning: report not saved: NotADirectoryError" in text and "saved: /" not in text
    gpu = run_page(url, tmp / "profile2")["text"]
    assert "not speed claims" not in gpu and "not saved" not in gpu


@pytest.mark.browser
@pytest.mark.parametrize("case", ["roomy", "neighbour_right"])
def test_report_widget_shows_its_last_line(served, case):
    """Where the node has the room, the laid-out widget shows the whole report down to its last line
    (the saved path): nothing scrolls away, and no horizontal scrollbar covers the bottom line."""
    url, tmp = served
    result = run_page(url.replace("test.html", "layout.html"), tmp / "profile")
    assert "fatal" not in result, result.get("fatal")
    r = result[case]
    assert r["last"].startswith("saved: /home/someone/ComfyUI/output/sage_rdna4/"), r
    assert r["scrollWidth"] <= r["clientWidth"], r  # a long path wraps instead of widening the report
    assert r["scrollHeight"] <= r["clientHeight"], r  # all of it visible ...
    assert r["lastBottom"] <= r["boxBottom"] + 0.5, r  # ... the last line included
    if case == "neighbour_right":
        assert r["size"][0] <= 410, r  # and the node still stays clear of its neighbour


@pytest.mark.browser
@pytest.mark.parametrize("case", ["roomy", "neighbour_right", "crowded"])
def test_report_summary_stays_in_view_and_no_cell_wraps(served, case):
    """Wherever the node stands the summary (speed-up, PSNR, what ran) is shown whole, each of its lines one line
    high; in a crowded graph the rest scrolls in a frame at least two lines high (before: 40 px for 494 px of
    report, the third line cut through). No table cell takes two lines (before: 'cosin/e', '1.000 / 00')."""
    url, tmp = served
    result = run_page(url.replace("test.html", "layout.html"), tmp / "profile")
    assert "fatal" not in result, result.get("fatal")
    r = result[case]
    assert r["summaryBottom"] <= r["boxBottom"] + 0.5, r
    assert r["summaryLines"] == 2 and all(h <= 1.01 * r["oneLine"] for h in r["summaryLineHeights"]), r
    assert r["tallestCell"] <= 1.5 * r["oneLine"], r
    assert r["clientHeight"] >= 2 * r["oneLine"], r  # the scrolled part shows two lines at least
    assert all(w <= r["size"][0] for w in r["tableWidths"]), r  # tables fit the node: no sideways scrolling
    if case == "crowded":
        assert r["scrollHeight"] > r["clientHeight"], r  # the rest is there, scrolled


def test_web_folder_is_registered_one_way():
    """ComfyUI registers web/ once per mechanism, under different names ([tool.comfy] web: the project name;
    WEB_DIRECTORY: the folder name), and the frontend then loads the extension twice. Only WEB_DIRECTORY."""
    import comfyui_sage_rdna4

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert "web" not in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]
    assert (ROOT / comfyui_sage_rdna4.WEB_DIRECTORY / "sage_rdna4.js").is_file()


# -- in the real ComfyUI frontend --------------------------------------------------------------------------
WORKFLOWS = cb.workflows()
CRAMPED_BELOW = 13  # the ab workflow's "A/B report" node, moved right under the benchmark node


async def _survey(server, tmp):
    page = await cb.Page.open(CHROMIUM, tmp / "profile")
    try:
        await cb.open_comfy(page, server)
        out = {"extension": await cb.extension_state(page), "workflows": {}}
        for path in WORKFLOWS:
            wf = json.loads(path.read_text(encoding="utf-8"))
            out["workflows"][path.name] = await cb.load_and_snapshot(page, wf, path.name)
        ab = json.loads((cb.WORKFLOW_DIR / "Flux Sage benchmark.json").read_text(encoding="utf-8"))
        report = report_json(make_report())
        await cb.load_and_snapshot(page, ab, "ab")
        out["report_roomy"] = await cb.show_report(page, report)
        await cb.load_and_snapshot(page, ab, "ab")
        out["report_cramped"] = await cb.show_report(page, report, move_below=CRAMPED_BELOW)
        out["messages"] = page.messages
        return out
    finally:
        await page.close()


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    """ComfyUI's server with the pack, and what its frontend showed for every example workflow."""
    comfy = cb.comfy_checkout()
    if comfy is None:
        pytest.skip("COMFYUI_PATH is not a ComfyUI checkout (main.py, comfy/)")
    pytest.importorskip("aiohttp")  # ComfyUI's own requirement; the DevTools client here uses it too
    tmp = tmp_path_factory.mktemp("comfy_frontend")
    server = cb.ComfyServer(comfy, tmp / "base").start()
    try:
        result = asyncio.run(_survey(server, tmp))
        result["templates"] = server.get_json("/workflow_templates")
        result["thumbnails"] = {p.name: server.get(f"/api/workflow_templates/{cb.PACK_FOLDER}/{p.stem}.jpg")[:2]
                                for p in WORKFLOWS}
    finally:
        server.stop()
    result["server_log"] = server.log()
    return result


@pytest.mark.browser
@pytest.mark.comfyui
def test_pack_loads_in_the_server(frontend):
    log = frontend["server_log"]
    assert "Cannot import" not in log or cb.PACK_FOLDER not in log.split("Cannot import", 1)[1][:400]
    assert sorted(frontend["templates"][cb.PACK_FOLDER]) == sorted(p.stem for p in WORKFLOWS)


@pytest.mark.browser
@pytest.mark.comfyui
def test_extension_is_served_and_registered_once(frontend):
    ext = frontend["extension"]
    assert ext["urls"] == [f"/extensions/{cb.PACK_FOLDER}/sage_rdna4.js"]  # one web folder, not two
    assert ext["registered"] == 1
    assert not [m for m in frontend["messages"] if "already registered" in m["text"]]


@pytest.mark.browser
@pytest.mark.comfyui
def test_no_console_errors_about_the_pack(frontend):
    assert cb.messages_about_us(frontend["messages"]) == []


@pytest.mark.browser
@pytest.mark.comfyui
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_in_the_frontend(frontend, path):
    snap = frontend["workflows"][path.name]
    assert snap["missing"] == [], f"missing node types: {snap['missing']}"
    assert all(n["registered"] for n in snap["nodes"])
    saved = {n["id"]: n for n in json.loads(path.read_text(encoding="utf-8"))["nodes"]}
    assert sorted(saved) == sorted(n["id"] for n in snap["nodes"])
    title = snap["titleHeight"]
    for n in snap["nodes"]:
        where = f"{path.name} node {n['id']} ({n['type']})"
        # The saved size already fits the node's sockets and widgets (the frontend did not have to grow it).
        assert saved[n["id"]]["size"][0] >= n["min"][0] - 0.5, f"{where}: width {n['min']}"
        assert saved[n["id"]]["size"][1] >= n["min"][1] - 0.5, f"{where}: height {n['min']}"
        # LiteGraph's own bounding box is pos/size with the title bar above: what the overlap check uses.
        if n["box"] and n["box"][2]:
            assert n["box"] == pytest.approx(list(cb.node_box(n, title)[:2]) + [n["size"][0], n["size"][1] + title])
    assert cb.overlaps(snap["nodes"], title) == []


@pytest.mark.browser
@pytest.mark.comfyui
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_template_thumbnail_is_served(frontend, path):
    status, content_type = frontend["thumbnails"][path.name]
    assert status == 200 and content_type == "image/jpeg"


@pytest.mark.browser
@pytest.mark.comfyui
def test_report_widget_shows_the_report_where_there_is_room(frontend):
    r = frontend["report_roomy"]
    assert r["mounted"] and "speed-up 2.000x" in r["text"]
    assert r["after"][0] > r["before"][0] and r["after"][1] > r["before"][1]  # grown to the content ...
    assert r["scrollHeight"] <= r["clientHeight"] + 1 and r["lastInView"]  # ... all of it visible
    assert r["summaryInView"] and r["lastLine"].startswith("saved: ")
    assert cb.overlaps(r["nodes"], r["titleHeight"]) == []


@pytest.mark.browser
@pytest.mark.comfyui
def test_report_widget_keeps_its_summary_in_a_crowded_graph(frontend):
    """A node close below (40 px): the node takes no more than the least report area (the summary and two lines),
    the summary shows whole, the rest scrolls. Before, the area shrank to 40 px and cut the third line through."""
    r = frontend["report_cramped"]
    assert r["mounted"] and r["summaryInView"], r
    assert r["summaryLines"][0].startswith("speed-up 2.000x (ratio 0.500)"), r["summaryLines"]
    assert r["after"][1] <= r["min"][1] + 1, r  # it took only its least height
    assert r["clientHeight"] >= 24 and r["scrollHeight"] > r["clientHeight"]  # two lines, the rest scrolls


# -- the A/B template run for real: a tiny Flux on the CPU -------------------------------------------------------
AB_TEMPLATE = cb.WORKFLOW_DIR / "Flux Sage benchmark.json"


async def _run_ab(server, tmp, shots):
    page = await cb.Page.open(CHROMIUM, tmp / "profile_run")
    try:
        await cb.open_comfy(page, server)
        wf = json.loads(AB_TEMPLATE.read_text(encoding="utf-8"))
        out = await cb.run_benchmark_on_tiny_model(page, server, wf, AB_TEMPLATE.name, shots)
        out["messages"] = page.messages
        return out
    finally:
        await page.close()


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    """The A/B template run in ComfyUI's frontend on a tiny Flux: the report after the run, after a tab switch and
    after a cached re-run, screenshots (in $SAGE_BROWSER_SHOTS if set, else the test's temporary folder), and the
    server's answers to bad prompts."""
    comfy = cb.comfy_checkout()
    if comfy is None:
        pytest.skip("COMFYUI_PATH is not a ComfyUI checkout (main.py, comfy/)")
    pytest.importorskip("aiohttp")
    tmp = tmp_path_factory.mktemp("comfy_ab_run")
    shots = Path(os.environ.get("SAGE_BROWSER_SHOTS") or tmp / "shots")
    server = cb.ComfyServer(comfy, tmp / "base", tiny_models=True).start()
    try:
        result = asyncio.run(_run_ab(server, tmp, shots))
        ids = result["ids"]
        prompt = result["prompt"]
        patch, bench = str(ids["patch"]), str(ids["bench"])

        def answer(edit):
            p = json.loads(json.dumps(prompt))
            edit(p)
            return server.post_json("/prompt", {"prompt": p, "client_id": "sage-test"})
        result["api"] = {
            "bad_blocks": answer(lambda p: p[patch]["inputs"].update(exact_blocks="0-5,7-")),
            "reversed_steps": answer(lambda p: p[patch]["inputs"].update(step_start=0.8, step_end=0.2)),
            "bad_kernel": answer(lambda p: p[bench]["inputs"].update(kernel="hip_int8")),
            "alone": answer(lambda p: [p.pop(k) for k in [k for k, v in p.items()
                                                          if v["class_type"] in ("PreviewImage", "PreviewAny")]]),
        }
    finally:
        server.stop()
    result["server_log"] = server.log()
    result["shots"] = shots
    return result


def _report_shown(state):
    return state["mounted"] and state["visible"] and any(line.startswith("speed-up") for line in state["summaryLines"])


@pytest.mark.browser
@pytest.mark.comfyui
def test_ab_template_runs_on_a_tiny_model_and_shows_its_report(ab_run):
    r = ab_run["after_run"]
    assert _report_shown(r), (r, ab_run["server_log"][-3000:])
    assert r["summaryInView"] and r["lastInView"], r  # at the template's layout: the summary and the last line
    assert r["lastLine"].startswith("saved: "), r["lastLine"]
    # The CPU has no kernel of the pack: the summary says so rather than naming a kernel that did not run.
    assert any(line.startswith("ran no kernel of the pack: ") and " fallback" in line
               and re.search(r" vs own attention( \([\w -]+\))?$", line) for line in r["summaryLines"]), r
    assert r["summaryLines"][0].startswith("CPU run"), r["summaryLines"]  # no speed claim on the CPU
    assert (ab_run["shots"] / "ab_report_after_run.jpg").stat().st_size > 5000
    graph = ab_run["after_run_graph"]
    assert cb.overlaps(graph["nodes"], graph["titleHeight"]) == []  # it grew into free space only


@pytest.mark.browser
@pytest.mark.comfyui
def test_the_missing_models_dialog_offers_the_templates_model_files(ab_run):
    """The template's properties.models reach the frontend: its Missing Models dialog lists each file by folder."""
    text = "\n".join(ab_run["dialogs"])
    for entry in ("diffusion_models / flux1-dev.safetensors", "text_encoders / clip_l.safetensors",
                  "text_encoders / t5xxl_fp16.safetensors", "vae / ae.safetensors"):
        assert entry in text, text


@pytest.mark.browser
@pytest.mark.comfyui
def test_the_report_comes_back_after_a_tab_switch_and_a_cached_rerun(ab_run):
    """Before: the node stayed an empty box after a tab switch or reload, and a cached re-run sent nothing."""
    for key in ("after_tab_switch", "after_cached_run"):
        state = ab_run[key]
        assert _report_shown(state) and state["summaryInView"], (key, state)
        assert state["text"] == ab_run["after_run"]["text"], key  # the same report, drawn again


@pytest.mark.browser
@pytest.mark.comfyui
def test_the_report_comes_back_after_a_page_reload(ab_run):
    state = ab_run["after_reload"]
    assert state is not None and _report_shown(state) and state["summaryInView"], (state, ab_run["reload_debug"])
    assert state["text"] == ab_run["after_run"]["text"]


@pytest.mark.browser
@pytest.mark.comfyui
def test_a_bad_block_spec_fails_at_queue_time_in_the_ui(ab_run):
    errors = ab_run["bad_blocks_errors"]["errors"]  # ComfyUI answer: {node id: {"errors": [...], ...}}
    patch = str(ab_run["ids"]["patch"])
    assert ab_run["bad_blocks_errors"]["queued"] is False, ab_run["bad_blocks_errors"]
    assert errors and patch in errors, ab_run["bad_blocks_errors"]
    details = " ".join(e.get("details", "") for e in errors[patch].get("errors", []))
    assert "Patch Sage Attention (RDNA4): exact_blocks: cannot read block spec '7-'" in details, \
        ab_run["bad_blocks_errors"]
    assert ab_run["queue_after_bad"]["queue_running"] == [] and ab_run["queue_after_bad"]["queue_pending"] == []


@pytest.mark.browser
@pytest.mark.comfyui
@pytest.mark.parametrize("case, node, words", [
    ("bad_blocks", "patch", "Patch Sage Attention (RDNA4): exact_blocks"),
    ("reversed_steps", "patch", "Patch Sage Attention (RDNA4): need 0 <= step_start <= step_end <= 1"),
    ("bad_kernel", "bench", "Sage Attention Benchmark (RDNA4): kernel must be one of"),
])
def test_bad_api_prompts_are_refused_before_running(ab_run, case, node, words):
    """Before: /prompt answered 200 and the node failed when it ran."""
    status, answer = ab_run["api"][case]
    assert status == 400, (status, answer)
    errors = answer["node_errors"][str(ab_run["ids"][node])]["errors"]
    assert any(words in e.get("details", "") for e in errors), errors


@pytest.mark.browser
@pytest.mark.comfyui
def test_the_ab_node_runs_without_a_node_after_it(ab_run):
    """Before: 400 "Prompt has no outputs" without a preview node downstream."""
    status, answer = ab_run["api"]["alone"]
    assert status == 200, answer
