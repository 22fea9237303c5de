"""`reference`: the numerical spec as a backend (any device, any dtype, any head_dim; slow)."""
from ..reference import reference_attention
from ..registry import Backend

FLOAT_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32")


class ReferenceBackend(Backend):
    name = "reference"
    description = "torch reference of the quantized algorithm (INT8 Q.K, FP8 P.V); the spec, not a speed path"
    pv = "fp8"  # P.V precision of the spec it runs: FP8 as triton_int8_fp8 (a tool may set "fp16" to compare)

    def _unavailable(self, device_type, index):
        return None

    def refuse(self, call):
        if str(call.dtype) not in FLOAT_DTYPES:
            return f"dtype {call.dtype} is not fp16, bf16 or fp32"
        return None

    def launch(self, q, k, v, call, sm_scale, attn_mask):
        return reference_attention(q, k, v, is_causal=call.is_causal, sm_scale=sm_scale, smooth_k=call.smooth_k,
                                   pv=self.pv, qk_group=call.qk_group, attn_mask=attn_mask,
                                   return_lse=call.return_lse, smooth_v=call.smooth_v)
