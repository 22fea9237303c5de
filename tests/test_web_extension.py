"""The frontend extension (web/sage_rdna4.js) in headless Chromium.

The page serves the extension the way ComfyUI does (/extensions/<pack>/sage_rdna4.js, importing
../../scripts/app.js) and stubs only what the extension touches of ComfyUI, each part being ComfyUI's
documented contract rather than behaviour we invent: `app.registerExtension(ext)` records the extension;
a node type is a constructor whose prototype has LiteGraph's `addDOMWidget(name, type, element, options)`;
`onExecuted(message)` receives the node's UI output. The report fed to it is written by the pack's own
Python (report_json), so a change of keys on either side fails here. Skipped when no Chromium is installed
(CI: `apt-get install -y chromium`).
"""
import html
import http.server
import json
import re
import shutil
import subprocess
import threading
from functools import partial
from pathlib import Path

import pytest

from comfyui_sage_rdna4.sage_patch.report import report_json, summarize_steps

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p),
                None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium/Chrome on PATH")

APP_STUB = """export const app = {
  extensions: [],
  registerExtension(ext) { this.extensions.push(ext); },
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
  const ext = app.extensions[0];
  function BenchmarkNode() { this.widgets = []; this.size = [300, 200]; }
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
  const message = { text: ["plain text"], sage_rdna4_report: [REPORT] };
  node.onExecuted(message);
  node.onExecuted(message);  // a second run updates the same widget
  node.onExecuted({ text: ["no report"] });  // other UI output is ignored
  const canvas = document.getElementById("canvas");
  out.textContent = JSON.stringify({
    extensions: app.extensions.map((e) => e.name),
    widgets: node.widgets.length,
    serialize: node.widgets[0] && node.widgets[0].options.serialize,
    otherTouched: "onExecuted" in OtherNode.prototype,
    text: canvas.textContent,
    rows: canvas.querySelectorAll("tr").length,
    bold: canvas.querySelectorAll("b").length,
    size: node.size,
    errors: window.__errors,
  });
} catch (err) {
  out.textContent = JSON.stringify({ fatal: String(err && err.stack || err), errors: window.__errors });
}
</script></body></html>
"""


def make_report():
    steps = lambda times, attn: [{"index": i, "step_ms": t, "attention_ms": a} for i, (t, a) in  # noqa: E731
                                 enumerate(zip(times, attn))]
    summary = summarize_steps(steps([100.0, 50.0, 50.0], [40.0, 20.0, 20.0]), steps([300.0, 25.0, 25.0],
                                                                               [290.0, 5.0, 5.0]))
    return {"kernel": "triton_int8_fp8", "model": "Flux", "device": "NVIDIA H200 (sm_90)", **summary,
            "fidelity": {"latent_psnr_db": 43.42, "latent_cosine": 0.998307, "image_psnr_db": None},
            "attention_accuracy": [{"step": 0, "call": 1, "shape": "B1 H24 Nq4608 Nk4608 D128",
                                    "backend": "triton_int8_fp8", "cosine": 0.99982, "rel_l1": 0.0441}],
            "fallbacks": {"triton_int8_fp8: head_dim 256 <b>too large</b>": 3}, "routed": {},
            "json_path": "/out/sage_rdna4/ab_1.json"}


@pytest.fixture
def served(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP_STUB)
    ext_dir = tmp_path / "extensions" / "sage_rdna4"
    ext_dir.mkdir(parents=True)
    shutil.copy(ROOT / "web" / "sage_rdna4.js", ext_dir / "sage_rdna4.js")
    (tmp_path / "test.html").write_text(PAGE.replace("REPORT", json.dumps(report_json(make_report()))))

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


def test_extension_renders_the_report_table(served):
    url, tmp = served
    result = run_page(url, tmp / "profile")
    assert "fatal" not in result, result.get("fatal")
    assert result["errors"] == []
    assert result["extensions"] == ["sage_rdna4.benchmark_report"]
    assert result["widgets"] == 1 and result["serialize"] is False
    assert result["otherTouched"] is False
    text = result["text"]
    assert "kernel triton_int8_fp8 vs exact SDPA" in text
    assert "speed-up 2.000x (ratio 0.500) over 2 steps" in text
    assert "0 (warm-up)" in text and "300.0" in text and "0.500" in text
    assert "latent PSNR 43.42 dB" in text and "image PSNR n/a (no VAE)" in text
    assert "0.99982" in text and "B1 H24 Nq4608 Nk4608 D128" in text
    assert "3 × triton_int8_fp8: head_dim 256 <b>too large</b>" in text  # shown as text, not markup
    assert result["bold"] == 0
    assert result["rows"] == 4 + 2  # step table: header + 3 steps; accuracy table: header + 1 call
    assert result["size"][0] >= 520
