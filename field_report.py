"""The field report: run it in the Python ComfyUI uses, with no arguments, and send the two files it writes.

    python custom_nodes/<this folder>/field_report.py [--out FOLDER]

It checks and times this pack's attention kernels on your GPU (5-15 minutes; under a minute on the CPU) and
writes a JSON file and a Markdown summary (docs/RDNA4-TESTING.md). It installs nothing and does not start or
import ComfyUI: it loads this folder's `kernels` package by path, without running the folder's __init__.py
(which registers the nodes), and never puts the folder on sys.path (`kernels` is also a PyPI package's name).
"""
import importlib
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == HERE:
    sys.path.pop(0)

PACK = "comfyui_sage_rdna4"


def field_report_module():
    """kernels/field_report.py, imported as part of the package `comfyui_sage_rdna4` made from this folder without
    executing its __init__.py (node registration is ComfyUI's business, not the report's)."""
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, os.path.join(HERE, "__init__.py"),
                                                      submodule_search_locations=[HERE])
        sys.modules[PACK] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{PACK}.kernels.field_report")


if __name__ == "__main__":
    sys.exit(field_report_module().main())
