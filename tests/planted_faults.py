"""Faults planted into a backend's `launch(q, k, v, call, sm_scale, attn_mask) -> (out, lse)`: what the self-check
(tests/test_self_check.py on the reference, tests/test_triton_interpret.py on the Triton kernel) and the fuzz
(tests/test_fuzz.py) must each catch. Every wrapper leaves calls it does not concern untouched."""
import dataclasses
import math

import torch


def scaled(factor):
    def wrap(launch):
        def faulty(q, k, v, call, sm_scale, mask):
            out, lse = launch(q, k, v, call, sm_scale, mask)
            return (out.double() * factor).to(out.dtype), lse
        return faulty
    return wrap


def lse_shifted(launch, by=0.05):
    def faulty(q, k, v, call, sm_scale, mask):
        out, lse = launch(q, k, v, call, sm_scale, mask)
        return out, None if lse is None else lse + by
    return faulty


def default_scale(launch):
    """sm_scale ignored: always 1/sqrt(D)."""
    def faulty(q, k, v, call, sm_scale, mask):
        return launch(q, k, v, call, 1.0 / math.sqrt(q.shape[-1]), mask)
    return faulty


def last_key_dropped(launch):
    def faulty(q, k, v, call, sm_scale, mask):
        if k.shape[2] < 2:
            return launch(q, k, v, call, sm_scale, mask)
        if mask is not None and mask.shape[-1] == k.shape[2]:
            mask = mask[..., :-1]
        return launch(q, k[..., :-1, :], v[..., :-1, :], dataclasses.replace(call, kv_len=call.kv_len - 1), sm_scale,
                      mask)
    return faulty


def first_key_dropped(launch):
    """The call made without key 0 (in a causal call each row then also sees one key more)."""
    def faulty(q, k, v, call, sm_scale, mask):
        if k.shape[2] < 2:
            return launch(q, k, v, call, sm_scale, mask)
        if mask is not None and mask.shape[-1] == k.shape[2]:
            mask = mask[..., 1:]
        return launch(q, k[..., 1:, :], v[..., 1:, :], dataclasses.replace(call, kv_len=call.kv_len - 1), sm_scale,
                      mask)
    return faulty


def causal_shifted(by):
    """Causal with the diagonal one key off, made of causal calls (no mask: the Triton kernels take none): by +1,
    query i also sees key i + 1 (the call made with one query row more in front); by -1, query i misses key i (row i
    gets row i - 1's result of the call without query 0; row 0, which sees no key, zeros)."""
    assert by in (1, -1)

    def wrap(launch):
        def faulty(q, k, v, call, sm_scale, mask):
            if not call.is_causal:
                return launch(q, k, v, call, sm_scale, mask)
            if by > 0:
                q2 = torch.cat([q[:, :, :1], q], dim=2)
                out, lse = launch(q2, k, v, dataclasses.replace(call, q_len=call.q_len + 1), sm_scale, mask)
                return out[:, :, 1:].contiguous(), None if lse is None else lse[:, :, 1:].contiguous()
            out, lse = launch(q[:, :, 1:].contiguous(), k, v, dataclasses.replace(call, q_len=call.q_len - 1),
                              sm_scale, mask)
            out = torch.cat([torch.zeros_like(out[:, :, :1]), out], dim=2)
            if lse is not None:
                lse = torch.cat([torch.full_like(lse[:, :, :1], -math.inf), lse], dim=2)
            return out, lse
        return faulty
    return wrap


LAUNCH_FAULTS = {
    "output x1.01": scaled(1.01),
    "output x0.97": scaled(0.97),
    "LSE + 0.05": lse_shifted,
    "sm_scale ignored": default_scale,
    "last key dropped": last_key_dropped,
    "first key dropped": first_key_dropped,
    "causal one key late": causal_shifted(1),
    "causal one key early": causal_shifted(-1),
}
