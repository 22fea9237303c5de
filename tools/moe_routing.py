"""Why a mixture-of-experts family's latent PSNR is low: HiDream's expert routing, with and without attention's error.

    COMFYUI_PATH=/path/to/ComfyUI python3 tools/moe_routing.py [--side 16] [--steps 2] [--tiny] [--smooth-v]

HiDream (tests/comfy_harness.py, real width and heads, depth cut as in the model table, random weights, fp32 on the
CPU, a small latent of --side x --side) is sampled with exact attention, then with the spec of each P.V precision
(`reference_attention`, FP8 and FP16 P.V) and with exact attention rounded to bf16 (q, k, v and the output). For each:
the latent PSNR against exact attention, the per-call rel L1 of the attention output, how many token-gate expert
choices (top-k sets of every MoEGate call) differ from the exact run's, and the PSNR again with every gate's choice
replayed from the exact run (the weights still from the run's own scores). A run whose PSNR rises far with the
routing replayed loses it to routing flips, not to the attention error itself.
Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from pack_loader import load_harness, load_pack


class Routing:
    """Replaces MoEGate.forward: records each call's expert choice, or replays the recorded ones."""

    def __init__(self, gate_cls):
        self.mode, self.recorded, self.seen, self._i = "record", [], [], 0
        routing = self

        def forward(gate, hidden_states):
            import comfy.model_management

            h = hidden_states.shape[-1]
            flat = hidden_states.view(-1, h)
            weight = comfy.model_management.cast_to(gate.weight, dtype=flat.dtype, device=flat.device)
            scores = F.linear(flat, weight, None).softmax(dim=-1)
            top_w, top_i = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
            if routing.mode == "replay":
                top_i = routing.recorded[routing._i]
                routing._i += 1
                top_w = scores.gather(-1, top_i)
            elif routing.mode == "record":
                routing.recorded.append(top_i.clone())
            else:
                routing.seen.append(top_i.clone())
            return top_i, top_w, None
        gate_cls.forward = forward

    def start(self, mode: str) -> None:
        self.mode, self.seen, self._i = mode, [], 0

    def flips(self) -> int:
        """Token-gate choices (sets of experts) of the last free run that differ from the recorded exact run's."""
        pairs = zip(self.recorded, self.seen)
        return sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=16, help="latent side (the real one is 128: too slow on a CPU)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the tiny HiDream of the CPU tests")
    ap.add_argument("--smooth-v", action="store_true", help="one more run: the FP8 P.V spec with smooth_v")
    args = ap.parse_args()
    harness = load_harness()
    load_pack()
    harness.comfy_import(cpu=True)
    import comfy.ldm.hidream.model as hidream

    from comfyui_sage_rdna4.kernels import metrics
    from comfyui_sage_rdna4.kernels.registry import get_backend
    from comfyui_sage_rdna4.sage_patch import ab_benchmark as ab
    from comfyui_sage_rdna4.sage_patch.config import PatchConfig
    from comfyui_sage_rdna4.sage_patch.install import OVERRIDE_KEY, patch_model
    from comfyui_sage_rdna4.sage_patch.stats import PatchStats

    routing = Routing(hidream.MoEGate)
    family = harness.FAMILIES["hidream"]
    model = harness.build_model(family.config_class, family.config(args.tiny), torch.float32, seed=0)
    harness.randomize_weight_buffers(model)
    positive, negative, latent, cfg = family.inputs(args.tiny)
    shape = latent["samples"].shape
    latent = {"samples": torch.zeros(*shape[:-2], args.side, args.side)}
    rel_l1 = []

    def sample(config=None, attention=None):
        """One sampling run: patched with `config` (None: the call site's own attention), its calls handed to
        `attention(func, *args, **kwargs)` if given."""
        baseline = config is None
        patched, override = patch_model(model, config or PatchConfig(kernel="sdpa"), PatchStats("moe_routing"),
                                        baseline=baseline)
        if attention is not None:
            class Attention:  # an override object (ModelPatcher deep-copies model_options)
                def __deepcopy__(self, memo):
                    return self

                def __call__(self, func, *a, **kw):
                    return attention(func, *a, **kw)
            patched.model_options["transformer_options"][OVERRIDE_KEY] = Attention()
        return ab._sample(patched, latent, 0, args.steps, cfg, "euler", "simple", positive, negative, None)

    reference = get_backend("reference")
    shipped_launch = reference.launch

    def measured_launch(q, k, v, call, sm_scale, attn_mask):
        """The reference backend's own launch, each call's rel L1 against exact attention kept."""
        out = shipped_launch(q, k, v, call, sm_scale, attn_mask)
        exact = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=call.is_causal, scale=sm_scale)
        rel_l1.append(metrics.rel_l1(out[0], exact))
        return out

    def bf16(func, *a, **kw):
        r = lambda t: t.to(torch.bfloat16).to(t.dtype)  # noqa: E731
        a = tuple(r(t) for t in a[:3]) + tuple(a[3:])
        kw = {n: (r(t) if n in ("q", "k", "v") else t) for n, t in kw.items()}
        return r(func(*a, **kw))

    routing.start("record")
    exact = sample()
    runs = [("FP8 P.V spec", "fp8", None, False), ("FP16 P.V spec", "fp16", None, False),
            ("exact, bf16-rounded", None, bf16, False)] + ([("FP8 P.V spec, smooth_v", "fp8", None, True)]
                                                             if args.smooth_v else [])
    for label, pv, attention, smooth_v in runs:
        if pv is not None:
            reference.pv, reference.launch = pv, measured_launch
        config = PatchConfig(kernel="reference", smooth_v=smooth_v) if pv is not None else None
        try:
            rel_l1.clear()
            routing.start("free")
            free = sample(config, attention)
            flips, calls = routing.flips(), list(rel_l1)
            routing.start("replay")
            replayed = sample(config, attention)
        finally:
            reference.pv, reference.launch = type(reference).pv, shipped_launch
        print(json.dumps({"run": label, "latent_psnr_db": round(float(ab.fidelity(exact, free)["latent_psnr_db"]), 2),
                          "routing_replayed_psnr_db":
                              round(float(ab.fidelity(exact, replayed)["latent_psnr_db"]), 2),
                          "routing_flips": flips, "gate_tokens": sum(int(t.shape[0]) for t in routing.recorded),
                          "rel_l1_per_call": [round(x, 5) for x in calls]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
