"""The repo as package `comfyui_sage_rdna4` for the tools here, through benchmark.py's loader (loaded by path).

Tools run as scripts (`python tools/NAME.py`), so this folder is first on sys.path and `from pack_loader import
load_pack` finds this module."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_harness():
    """tests/comfy_harness.py (the ComfyUI model builders the tests share), loaded by path: tests/ is not on
    sys.path when a tool runs."""
    path = os.path.join(ROOT, "tests", "comfy_harness.py")
    spec = importlib.util.spec_from_file_location("sage_rdna4_comfy_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_pack():
    spec = importlib.util.spec_from_file_location("_sage_rdna4_entry", os.path.join(ROOT, "benchmark.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.load_pack()
