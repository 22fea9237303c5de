"""Redraws the template thumbnails (example_workflows/<name>.jpg) from the real ComfyUI frontend.

    COMFYUI_PATH=/path/to/ComfyUI python tools/template_thumbnails.py

Starts ComfyUI's server with this pack and headless Chromium (tests/comfy_browser.py, the browser test's own
driver, loaded by path), loads each example workflow and writes, beside it, a picture of the pack's node in it (the
A/B node, else the Patch node) with a little of its neighbours, drawn at full size: a whole-graph miniature was
unreadable at the size of a template card. Needs Chromium on PATH and a ComfyUI checkout in COMFYUI_PATH.
tests/test_workflows.py checks that every workflow has its picture; tests/test_web_extension.py that ComfyUI
serves them.
"""
import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_browser():
    spec = importlib.util.spec_from_file_location("comfy_browser", ROOT / "tests" / "comfy_browser.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cb = _load_browser()

JS_HIDE_CHROME = """(() => {
  const style = document.createElement("style");
  style.textContent = `body * { visibility: hidden !important; }
    canvas#graph-canvas, .dom-widget, .dom-widget * { visibility: visible !important; }`;
  document.head.appendChild(style);
  return true;
})()"""


ASPECT = 1.4  # width / height of the picture, about that of a template card
CONTEXT = 70  # graph units shown around the node: the links in and out, the neighbours' edges


async def thumbnail(page: "cb.Page", workflow: dict, name: str, scale: float, quality: int) -> bytes:
    """The workflow's main pack node as the frontend draws it, at scale 1 with some context, shrunk by `scale`."""
    await cb.load_and_snapshot(page, workflow, name)
    await page.evaluate(JS_HIDE_CHROME)
    rect = await page.evaluate(cb._js(f"""
      const canvas = app.canvas;
      canvas.show_info = false;  // no frame statistics in the corner
      canvas.deselectAll?.();
      const nodes = graphNodes();
      const focus = nodes.find((n) => n.type === "SageAttentionBenchmarkRDNA4")
        ?? nodes.find((n) => n.type === "PatchSageAttentionRDNA4");
      const title = LiteGraph.NODE_TITLE_HEIGHT, pad = {CONTEXT};
      let w = focus.size[0] + 2 * pad, h = focus.size[1] + title + 2 * pad;
      if (w / h < {ASPECT}) w = h * {ASPECT}; else h = w / {ASPECT};
      const cx = focus.pos[0] + focus.size[0] / 2, cy = focus.pos[1] - title + (focus.size[1] + title) / 2;
      canvas.ds.scale = 1;
      canvas.ds.offset[0] = w / 2 - cx;
      canvas.ds.offset[1] = h / 2 - cy;
      await settle();
      const r = canvas.canvas.getBoundingClientRect();
      return {{ x: r.left, y: r.top, width: w, height: h }};"""))
    clip = {k: round(v) for k, v in rect.items()}
    return await page.screenshot_jpeg({**clip, "scale": scale}, quality=quality)


async def write_thumbnails(chromium: str, server: "cb.ComfyServer", tmp: Path, width=2000, height=1300, scale=0.8,
                           quality=85):
    page = await cb.Page.open(chromium, tmp / "profile", width, height)
    try:
        await cb.open_comfy(page, server)
        for path in cb.workflows():
            wf = json.loads(path.read_text(encoding="utf-8"))
            data = await thumbnail(page, wf, path.name, scale, quality)
            out = path.with_suffix(".jpg")
            out.write_bytes(data)
            print(f"{out.relative_to(ROOT)}: {len(data) // 1024} KB")
            await cb.open_comfy(page, server)  # a fresh page: the hiding style is gone
    finally:
        await page.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    chromium, comfy = cb.find_chromium(), cb.comfy_checkout()
    if chromium is None or comfy is None:
        print("needs Chromium on PATH and COMFYUI_PATH set to a ComfyUI checkout", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sage-rdna4-thumbs-") as tmp:
        with cb.ComfyServer(comfy, Path(tmp) / "base") as server:
            asyncio.run(write_thumbnails(chromium, server, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
