"""The patch inside torch.compile (sage_patch/compiled_call.py, kernels/traced_api.py), on the CPU.

A tiny model that calls attention as ComfyUI's wrap_attn does is patched and compiled with fullgraph=True (dynamo
fails on any graph break): its outputs are the eager model's bit for bit, dynamo counts no graph break, and the
stats count the same calls, fallbacks and policies as the eager run. `backend="eager"` and `"aot_eager"` keep
these in seconds; inductor runs in the slow set.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from comfyui_sage_rdna4.kernels import decisions, registry, sage_attention, step_trials
from comfyui_sage_rdna4.kernels import tuner as tuner_mod
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride, install
from fakes import FakeBackend, FakePatcher, ScriptedEvents, comfy_attention

HEADS = 2


def plain_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """A call site's own attention as dynamo traces ComfyUI's (fakes.comfy_attention counts its calls on the
    function object, which dynamo cannot trace)."""
    b = q.shape[0]
    q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[-1])


class Block(torch.nn.Module):
    """One self-attention block calling attention the way ComfyUI's wrap_attn does, `extra` its other keywords."""

    def __init__(self, width=64, mask=None, site=comfy_attention, **extra):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.mask, self.site, self.extra = mask, site, extra

    def forward(self, x, to, block_index=0):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        to = dict(to, block_index=block_index, total_blocks=4)
        override = to.get("optimized_attention_override")
        if override is None:
            return self.site(q, k, v, HEADS, mask=self.mask, _inside_attn_wrapper=True, **self.extra)
        return override(self.site, q, k, v, HEADS, mask=self.mask, transformer_options=to,
                        _inside_attn_wrapper=True, **self.extra)


class Model(torch.nn.Module):
    def __init__(self, blocks=4, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(**kw) for _ in range(blocks))

    def forward(self, x, to):
        for i, block in enumerate(self.blocks):
            x = x + block(x, to, block_index=i)
        return x


def patched(config):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(install, "override_hook_missing", lambda: None)  # no ComfyUI here
        model, override = install.patch_model(FakePatcher(), config)
    return model.model_options["transformer_options"], override


def run(model, to, x, backend=None):
    """The model's output, eager (backend None) or compiled with fullgraph=True, and dynamo's graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    fn = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = fn(x, to)
    return out, dict(counters["graph_break"])


def counted(override):
    snap = override.stats.snapshot()
    override.stats.reset()
    return {key: snap[key] for key in ("calls", "fallbacks", "routed", "passed_over")}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("config", [
    PatchConfig(kernel="reference"),
    PatchConfig(kernel="auto"),                                     # nothing quantized on the CPU: counted fallbacks
    PatchConfig(kernel="hip_int8_fp8"),                             # cannot run here: fallbacks with the reason
    PatchConfig(kernel="reference", exact_blocks="1, last 1"),      # a policy read from transformer_options
    PatchConfig(kernel="reference", min_seq_len=100),               # every call too short: routed exact
], ids=["reference", "auto", "hip-refused", "block-policy", "short-calls"])
def test_a_compiled_model_matches_the_eager_one_with_no_graph_break(backend, config):
    to, override = patched(config)
    model, x = Model(), torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    want, _ = run(model, to, x)
    eager = counted(override)
    got, breaks = run(model, to, x, backend)
    assert breaks == {}
    assert torch.equal(got, want)
    assert counted(override) == eager and sum(eager["calls"].values()) + sum(eager["fallbacks"].values()) + \
        sum(eager["routed"].values()) == 4


def schedule(steps: int, step: int) -> dict:
    """transformer_options as a sampler fills them at `step` of a `steps`-step schedule."""
    sched = torch.linspace(1.0, 0.0, steps + 1)
    return {"sigmas": sched[step:step + 1].clone(), "sample_sigmas": sched}


def test_a_compiled_model_is_not_recompiled_when_the_number_of_steps_changes():
    """Without a step policy the schedule does not cross the op, so a user who changes the step count keeps the
    compiled graph (a tensor of another length would fail dynamo's shape guard and recompile the model)."""
    from torch._dynamo.testing import CompileCounter

    to, override = patched(PatchConfig(kernel="reference"))
    model, x = Model(), torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    frames = CompileCounter()
    fn = torch.compile(model, backend=frames, fullgraph=True)
    with torch.no_grad():
        for steps in (4, 9, 20):
            fn(x, dict(to, **schedule(steps, 1)))
    assert frames.frame_count == 1
    assert counted(override)["calls"] == {"reference": 12}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_step_policy_follows_the_schedule_inside_a_compiled_model(backend):
    """With a step range the sigmas do cross: the compiled model routes the early steps exact and quantizes the
    late ones, as the eager model does."""
    to, override = patched(PatchConfig(kernel="reference", step_start=0.5))
    model, x = Model(), torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    per_step = {}
    for compiled in (False, True):
        fn = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        torch._dynamo.reset()
        outs = []
        with torch.no_grad():
            for step in (0, 3):
                outs.append(fn(x, dict(to, **schedule(4, step))))
        per_step[compiled] = (outs, counted(override))
    (want, eager), (got, stats) = per_step[False], per_step[True]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stats == eager and eager["calls"] == {"reference": 4} and sum(eager["routed"].values()) == 4


@pytest.mark.parametrize("kw", [
    dict(mask=torch.zeros(1, 40, 40)),                  # a float mask: a refusal counted as in eager
    dict(scale=0.3),
    dict(attn_precision=torch.float32),
    dict(low_precision_attention=False),                # Wan's image cross attention: passed on, counted
], ids=["mask", "scale", "attn_precision", "low_precision_off"])
def test_the_keywords_the_op_carries_reach_the_override(kw):
    to, override = patched(PatchConfig(kernel="reference"))
    model, x = Model(**kw), torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(2))
    want, _ = run(model, to, x)
    eager = counted(override)
    got, breaks = run(model, to, x, "aot_eager")
    assert breaks == {} and torch.equal(got, want) and counted(override) == eager


def test_a_keyword_the_op_cannot_carry_runs_the_call_sites_attention_in_the_graph():
    to, override = patched(PatchConfig(kernel="reference"))
    model = Model(site=plain_attention, another_packs_flag=True)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(3))
    want, _ = run(Model(site=plain_attention), {}, x)  # the unpatched model
    got, breaks = run(model, to, x, "aot_eager")
    assert breaks == {} and torch.allclose(got, want, atol=1e-5)
    assert counted(override)["calls"] == {}  # not ours under compile: nothing ran our kernel


def test_the_op_takes_the_hnd_layout_and_grouped_heads():
    def site(q, k, v, heads, **kw):
        return comfy_attention(q, k, v, heads, **kw)
    globals()["site"] = site  # a module-level attention, as ComfyUI's are (found again by name at run time)
    to, override = patched(PatchConfig(kernel="reference"))
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 33, 16, generator=g), torch.randn(1, 2, 47, 16, generator=g), \
        torch.randn(1, 2, 47, 24, generator=g)

    def f(q, k, v):  # heads by keyword, as Wan passes it
        return override(site, q, k, v, heads=4, skip_reshape=True, skip_output_reshape=True, enable_gqa=True,
                        transformer_options=to, _inside_attn_wrapper=True)
    eager = f(q, k, v)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert dict(counters["graph_break"]) == {} and compiled.shape == eager.shape == (1, 4, 33, 24)
    assert torch.equal(compiled, eager)
    assert override.stats.snapshot()["calls"] == {"reference": 2}  # the compiled call ran ours, as the eager one


def test_the_graph_reshapes_the_ops_hnd_output_as_the_unpatched_graph_does():
    """The op returns (b, h, n, d) and the reshape to the call site's (b, n, h*d) is the graph's own, where inductor
    can fuse it into its reader, as after SDPA in the unpatched graph; a call site's attention that ignores
    skip_output_reshape still gives the call site's shape."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm
    for config, site in ((PatchConfig(kernel="reference"), comfy_attention), (PatchConfig(kernel="sdpa"),
                                                                               plain_attention)):
        to, override = patched(config)
        model, x = Model(site=site), torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(5))
        want, _ = run(model, to, x)
        graphs.clear()
        got, breaks = run(model, to, x, keep_graph)
        assert breaks == {} and got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
        ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "sage_rdna4" in str(n.target)]
        assert len(ops) == 4
        for node in ops:
            assert tuple(node.meta["example_value"].shape) == (2, HEADS, 40, 64 // HEADS)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_the_public_api_inside_a_compiled_function(return_lse, layout):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, 50, 32, generator=g) for _ in range(3))
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def f(q, k, v):
        return sage_attention(q, k, v, tensor_layout=layout, kernel="reference", return_lse=return_lse,
                              sm_scale=0.2)
    eager = f(q, k, v)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert dict(counters["graph_break"]) == {}
    for a, b in zip(compiled if return_lse else [compiled], eager if return_lse else [eager]):
        assert a.shape == b.shape and torch.equal(a, b)


def test_auto_measures_in_the_step_inside_a_compiled_model(monkeypatch):
    """auto's trial and watch run in the op's body: a compiled model decides as the eager one does, from its own
    calls in the step (here a scripted clock: the fake fp8 kernel takes half SDPA's time)."""
    events = ScriptedEvents()
    times = {"sdpa": 10.0, "triton_int8_fp8": 5.0}

    def work(name):
        def attention(q, k, v, is_causal=False):
            events.advance(times[name])
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return attention

    fp8 = FakeBackend("triton_int8_fp8", attention=work("triton_int8_fp8"))
    monkeypatch.setitem(registry._REGISTRY, "triton_int8_fp8", fp8)
    monkeypatch.setattr(registry, "auto_order", lambda call: ["triton_int8_fp8", "sdpa"])
    tuner = tuner_mod.Tuner(store=decisions.DecisionStore(enabled=False), enabled=True, require_cuda=False,
                            events=events)
    override = SageAttentionOverride(PatchConfig(kernel="auto"), tuner=tuner)
    to = {"optimized_attention_override": override}

    def site_attention(q, k, v, heads, **kw):
        events.advance(times["sdpa"])
        return comfy_attention(q, k, v, heads, **kw)
    globals()["site_attention"] = site_attention

    class Step(torch.nn.Module):
        def forward(self, x):
            for _ in range(20):
                x = x + override(site_attention, x, x, x, HEADS, transformer_options=to, _inside_attn_wrapper=True)
            return x

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(Step(), backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(6)) * 0.1
    needed = step_trials.SAMPLES + step_trials.WARMUP_CALLS
    for _ in range(2 * needed // 10 + 2):
        with torch.no_grad():
            step(x)
        override.step_boundary()
        if tuner.decisions():
            break
    assert dict(counters["graph_break"]) == {}
    (decision,) = tuner.decisions()
    assert decision.chosen == "triton_int8_fp8" and decision.ratio("triton_int8_fp8") == pytest.approx(0.5)
    fp8_runs = fp8.runs
    with torch.no_grad():
        step(x)
    assert fp8.runs >= fp8_runs + 19  # decided: the kernel serves the calls (the watch times a few pairs)


@pytest.mark.slow
def test_inductor_compiles_a_patched_model_with_no_graph_break():
    to, override = patched(PatchConfig(kernel="reference"))
    model, x = Model(blocks=2), torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(7))
    want, _ = run(model, to, x)
    eager = counted(override)
    got, breaks = run(model, to, x, "inductor")
    assert breaks == {} and torch.allclose(got, want, atol=1e-5, rtol=1e-5) and counted(override) == eager


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton_int8_fp8", "auto"])
def test_inductor_never_sees_our_triton_kernels_on_a_gpu(kernel):
    """Inductor with fullgraph=True around the public API on a GPU: our Triton kernels run inside the op's body (its
    prologue's Python float arguments never typed by inductor: the 'fp64' failure of a traced prologue), bit for
    bit what the eager call gives, and no graph break."""
    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def f(q, k, v):
        return sage_attention(q, k, v, kernel=kernel, sm_scale=0.07) * 2.0

    eager = f(q, k, v)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="inductor", fullgraph=True)(q, k, v)
    assert dict(counters["graph_break"]) == {}
    assert torch.equal(compiled, eager)


class PaddedPromptModel(torch.nn.Module):
    """Builds one prompt-padding mask per evaluation and hands it to every block, as HunyuanVideo does."""

    def __init__(self, blocks=4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x, to):
        n = x.shape[1]
        mask = torch.zeros(1, 1, n, dtype=x.dtype, device=x.device)
        mask[..., n - 8:] = -torch.finfo(x.dtype).max
        for i, block in enumerate(self.blocks):
            block.mask = mask
            x = x + block(x, to, block_index=i)
        return x


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_padding_mask_is_cut_inside_a_compiled_model_as_in_eager(backend):
    """The op's body runs the override eagerly, and the graph hands every block's op the same mask object: from
    its second call the padding is cut from K and V as in the eager run (kernels/padding_masks.py), with the same
    output and counts, and no graph break."""
    to, override = patched(PatchConfig(kernel="reference"))
    model, x = PaddedPromptModel(), torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    want, _ = run(model, to, x)
    eager = override.stats.snapshot()["cuts"]
    assert eager == {"padding mask: keys 40 -> 32, mask dropped": 3}
    override.step_boundary()  # the evaluation's end: its mask is forgotten
    override.stats.reset()
    got, breaks = run(model, to, x, backend)
    assert breaks == {} and override.stats.snapshot()["cuts"] == eager
    assert torch.equal(got, want) if backend == "aot_eager" else torch.allclose(got, want, atol=1e-5, rtol=1e-5)
