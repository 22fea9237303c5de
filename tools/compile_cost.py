"""What the patch costs inside torch.compile, on a Flux-like stack of transformer blocks (random weights, no ComfyUI).

    python tools/compile_cost.py [--blocks 8] [--tokens 4608] [--kernels triton_int8_fp8] [--steps 10] [--json PATH]

Each block calls attention the way ComfyUI's wrap_attn does (override(func, q, k, v, heads=...)). For the model's
own attention (SDPA, unpatched) and each kernel named, the stack runs eagerly and compiled with inductor (the
TorchCompileModel way), and prints each median step, dynamo's graph breaks and the figure the issue's target
reads: compiled kernel / compiled own attention against eager kernel / eager own attention (target: at most 1.01
times the eager ratio). Random weights: not a model's output, a timing stand-in. ComfyUI's own sampling (with
its wrappers, CFG, and a real Flux's blocks) is not in it."""
import argparse
import json
import statistics
import time

import torch

from pack_loader import load_pack


def own_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """The call site's own attention, ComfyUI's layout (b, n, heads*d), by SDPA."""
    b = q.shape[0]
    q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[-1])


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x, to):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        override = to.get("optimized_attention_override")
        if override is None:
            a = own_attention(q, k, v, heads=self.heads)
        else:
            a = override(own_attention, q, k, v, heads=self.heads, transformer_options=to, _inside_attn_wrapper=True)
        x = x + self.out(a)
        return x + self.mlp(self.norm2(x))


class Stack(torch.nn.Module):
    def __init__(self, blocks, width, heads):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(blocks))

    def forward(self, x, to):
        for block in self.blocks:
            x = block(x, to)
        return x


def median_step(fn, x, to, steps):
    with torch.no_grad():
        for _ in range(3):
            fn(x, to)
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn(x, to)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kernels", default="triton_int8_fp8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    load_pack()
    from torch._dynamo.utils import counters

    from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride

    torch.manual_seed(0)
    model = Stack(args.blocks, args.width, args.heads).cuda().to(torch.bfloat16)
    x = torch.randn(1, args.tokens, args.width, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for name in ["own"] + [k for k in args.kernels.split(",") if k]:
        to = {} if name == "own" else {"optimized_attention_override": SageAttentionOverride(PatchConfig(kernel=name))}
        eager = median_step(model, x, to, args.steps)
        torch._dynamo.reset()
        counters.clear()
        t0 = time.perf_counter()
        compiled = torch.compile(model, backend="inductor")
        with torch.no_grad():
            compiled(x, to)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        breaks = sum(counters["graph_break"].values())
        comp = median_step(compiled, x, to, args.steps)
        calls = to["optimized_attention_override"].stats.snapshot()["calls"] if to else {}
        rows[name] = {"eager_ms": eager, "compiled_ms": comp, "first_compiled_call_s": compile_s,
                      "graph_breaks": breaks, "calls": calls}
        print(f"{name:18} eager {eager:8.2f} ms  compiled {comp:8.2f} ms  first compiled call {compile_s:6.1f} s  "
              f"graph breaks {breaks}  calls {calls}", flush=True)
    own = rows["own"]
    for name, r in rows.items():
        if name == "own":
            continue
        eager_ratio, compiled_ratio = r["eager_ms"] / own["eager_ms"], r["compiled_ms"] / own["compiled_ms"]
        r.update(eager_ratio=eager_ratio, compiled_ratio=compiled_ratio,
                 target_met=compiled_ratio <= 1.01 * eager_ratio)
        print(f"{name}: eager {eager_ratio:.3f}x own, compiled {compiled_ratio:.3f}x own "
              f"(target <= {1.01 * eager_ratio:.3f}: {'met' if r['target_met'] else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
