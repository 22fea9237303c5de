"""Which attention calls stay exact on purpose: step range, blocks, short calls, cross attention.

Each policy reads what ComfyUI puts in `transformer_options` (sigmas, sample_sigmas, block_index,
total_blocks) and returns the name of the policy that routes the call to exact attention, or None.
A policy whose inputs the model does not provide cannot apply; `inactive_reason` says so once.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .config import PatchConfig, parse_blocks


def step_fraction(transformer_options: dict) -> Optional[float]:
    """Position of the current step in the schedule, 0 at the first step; None when unknown."""
    sigmas = transformer_options.get("sigmas")
    schedule = transformer_options.get("sample_sigmas")
    if sigmas is None or schedule is None or not torch.is_tensor(schedule) or schedule.numel() < 2:
        return None
    current = float(sigmas.flatten()[0])
    sched = schedule.detach().float().cpu()
    hits = torch.nonzero(torch.isclose(sched, torch.tensor(current), rtol=1e-4, atol=0.0)).flatten()
    steps = sched.numel() - 1
    if hits.numel() == 0:
        # Second-order samplers (dpm_2, dpmpp_2s, ...) also evaluate between two schedule sigmas: such a
        # call belongs to the step it is inside (the schedule descends), not to no step at all.
        inside = torch.nonzero((sched[:-1] > current) & (sched[1:] < current)).flatten()
        return float(inside[0]) / steps if inside.numel() else None
    return float(hits[0]) / steps


class CallPolicies:
    def __init__(self, config: PatchConfig):
        self.config = config
        self.block_indices, self.first_n, self.last_n = parse_blocks(config.exact_blocks)
        self.uses_steps = config.step_start > 0.0 or config.step_end < 1.0
        self.uses_blocks = bool(self.block_indices or self.first_n or self.last_n)
        # False: route_exact can only answer (None, None), so the override skips asking on every call.
        self.active = bool(config.min_seq_len or config.cross_attention == "exact" or self.uses_steps
                           or self.uses_blocks)
        self._last_step = None  # (sigmas, sample_sigmas, fraction) of the previous call

    def _step_fraction(self, to: dict) -> Optional[float]:
        """step_fraction, computed once per model call: every attention call of one forward pass carries
        the same sigmas tensor, and reading a GPU tensor's value syncs the device each time."""
        sigmas, schedule = to.get("sigmas"), to.get("sample_sigmas")
        last = self._last_step
        if last is not None and last[0] is sigmas and last[1] is schedule:
            return last[2]
        frac = step_fraction(to)
        self._last_step = (sigmas, schedule, frac)
        return frac

    def route_exact(self, transformer_options: Optional[dict], q_len: int,
                    kv_len: int) -> Tuple[Optional[str], Optional[str]]:
        """(policy that makes this call exact or None, reason a configured policy could not apply or None)."""
        cfg = self.config
        if cfg.min_seq_len and q_len < cfg.min_seq_len:
            return f"short call (< {cfg.min_seq_len} query tokens)", None
        if cfg.cross_attention == "exact" and q_len != kv_len:
            return "cross attention kept exact", None
        to = transformer_options or {}
        inactive = None
        if self.uses_steps:
            frac = self._step_fraction(to)
            if frac is None:
                inactive = "step range cannot apply: ComfyUI passed no sample_sigmas matching the current sigma"
            elif not (cfg.step_start <= frac < cfg.step_end or (cfg.step_end >= 1.0 and frac >= cfg.step_start)):
                return f"outside step range {cfg.step_start:g}-{cfg.step_end:g}", None
        if self.uses_blocks:
            block = to.get("block_index")
            if block is None:
                inactive = inactive or "block policy cannot apply: this model passes no block_index"
            else:
                block = int(block)
                if block in self.block_indices or block < self.first_n:
                    return f"block {block} kept exact", None
                if self.last_n:
                    total = to.get("total_blocks")
                    if total is None:
                        inactive = inactive or "'last N' blocks cannot apply: this model passes no total_blocks"
                    elif block >= int(total) - self.last_n:
                        return f"block {block} kept exact", None
        return None, inactive
