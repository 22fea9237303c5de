"""ComfyUI <-> kernels bridge: the attention override, layouts, policies, stats."""
from .config import PatchConfig  # noqa: F401
from .layouts import bind_attention_args  # noqa: F401
from .override import SageAttentionOverride  # noqa: F401
from .stats import PatchStats  # noqa: F401
