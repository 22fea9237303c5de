"""Quantized attention with one Python API. Never imports ComfyUI."""
from .api import sage_attention  # noqa: F401
from .registry import BACKEND_NAMES, KernelRefused, available_backends  # noqa: F401
