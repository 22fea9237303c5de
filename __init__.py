"""ComfyUI entry point: registers the nodes and the web extension, nothing else.

Imported outside ComfyUI (tests, the benchmark), the kernels and sage_patch layers still load;
only node registration needs ComfyUI's `comfy_api`.
"""
import importlib.util

# The one registration of the frontend extension (web/sage_rdna4.js): pyproject.toml has no [tool.comfy] web,
# which ComfyUI would register a second time under another name.
WEB_DIRECTORY = "./web"

if importlib.util.find_spec("comfy_api") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, comfy_entrypoint  # noqa: F401
else:
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
