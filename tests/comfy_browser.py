"""A real ComfyUI server with this pack, and headless Chromium driven through the DevTools protocol.

Used by tests/test_web_extension.py (the pack's frontend in the real ComfyUI frontend), tests/test_workflows.py
(node boxes and overlaps) and tools/template_thumbnails.py (redraws example_workflows/<name>.jpg). Not a test
module (no test_ prefix).

The server runs from COMFYUI_PATH with its own temporary base directory (--base-directory): custom_nodes/
there holds only a link to this checkout, and nothing is written into the ComfyUI checkout. Chromium runs
with a fresh profile and talks only to that local server. The protocol client is aiohttp's websocket client,
which ComfyUI's server needs anyway.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_DIR = ROOT / "example_workflows"
PACK_FOLDER = "ComfyUI-SageAttention-RDNA4"  # the folder name a git clone of the repository gets
EXTENSION_NAME = "sage_rdna4.benchmark_report"
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar sits above pos[1]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]
# Settings of the fresh ComfyUI user: no first-run template dialog, no minimap over the graph.
USER_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False}


def find_chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def comfy_checkout() -> Optional[Path]:
    path = os.environ.get("COMFYUI_PATH")
    if path and (Path(path) / "main.py").is_file() and (Path(path) / "comfy").is_dir():
        return Path(path).resolve()
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workflows():
    return sorted(WORKFLOW_DIR.glob("*.json"))


# -- ComfyUI -----------------------------------------------------------------------------------------------
# A test-only node pack the server gets beside this one (with `tiny_models=True`): a tiny Flux with random weights
# and its conditioning, built by tests/comfy_harness.py, so the A/B node runs on the CPU in seconds.
TINY_MODEL_NODE = "SageTestTinyFlux"
TINY_MODEL_PACK = '''"""Test fixture of the sage_rdna4 browser tests: not part of the pack."""
import sys

sys.path.insert(0, {tests!r})
import comfy_harness  # noqa: E402


class SageTestTinyFlux:
    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{}}}}

    RETURN_TYPES = ("MODEL", "CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("model", "positive", "negative")
    FUNCTION = "build"
    CATEGORY = "testing"

    def build(self):
        return (comfy_harness.tiny_flux(0), comfy_harness.flux_conditioning(seed=1),
                comfy_harness.flux_conditioning(seed=2))


NODE_CLASS_MAPPINGS = {{"SageTestTinyFlux": SageTestTinyFlux}}
'''


class ComfyServer:
    """`python main.py --cpu` from a ComfyUI checkout, with a temporary base directory holding this pack."""

    def __init__(self, comfy: Path, base: Path, python: str = sys.executable, tiny_models: bool = False):
        self.comfy, self.base, self.python, self.tiny_models = Path(comfy), Path(base), python, tiny_models
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base / "comfyui.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 300.0) -> "ComfyServer":
        custom = self.base / "custom_nodes"
        custom.mkdir(parents=True, exist_ok=True)
        (custom / PACK_FOLDER).symlink_to(ROOT, target_is_directory=True)
        if self.tiny_models:
            (custom / "sage_rdna4_test_fixture").mkdir()
            (custom / "sage_rdna4_test_fixture" / "__init__.py").write_text(
                TINY_MODEL_PACK.format(tests=str(ROOT / "tests")))
        settings = self.base / "user" / "default" / "comfy.settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(USER_SETTINGS))
        cmd = [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base), "--database-url", "sqlite:///:memory:",
               "--disable-auto-launch"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.comfy, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + quote(path, safe="/?=&:"), timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str):
        """(status, content type, body); the path is quoted as a browser does (template names have spaces)."""
        with urllib.request.urlopen(self.url + quote(path, safe="/?=&:"), timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()

    def post_json(self, path: str, body: dict):
        """(status, JSON answer) of a POST; an HTTP error's status and body too."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- Chromium ----------------------------------------------------------------------------------------------
class PageError(RuntimeError):
    pass


class Page:
    """One headless Chromium tab over the DevTools protocol. Keeps every console message and page error."""

    def __init__(self):
        self.proc = None
        self.session = None
        self.ws = None
        self.messages = []  # {"level", "text"}
        self._next_id = 0
        self._pending = {}
        self._reader = None

    @classmethod
    async def open(cls, chromium: str, profile: Path, width: int = 1600, height: int = 1000) -> "Page":
        import aiohttp

        page = cls()
        profile.mkdir(parents=True, exist_ok=True)
        port_file = profile / "DevToolsActivePort"
        page.proc = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if page.proc.poll() is not None or time.monotonic() > deadline:
                page.proc.kill()
                raise PageError("Chromium did not open its DevTools port")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        page.session = aiohttp.ClientSession()
        for _ in range(100):
            async with page.session.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = [t for t in await r.json() if t.get("type") == "page"]
            if targets:
                break
            await asyncio.sleep(0.1)
        page.ws = await page.session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
        page._reader = asyncio.ensure_future(page._read())
        for domain in ("Runtime", "Log", "Page"):
            await page.call(f"{domain}.enable")
        await page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        return page

    async def _read(self):
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.consoleAPICalled":
                parts = [a.get("value", a.get("description", "")) for a in params.get("args", [])]
                self.messages.append({"level": params.get("type"), "text": " ".join(map(str, parts))})
            elif method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                text = d.get("exception", {}).get("description") or d.get("text", "")
                self.messages.append({"level": "exception", "text": f"{text} ({d.get('url', '')})"})
            elif method == "Log.entryAdded":
                e = params.get("entry", {})
                self.messages.append({"level": e.get("level"), "text": f"{e.get('text')} ({e.get('url', '')})"})

    async def call(self, method: str, timeout: float = 60.0, **params):
        self._next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = fut
        await self.ws.send_str(json.dumps({"id": self._next_id, "method": method, "params": params}))
        data = await asyncio.wait_for(fut, timeout)
        if "error" in data:
            raise PageError(f"{method}: {data['error']}")
        return data["result"]

    async def evaluate(self, expression: str, timeout: float = 60.0):
        """The JSON value of `expression` (awaited when it is a promise); raises on a thrown error."""
        result = await self.call("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                                 returnByValue=True)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise PageError(d.get("exception", {}).get("description") or d.get("text"))
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 120.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if await self.evaluate(expression):
                    return
            except PageError:
                pass
            await asyncio.sleep(0.25)
        raise PageError(f"timed out waiting for {what or expression}")

    async def goto(self, url: str):
        await self.call("Page.navigate", url=url)

    async def screenshot_jpeg(self, clip: dict, quality: int = 80) -> bytes:
        result = await self.call("Page.captureScreenshot", format="jpeg", quality=quality, clip=clip,
                                 captureBeyondViewport=False)
        return base64.b64decode(result["data"])

    async def close(self):
        try:
            if self.ws is not None:
                await self.ws.close()
            if self._reader is not None:
                self._reader.cancel()
            if self.session is not None:
                await self.session.close()
        finally:
            if self.proc is not None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


# -- The ComfyUI frontend ----------------------------------------------------------------------------------
# Runs in the page: `app` and `LiteGraph` are the frontend's globals (window.app is set once the graph canvas
# is ready). A probe extension records the missing node types ComfyUI's loadGraphData reports.
JS_READY = ("!!(window.app && window.app.graph && window.app.canvas && window.LiteGraph && "
            "LiteGraph.registered_node_types['PatchSageAttentionRDNA4'])")

JS_INSTALL_PROBE = """(() => {
  if (!window.__sageProbe) {
    window.__sageProbe = true;
    app.registerExtension({
      name: "sage_rdna4.test_probe",
      afterConfigureGraph(missing) {
        window.__sageMissing = (missing || []).map((m) => (typeof m === "string" ? m : m.type));
      },
    });
  }
  return true;
})()"""

JS_HELPERS = """
const graphNodes = () => app.graph.nodes ?? app.graph._nodes;
const frames = (n) => new Promise((resolve) => {
  const step = (k) => (k <= 0 ? resolve() : requestAnimationFrame(() => step(k - 1)));
  step(n);
});
const settle = async () => { app.graph.setDirtyCanvas(true, true); await frames(3);
  await new Promise((r) => setTimeout(r, 150)); await frames(2); };
const nodeInfo = (n) => ({
  id: n.id, type: n.type, title: n.title, pos: Array.from(n.pos), size: Array.from(n.size),
  min: Array.from(n.computeSize()), box: Array.from(n.boundingRect ?? []), collapsed: !!n.flags?.collapsed,
  registered: n.type in LiteGraph.registered_node_types,
});
const loadWorkflow = async (wf, name) => {
  window.__sageMissing = null;
  await app.loadGraphData(wf, true, true, name);
  await settle();
};
// The report widget of a benchmark node as the page shows it: the summary (whole and in view?), the scrolled
// body (its visible and full heights), the last line (in view?), the text.
const reportState = (node) => {
  const widget = node.widgets?.find((w) => w.name === "sage_rdna4_report");
  const el = widget?.element;
  const body = el?.querySelector(".sage-rdna4-body"), summary = el?.querySelector(".sage-rdna4-summary");
  const box = el?.getBoundingClientRect(), last = body?.lastElementChild;
  const rect = (e) => (e ? e.getBoundingClientRect() : null);
  return {
    after: Array.from(node.size), min: Array.from(node.computeSize()),
    widgetHeight: widget?.computedHeight ?? null, mounted: !!el?.isConnected,
    visible: !!el && el.offsetParent !== null && (box?.height ?? 0) > 0,
    clientHeight: body?.clientHeight ?? 0, scrollHeight: body?.scrollHeight ?? 0,
    clientWidth: body?.clientWidth ?? 0, scrollWidth: body?.scrollWidth ?? 0,
    summaryLines: summary ? [...summary.children].map((d) => d.textContent) : [],
    summaryInView: !!summary && rect(summary).bottom <= box.bottom + 0.5 && rect(summary).top >= box.top - 0.5,
    lastLine: last?.textContent ?? "", lastInView: !!last && rect(last).bottom <= rect(body).bottom + 0.5,
    text: el?.textContent ?? "",
  };
};
const snapshot = () => ({
  nodes: graphNodes().map(nodeInfo),
  missing: window.__sageMissing,
  titleHeight: LiteGraph.NODE_TITLE_HEIGHT,
});
"""


JS_RUN_HELPERS = """
const benchNode = () => graphNodes().find((n) => n.type === "SageAttentionBenchmarkRDNA4");
const setWidget = (node, name, value) => { node.widgets.find((w) => w.name === name).value = value; };
// Programmatic edits are not seen by the workflow's change tracker until it checks: a tab switch would bring the
// graph back as it was loaded.
const recordState = () => app.extensionManager?.workflow?.activeWorkflow?.changeTracker?.checkState?.();
// The loaded A/B template, run on the tiny model: its loaders, text and decode nodes removed (a muted loader
// leaves an entry without class_type in the prompt after a tab switch), the tiny model's outputs wired in their
// place, a 64 px latent, 3 steps. The nodes next to the A/B node (Patch, latent, previews) stay where they are.
const wireTinyModel = () => {
  const bench = benchNode();
  const patch = graphNodes().find((n) => n.type === "PatchSageAttentionRDNA4");
  const latent = graphNodes().find((n) => n.type === "EmptySD3LatentImage");
  const keep = new Set([bench, patch, latent, ...graphNodes().filter((n) => ["PreviewImage", "PreviewAny"]
    .includes(n.type))]);
  for (const n of [...graphNodes()]) if (!keep.has(n)) app.graph.remove(n);
  const tiny = LiteGraph.createNode("SageTestTinyFlux");
  tiny.pos = [20, 1000];
  app.graph.add(tiny);
  tiny.connect(0, patch, patch.findInputSlot("model"));
  tiny.connect(1, bench, bench.findInputSlot("positive"));
  tiny.connect(2, bench, bench.findInputSlot("negative"));
  bench.disconnectInput(bench.findInputSlot("vae"));
  setWidget(latent, "width", 64);
  setWidget(latent, "height", 64);
  setWidget(bench, "steps", 3);
  recordState();
  return { bench: bench.id, patch: patch.id };
};
// Brings the A/B node into view at scale 1 and returns its page rectangle, title bar included.
const frameBench = async () => {
  const node = benchNode(), ds = app.canvas.ds, title = LiteGraph.NODE_TITLE_HEIGHT;
  ds.scale = 1;
  ds.offset[0] = 40 - node.pos[0];
  ds.offset[1] = 40 + title - node.pos[1];
  await settle();
  const r = app.canvas.canvas.getBoundingClientRect();
  return { x: r.left + 30, y: r.top + 30, width: node.size[0] + 20, height: node.size[1] + title + 20 };
};
"""


def _js(body: str) -> str:
    return f"(async () => {{ {JS_HELPERS}\n{JS_RUN_HELPERS}\n{body} }})()"


async def open_comfy(page: Page, server: ComfyServer):
    await page.goto(server.url + "/")
    await page.wait_for(JS_READY, timeout=180, what="the ComfyUI frontend with the pack's nodes")
    await page.evaluate(JS_INSTALL_PROBE)


async def load_and_snapshot(page: Page, workflow: dict, name: str) -> dict:
    return await page.evaluate(_js(f"await loadWorkflow({json.dumps(workflow)}, {json.dumps(name)});\n"
                                   "return snapshot();"))


async def extension_state(page: Page) -> dict:
    return await page.evaluate(_js(f"""
      const listed = await (await fetch("/extensions")).json();
      return {{
        registered: app.extensions.filter((e) => e.name === {json.dumps(EXTENSION_NAME)}).length,
        urls: listed.filter((u) => u.endsWith("/sage_rdna4.js")),
      }};"""))


async def show_report(page: Page, report_json: str, move_below: Optional[int] = None) -> dict:
    """Feeds a report to the loaded graph's benchmark node, as ComfyUI does after a run (onExecuted).

    With `move_below`, the node of that id is first moved right under the benchmark node (a crowded graph).
    Returns the graph snapshot plus the report widget's geometry."""
    return await page.evaluate(_js(f"""
      const node = graphNodes().find((n) => n.type === "SageAttentionBenchmarkRDNA4");
      const moveBelow = {json.dumps(move_below)};
      if (moveBelow !== null) {{
        const other = app.graph.getNodeById(moveBelow);
        other.pos = [node.pos[0] + 20, node.pos[1] + node.size[1] + 40 + LiteGraph.NODE_TITLE_HEIGHT];
        await settle();
      }}
      const before = Array.from(node.size);
      const message = {{ text: ["report"], sage_rdna4_report: [{json.dumps(report_json)}] }};
      node.onExecuted(message);
      await settle();
      node.onExecuted(message);  // a second run refills the same widget
      await settle();
      return {{ ...snapshot(), id: node.id, before, ...reportState(node) }};"""))


# The text of the open dialogs (the Missing Models dialog lists the template's model files with download
# buttons), then closes them: they would cover the graph.
JS_CLOSE_DIALOGS = """
  await new Promise((r) => setTimeout(r, 300));
  const dialogs = [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText);
  for (const b of document.querySelectorAll(".p-dialog .p-dialog-close-button")) b.click();
  await settle();
  return dialogs;"""


async def run_benchmark_on_tiny_model(page: Page, server: ComfyServer, workflow: dict, name: str,
                                      shots: Path, timeout: float = 300.0) -> dict:
    """Loads the A/B template, runs it on the tiny model (the server needs `tiny_models=True`) and returns what
    the page showed: the report after the run (and its screenshot at the template's layout), after a switch to
    another tab and back, and after a re-run with the same inputs (cached by ComfyUI); then the prompt of the
    graph for API checks, and the node errors of a queued bad exact_blocks."""
    await load_and_snapshot(page, workflow, name)
    out = {"dialogs": await page.evaluate(_js(JS_CLOSE_DIALOGS))}
    ids = await page.evaluate(_js("return wireTinyModel();"))
    out["ids"] = ids
    await page.evaluate(_js("await app.queuePrompt(0, 1); return true;"))
    await page.wait_for("(() => { const n = (app.graph.nodes ?? app.graph._nodes).find((n) => n.type === "
                        "'SageAttentionBenchmarkRDNA4'); const w = n?.widgets?.find((w) => w.name === "
                        "'sage_rdna4_report'); return !!w && w.element.textContent.includes('speed-up'); })()",
                        timeout=timeout, what="the A/B report on the node")
    rect = await page.evaluate(_js("return await frameBench();"))
    out["after_run"] = await page.evaluate(_js("return reportState(benchNode());"))
    out["after_run_graph"] = await page.evaluate(_js("return snapshot();"))
    shots.mkdir(parents=True, exist_ok=True)
    (shots / "ab_report_after_run.jpg").write_bytes(await page.screenshot_jpeg({**rect, "scale": 1}, quality=85))
    # Another tab, then back: the node is new, the frontend restores its stored output.
    await page.evaluate(_js("""
      await app.extensionManager.command.execute("Comfy.NewBlankWorkflow"); await settle();
      await app.extensionManager.command.execute("Workspace.PreviousOpenedWorkflow"); await settle();
      await new Promise((r) => setTimeout(r, 500)); await settle(); return true;"""))
    out["after_tab_switch"] = await page.evaluate(_js("await frameBench(); return reportState(benchNode());"))
    (shots / "ab_report_after_tab_switch.jpg").write_bytes(
        await page.screenshot_jpeg({**(await page.evaluate(_js("return await frameBench();"))), "scale": 1}))
    # The same inputs again: ComfyUI answers from its cache, and the report stays (or comes back).
    await page.evaluate(_js("await app.queuePrompt(0, 1); return true;"))
    await asyncio.sleep(3)
    out["after_cached_run"] = await page.evaluate(_js("return reportState(benchNode());"))
    out["prompt"] = (await page.evaluate(_js("return await app.graphToPrompt();")))["output"]
    # A page reload: the frontend restores the open workflow and, as for image previews, its stored outputs.
    await page.evaluate(_js("recordState(); return true;"))
    await asyncio.sleep(1.5)  # the workflow is persisted on a short delay
    await page.call("Page.reload")
    await page.wait_for("!window.__sageProbe", timeout=60, what="the reloaded page")  # the old page is gone
    await page.wait_for(JS_READY, timeout=180, what="the frontend after a reload")
    await page.evaluate(JS_INSTALL_PROBE)
    try:
        await page.wait_for("(() => { const n = (app.graph.nodes ?? app.graph._nodes).find((n) => n.type === "
                            "'SageAttentionBenchmarkRDNA4'); return !!n?.widgets?.find((w) => w.name === "
                            "'sage_rdna4_report'); })()", timeout=20, what="the report after a reload")
    except PageError:
        pass  # checked by the test, from the state below
    out["after_reload"] = await page.evaluate(_js("await settle(); const n = benchNode(); "
                                                  "return n ? reportState(n) : null;"))
    out["reload_debug"] = await page.evaluate(_js("return { outputs: Object.keys(app.nodeOutputs || {}), "
                                                  "nodes: graphNodes().map((n) => [n.id, n.type]) };"))
    # A bad block spec queued from the UI: ComfyUI's validation answers before anything runs.
    out["bad_blocks_errors"] = await page.evaluate(_js(f"""
      const patch = app.graph.getNodeById({ids["patch"]});
      setWidget(patch, "exact_blocks", "0-5,7-");
      recordState();
      const sent = (await app.graphToPrompt()).output[{ids["patch"]}]?.inputs?.exact_blocks;
      const queued = await app.queuePrompt(0, 1);
      await settle();
      const errors = JSON.parse(JSON.stringify(app.lastNodeErrors));  // a reactive store object
      setWidget(patch, "exact_blocks", "");
      return {{ errors, queued, sent }};"""))
    out["queue_after_bad"] = server.get_json("/queue")
    return out


# -- Checks shared by the tests ----------------------------------------------------------------------------
def node_box(node: dict, title_height: float = TITLE_HEIGHT):
    """x0, y0, x1, y1 of a node as LiteGraph draws it: the title bar above pos, the body below."""
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - title_height, x + w, y + h


def overlaps(nodes: list, title_height: float = TITLE_HEIGHT):
    """Pairs of nodes whose boxes (title bar included) intersect: [(id_a, id_b), ...]."""
    boxes = [(n["id"], node_box(n, title_height)) for n in nodes]
    found = []
    for i, (a, (ax0, ay0, ax1, ay1)) in enumerate(boxes):
        for b, (bx0, by0, bx1, by1) in boxes[i + 1:]:
            if ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1:
                found.append((a, b))
    return found


def messages_about_us(messages: list) -> list:
    keys = ("sage_rdna4", PACK_FOLDER.lower(), "sageattention", "already registered")
    return [m for m in messages if m["level"] in ("error", "exception", "warning", "assert")
            and any(k in m["text"].lower() for k in keys)]
