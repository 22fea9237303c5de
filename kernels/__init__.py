"""Quantized attention with one Python API. Never imports ComfyUI.

backends/ holds every backend (listed and registered lazily in backends/__init__.py); verify/ holds what only
tests and developers run, and nothing a user's run imports reaches it."""
from .api import sage_attention  # noqa: F401
from .registry import BACKEND_NAMES, KernelRefused, available_backends  # noqa: F401

# The function shadows its module's name on the package; reach the module by its full name
# (`from kernels.self_check import run_self_check`, or importlib.import_module) for the rest of its API.
from .self_check import self_check  # noqa: F401
