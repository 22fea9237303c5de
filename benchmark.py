"""Main job: benchmark and self-check every attention backend against SDPA on this machine.

    python benchmark.py [--device cuda] [--shapes flux_1mp,wan_480p] [--json results.json]

Loads this folder as a package by path (as ComfyUI does) without putting it on sys.path, because
our `kernels` subpackage shares its name with a PyPI package.
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == HERE:
    sys.path.pop(0)

PACK = "comfyui_sage_rdna4"


def load_pack():
    """Import this folder as the package `comfyui_sage_rdna4` (once), as ComfyUI imports a custom node."""
    if PACK in sys.modules:
        return sys.modules[PACK]
    spec = importlib.util.spec_from_file_location(PACK, os.path.join(HERE, "__init__.py"),
                                                  submodule_search_locations=[HERE])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    load_pack()
    from comfyui_sage_rdna4.kernels.benchmark import main  # noqa: E402

    sys.exit(main())
