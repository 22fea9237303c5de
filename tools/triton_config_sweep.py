"""H200: time each candidate launch configuration of the Triton attention kernel (triton_h200.SWEEP), kernel
alone against cuDNN SDPA, and its rel L1 against exact FP32 on standard and diffuse + V offset inputs.

    python3 tools/triton_config_sweep.py [--json out.json]

Shapes: Wan 480p (B1 H40 N32760) and Flux 1 MP (B1 H24 N4608), bf16, D128, the main job's input kinds
(kernels/benchmark.py make_inputs); accuracy on 256 sampled query rows.
Figures: docs/MEASUREMENTS.md#triton-launch-configurations
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton_h200 as T  # noqa: E402  (loads the pack)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from comfyui_sage_rdna4.kernels import benchmark as B  # noqa: E402
from comfyui_sage_rdna4.kernels import metrics, reference
from comfyui_sage_rdna4.kernels.backends.triton.attention import attention_from_quantized_triton  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton.prologue import triton_quantize_qkv  # noqa: E402

SHAPES = {"wan_480p": B.Shape("wan_480p", 1, 40, 32760, 128, "bfloat16"),
          "flux_1mp": B.Shape("flux_1mp", 1, 24, 4608, 128, "bfloat16")}


def sweep_shape(name, shape, results):
    dev = torch.device("cuda")
    for kind in ("standard", "diffuse_voffset"):
        q, k, v = B.make_inputs(shape, dev, kind=kind)
        sm = shape.head_dim ** -0.5
        rows = T.sample_rows(shape.seq, 256)
        exact, _ = reference.exact_attention(q[:, :, rows].float(), k.float(), v.float(), sm_scale=sm)
        if kind == "standard":
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                base = T.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=sm), T.REPS[name])
        for pv, cands in T.SWEEP.items():
            qq = {vt: triton_quantize_qkv(q, k, v, sm_scale=sm, pv=pv, v_transposed=vt, pad_k_scale_rows=True)
                  for vt in (False, True)}
            for cfg in cands:
                def run(c=cfg):
                    return attention_from_quantized_triton(qq[c.v_transposed], pv=pv, config=c, out_dtype=q.dtype)[0]
                row = dict(shape=name, kind=kind, pv=pv, config=cfg.__dict__)
                try:
                    row["rel_l1"] = metrics.rel_l1(run()[:, :, rows].float(), exact)
                    if kind == "standard":
                        row["ms"] = T.time_ms(run, T.REPS[name])
                        row["rel_cudnn"] = row["ms"] / base
                except Exception as exc:  # a config that does not compile or spills out is a result too
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)
                results.append(row)
            del qq
        del q, k, v, exact
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    for name, shape in SHAPES.items():
        sweep_shape(name, shape, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
