"""Split launches on a GPU: the Triton backend, and the HIP backend through the gfx12 emulation
(SAGE_RDNA4_HIP_EMULATE=1, NVIDIA), give bit-identical outputs and LSE with a small work bound (several launches)
and without one (one launch). The plan's CPU tests: tests/test_split_launches.py; the cost at Wan 720p:
tools/split_cost.py."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels import launch_split as ls
from comfyui_sage_rdna4.kernels import settings
from comfyui_sage_rdna4.kernels.call_spec import describe_call

pytestmark = pytest.mark.gpu

CASES = [  # b, hq, hkv, nq, nk, d, causal, bound in units of one head's work
    pytest.param(1, 2, 1, 1000, 700, 128, False, 1e-9, id="rows"),
    pytest.param(2, 8, 2, 600, 600, 64, True, 4.0, id="head-groups-causal"),
    pytest.param(3, 4, 4, 333, 500, 128, False, 9.0, id="batches"),
    pytest.param(1, 6, 3, 300, 300, 64, True, 1.0, id="single-heads-causal"),
]


def _device():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch.device("cuda", torch.cuda.current_device())


def _inputs(b, hq, hkv, nq, nk, d, dev):
    g = torch.Generator(device="cpu").manual_seed(11)
    q = torch.randn(b, nq, hq, d, generator=g)
    k = torch.randn(b, nk, hkv, d, generator=g) + 2.0 * torch.randn(1, 1, hkv, d, generator=g)
    v = torch.randn(b, nk, hkv, d, generator=g)
    return [t.to(dev, torch.bfloat16).transpose(1, 2) for t in (q, k, v)]  # HND views of NHD buffers


def _split_vs_one(backend, count, case, pv):
    b, hq, hkv, nq, nk, d, causal, units = case
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, _device())
    call = describe_call(q, k, v, is_causal=causal, return_lse=True)
    head = ls.call_work(ls.visible_keys(0, nq, nk, causal), d, d, pv)
    runs = []
    for bound in (float("inf"), units * head):
        count.clear()
        with ls.work_bound_override(bound):
            out, lse = backend.launch(q, k, v, call, 1 / math.sqrt(d), None)
        torch.cuda.synchronize()
        runs.append((out.clone(), lse.clone(), sum(count)))
    (one, one_lse, n_one), (split, split_lse, n_split) = runs
    assert n_one == 1 and n_split > 1, (n_one, n_split)
    assert torch.isfinite(one.float()).all() and float(one.float().abs().sum()) > 0
    assert torch.equal(one, split), float((one.float() - split.float()).abs().max())
    assert torch.equal(one_lse, split_lse)
    return n_split


def test_own_bound_from_this_device():
    """The bound read from this GPU's properties: its arch's rate, its SM count, a clock (reported or the
    assumed 2.0 GHz) within what GPUs run at, and the arch call_spec names."""
    from comfyui_sage_rdna4.kernels.call_spec import device_arch
    dev = _device()
    bound = ls.device_bound(dev)
    props = torch.cuda.get_device_properties(dev)
    print(f"\n[split] {props.name}: {bound} -> {bound.work:.4g} per launch")
    assert bound.arch == device_arch("cuda", dev.index)
    assert bound.ops_per_clock == ls.ops_per_clock(bound.arch) and bound.cus == props.multi_processor_count
    assert 0.5e9 <= bound.clock_hz <= 4.0e9
    assert ls.work_bound(dev) == bound.work


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("case", [c.values for c in CASES], ids=[c.id for c in CASES])
def test_triton_split_bit_identical(monkeypatch, pv, case):
    pytest.importorskip("triton")
    from comfyui_sage_rdna4.kernels.backends.triton import attention
    from comfyui_sage_rdna4.kernels.backends.triton.backend import make_backend
    backend = make_backend(pv)
    reason = backend.unavailable("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "no GPU"
    if reason:
        pytest.skip(reason)
    count = []
    real = attention.attention_from_quantized_triton
    monkeypatch.setattr(attention, "attention_from_quantized_triton",
                        lambda *a, **kw: count.append(1) or real(*a, **kw))
    print(f"\n[split] triton {pv} {case}: {_split_vs_one(backend, count, case, pv)} launches, bit-identical")


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("case", [c.values for c in CASES], ids=[c.id for c in CASES])
def test_hip_emulated_split_bit_identical(monkeypatch, pv, case):
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
    from comfyui_sage_rdna4.kernels.verify import cuda_twin  # noqa: F401 - registers the loader's CUDA platform
    backend = hip_backend.make_backend(pv)
    reason = backend.unavailable("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "no GPU"
    if reason:
        pytest.skip(reason)
    count = []
    real = hip_backend.run_launches

    def counting(index, bundle, launches, *a, **kw):
        count.extend(1 for ln in launches if ln.kernel.startswith("sage_attn_"))
        return real(index, bundle, launches, *a, **kw)
    monkeypatch.setattr(hip_backend, "run_launches", counting)
    print(f"\n[split] hip emulated {pv} {case}: {_split_vs_one(backend, count, case, pv)} launches, bit-identical")
