"""The repo as package `comfyui_sage_rdna4` for the tools here, through benchmark.py's loader (loaded by path).

Tools run as scripts (`python tools/NAME.py`), so this folder is first on sys.path and `from pack_loader import
load_pack` finds this module."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_pack():
    spec = importlib.util.spec_from_file_location("_sage_rdna4_entry", os.path.join(ROOT, "benchmark.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.load_pack()
