"""Registers every backend by name; each module is imported only when its backend is first asked for."""
import importlib

from ..registry import register_lazy


def _lazy(module: str, factory: str, *args):
    def load():
        mod = importlib.import_module(module, __package__)
        return getattr(mod, factory)(*args)
    return load


register_lazy("reference", _lazy(".reference", "ReferenceBackend"))
register_lazy("sdpa", _lazy(".sdpa", "SdpaBackend"))
register_lazy("comfy_kitchen", _lazy(".peers", "ComfyKitchenBackend"), packages=("comfy_kitchen",))
register_lazy("sageattention", _lazy(".peers", "SageAttentionBackend"), packages=("sageattention",))
register_lazy("triton_int8_fp8", _lazy(".triton.backend", "make_backend", "fp8"), packages=("triton",))
register_lazy("triton_int8_fp16", _lazy(".triton.backend", "make_backend", "fp16"), packages=("triton",))
register_lazy("hip_int8_fp8", _lazy(".hip.backend", "make_backend", "fp8"))
register_lazy("hip_int8_fp16", _lazy(".hip.backend", "make_backend", "fp16"))
