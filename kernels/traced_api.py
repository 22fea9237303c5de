"""The public `sage_attention` inside a torch.compile trace: one opaque custom op, `sage_rdna4::sage_attention`.

Dynamo and inductor never trace the dispatcher (its locks, caches, self-checks, auto's measuring) nor our Triton
kernels: the trace records the op, and at run time its body is the eager `sage_attention`, so a compiled function
gets exactly what an eager call gets. Its fake implementation gives the output's (and the LSE's) shape.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .eager_call import eager_attention
from .opaque_op import op_name, own_output, try_define


def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], tensor_layout: str,
        is_causal: bool, sm_scale: Optional[float], kernel: str, smooth_k: bool, prologue: str, return_lse: bool,
        qk_group: str, smooth_v: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    got = eager_attention(q, k, v, tensor_layout, is_causal, sm_scale, kernel, smooth_k, prologue, return_lse,
                          attn_mask, qk_group, smooth_v)
    out, lse = got if return_lse else (got, q.new_empty(0, dtype=torch.float32))
    return own_output(out, (q, k, v)), lse.contiguous()


def _fake(q, k, v, attn_mask, tensor_layout, is_causal, sm_scale, kernel, smooth_k, prologue, return_lse, qk_group,
          smooth_v):
    heads_dim = 1 if tensor_layout == "HND" else 2
    b, hq, nq = q.shape[0], q.shape[heads_dim], q.shape[3 - heads_dim]
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


# None (with the reason) where torch could not register it: then the API runs eagerly inside traces.
sage_attention_op, OP_PROBLEM = try_define(op_name("sage_attention", __name__), _op, _fake)
