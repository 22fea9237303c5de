"""Attention calls cut into launches of bounded work (kernels/launch_split.py), on the CPU.

The plan: every (batch, head, query row) in exactly one piece, each piece within the bound where a cut allows it,
small calls one piece. The outputs: bit-identical to one launch through the host simulator (HIP sources) and
through Triton's interpreter (a child process with TRITON_INTERPRET=1, as tests/test_triton_interpret.py), with a
tiny bound set through `launch_split.work_bound_override`. GPU cases: tests/test_split_launches_gpu.py."""
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comfyui_sage_rdna4.kernels import launch_split as ls

CHILD = os.environ.get("TRITON_INTERPRET", "0") == "1"
SLOW = pytest.mark.slow
WAN_720P = dict(b=1, hq=40, hkv=40, nq=75600, nk=75600, d=128, dv=128)  # Wan 2.x 14B, 81 frames at 1280x720


def piece_work(pc, nk, d, dv, pv, causal):
    rows_keys = ls.visible_keys(pc.n0, pc.n1, nk, causal) * (pc.b1 - pc.b0) * (pc.h1 - pc.h0)
    return ls.call_work(rows_keys, d, dv, pv)


def check_plan(pieces, *, b, hq, hkv, nq, nk, d, dv, pv, causal, bound, row_block):
    """Coverage exactly once, the launchable piece shapes, and the bound wherever the plan could keep it."""
    seen = torch.zeros(b, hq, nq, dtype=torch.int32)
    group = hq // hkv
    for pc in pieces:
        assert 0 <= pc.b0 < pc.b1 <= b and 0 <= pc.h0 < pc.h1 <= hq and 0 <= pc.n0 < pc.n1 <= nq, pc
        seen[pc.b0:pc.b1, pc.h0:pc.h1, pc.n0:pc.n1] += 1
        whole = pc.n0 == 0 and pc.n1 == nq and pc.h0 % group == 0 and pc.h1 % group == 0
        # A piece is whole kv-head groups over all rows (several batches only with all heads), or one head.
        assert whole or pc.h1 - pc.h0 == 1, pc
        assert pc.b1 - pc.b0 == 1 or (pc.h0, pc.h1) == (0, hq), pc
        assert pc.n0 % row_block == 0 and (pc.n1 == nq or pc.n1 % row_block == 0), pc
        if causal:
            assert (pc.n0, pc.n1) == (0, nq), "causal calls are never cut along query rows"
        smallest = ls.call_work(ls.visible_keys(0, nq, nk, causal) if causal else row_block * nk, d, dv, pv)
        if smallest <= bound:
            assert piece_work(pc, nk, d, dv, pv, causal) <= bound, pc
    assert torch.equal(seen, torch.ones_like(seen)), "every (b, h, row) exactly once"


CASES = [  # b, hq, hkv, nq, nk, d, dv, pv, causal, bound in units of one head's work
    (1, 8, 8, 1000, 1000, 64, 64, "fp8", False, 8.0),     # fits: one piece
    (4, 8, 8, 1000, 1000, 64, 64, "fp8", False, 17.0),    # batch ranges
    (3, 24, 8, 1000, 900, 128, 128, "fp16", False, 7.0),  # GQA head groups of 3
    (2, 6, 2, 1000, 1000, 64, 64, "fp8", False, 2.0),     # a group over the bound: single heads
    (2, 4, 4, 1000, 1000, 64, 64, "fp8", False, 0.3),     # rows
    (2, 4, 4, 1000, 1000, 64, 64, "fp8", True, 0.3),      # causal: heads, no rows
    (1, 2, 1, 333, 77, 64, 64, "fp16", False, 1e-9),      # tiny bound: one row block a piece
    (5, 3, 3, 1, 4096, 128, 128, "fp8", False, 1.5),      # one query row
]


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,dv,pv,causal,units", CASES)
def test_plan_covers_once_within_bound(b, hq, hkv, nq, nk, d, dv, pv, causal, units):
    head = ls.call_work(ls.visible_keys(0, nq, nk, causal), d, dv, pv)
    shape = dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv)
    pieces = ls.split_attention(**shape, pv=pv, causal=causal, bound=units * head, row_block=128)
    check_plan(pieces, **shape, pv=pv, causal=causal, bound=units * head, row_block=128)
    assert (len(pieces) == 1) == (b * hq <= units)


def test_small_calls_stay_one_launch():
    """Flux 1 MP (24 heads, 4096+512 tokens, D128) is far below even the smallest card's bound."""
    bound = ls.WORK_PER_CU * 28  # RX 9060: 28 CUs
    assert ls.split_attention(1, 24, 24, 4608, 4608, 128, 128, pv="fp16", causal=False, bound=bound,
                              row_block=128) == [ls.Piece(0, 1, 0, 24, 0, 4608)]


def test_wan_720p_on_an_rx_9060_xt():
    """The call the bound is for: 1.17e14 operations; at RDNA4's per-CU bound (2.0 GHz, 0.25 s), 2 heads a launch
    on 32 CUs (about 5.9e12 each), 8 on 132 (5 launches)."""
    total = ls.call_work(75600 * 75600, 128, 128, "fp8") * 40
    assert 1.1e14 < total < 1.2e14
    bound = ls.WORK_PER_CU * 32
    assert 6.5e12 < bound < 6.6e12
    pieces = ls.split_attention(**WAN_720P, pv="fp8", causal=False, bound=bound, row_block=128)
    check_plan(pieces, **WAN_720P, pv="fp8", causal=False, bound=bound, row_block=128)
    assert len(pieces) == 20 and {pc.h1 - pc.h0 for pc in pieces} == {2}
    pieces = ls.split_attention(**WAN_720P, pv="fp8", causal=False, bound=ls.WORK_PER_CU * 132, row_block=128)
    assert len(pieces) == 5 and {pc.h1 - pc.h0 for pc in pieces} == {8}


def test_fp16_pv_counts_twice_and_causal_counts_visible_keys():
    assert ls.call_work(10, 64, 64, "fp16") == 2 * 10 * (64 + 128)
    assert ls.call_work(10, 64, 64, "fp8") == 2 * 10 * 128
    assert ls.visible_keys(0, 4, 4, True) == 1 + 2 + 3 + 4
    assert ls.visible_keys(2, 6, 3, True) == 3 + 3 + 3 + 3
    assert ls.visible_keys(0, 5, 3, False) == 15


def _fake_device(monkeypatch, *, os_name, hip, **props):
    """torch.cuda as a device with these properties would show it (the bound is read once per device)."""
    asked = []

    def get_props(index):
        asked.append(index)
        return SimpleNamespace(**props)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_props)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(ls, "host_os", lambda: os_name, raising=False)
    monkeypatch.setattr(ls, "_device_bounds", {})
    return asked


# Each card's expected bound, written out from its figures: ops/clk/CU x CUs x clock x 20 % x seconds.
CARD_BOUNDS = [  # id, properties, OS, ROCm, expected bound, Wan 720p FP8 / FP16 launches
    ("H200-linux", dict(major=9, minor=0, multi_processor_count=132, clock_rate=1_980_000), "linux", None,
     8192 * 132 * 1.98e9 * 0.2 * 0.25, 2, 2),
    ("H200-no-clock", dict(major=9, minor=0, multi_processor_count=132, clock_rate=0), "linux", None,
     8192 * 132 * 2.0e9 * 0.2 * 0.25, 2, 2),
    ("A100", dict(major=8, minor=0, multi_processor_count=108, clock_rate=1_410_000), "linux", None,
     4096 * 108 * 1.41e9 * 0.2 * 0.25, 4, 6),
    ("RTX4090-windows", dict(major=8, minor=9, multi_processor_count=128, clock_rate=2_520_000), "windows", None,
     2048 * 128 * 2.52e9 * 0.2 * 0.25, 4, 6),
    ("B200", dict(major=10, minor=0, multi_processor_count=148, clock_rate=1_965_000), "linux", None,
     16384 * 148 * 1.965e9 * 0.2 * 0.25, 1, 1),
    ("RX9060XT-windows", dict(gcnArchName="gfx1200", multi_processor_count=32, clock_rate=3_130_000), "windows",
     "6.4", 2048 * 32 * 3.13e9 * 0.2 * 0.25, 14, 20),
    ("RX9060XT-wsl", dict(gcnArchName="gfx1200", multi_processor_count=32, clock_rate=3_130_000), "wsl", "6.4",
     2048 * 32 * 3.13e9 * 0.2 * 0.25, 14, 20),
    ("RX9060XT-linux", dict(gcnArchName="gfx1200", multi_processor_count=32, clock_rate=3_130_000), "linux", "6.4",
     2048 * 32 * 3.13e9 * 0.2 * 1.0, 3, 5),
    ("RX9070XT-windows", dict(gcnArchName="gfx1201:sramecc-:xnack-", multi_processor_count=64,
                              clock_rate=2_970_000), "windows", "6.4", 2048 * 64 * 2.97e9 * 0.2 * 0.25, 7, 10),
    ("RX9070XT-linux", dict(gcnArchName="gfx1201", multi_processor_count=64, clock_rate=2_970_000), "linux", "6.4",
     2048 * 64 * 2.97e9 * 0.2 * 1.0, 2, 3),
    ("RX7900XTX-windows", dict(gcnArchName="gfx1100", multi_processor_count=96, clock_rate=2_500_000), "windows",
     "6.4", 512 * 96 * 2.5e9 * 0.2 * 0.25, 20, 40),
    ("MI250X-linux", dict(gcnArchName="gfx90a:sramecc+:xnack-", multi_processor_count=220, clock_rate=1_700_000),
     "linux", "6.4", 1024 * 220 * 1.7e9 * 0.2 * 1.0, 2, 3),
]


@pytest.mark.parametrize("props,os_name,hip,expected,fp8_launches,fp16_launches",
                         [c[1:] for c in CARD_BOUNDS], ids=[c[0] for c in CARD_BOUNDS])
def test_bound_from_the_devices_own_rate_clock_and_os(monkeypatch, props, os_name, hip, expected, fp8_launches,
                                                      fp16_launches):
    """The bound is the card's own dense INT8 rate x CUs x reported clock (2.0 GHz where none) x 20 % x 0.25 s,
    1 s on Linux with ROCm only (no watchdog on KFD queues; WSL runs on the Windows driver). Under the rule before
    it, every device got RDNA4's rate at 2.0 GHz: the H200 4x too small a bound (5 and 7 launches at Wan 720p)."""
    asked = _fake_device(monkeypatch, os_name=os_name, hip=hip, **props)
    dev = torch.device("cuda", 1)
    assert ls.work_bound(dev) == pytest.approx(expected, rel=1e-9)
    assert ls.work_bound(dev) == pytest.approx(expected, rel=1e-9) and asked == [1]  # read once per device
    counts = [len(ls.split_attention(**WAN_720P, pv=pv, causal=False, bound=ls.work_bound(dev), row_block=128))
              for pv in ("fp8", "fp16")]
    assert counts == [fp8_launches, fp16_launches]


@pytest.mark.parametrize("arch,ops", [
    ("gfx1200", 2048), ("gfx1201", 2048), ("gfx1100", 512), ("gfx1151", 512), ("gfx90a", 1024),
    ("sm_80", 4096), ("sm_89", 2048), ("sm_90", 8192), ("sm_100", 16384),
    # Not in the table: RDNA4's rate (below each of these where public figures exist, so launches stay short).
    ("gfx942", 2048), ("gfx950", 2048), ("gfx1300", 2048), ("sm_103", 2048), ("sm_120", 2048), ("sm_86", 2048),
    ("", 2048),
])
def test_ops_per_clock_per_arch(arch, ops):
    assert ls.ops_per_clock(arch) == ops


@pytest.mark.parametrize("hip,props", [
    (None, dict(major=9, minor=0, multi_processor_count=132)),
    ("6.4", dict(gcnArchName="gfx1201:sramecc-:xnack-", multi_processor_count=64)),
])
def test_bound_names_the_arch_as_call_spec_does(monkeypatch, hip, props):
    """launch_split reads the arch from the same properties as call_spec.device_arch (whose cache it avoids)."""
    from comfyui_sage_rdna4.kernels import call_spec
    _fake_device(monkeypatch, os_name="linux", hip=hip, **props)
    assert ls.device_bound(torch.device("cuda", 2)).arch == call_spec.device_arch.__wrapped__("cuda", 2)


def test_unknown_device_gets_the_conservative_rate(monkeypatch):
    """An arch the table does not name (a future gfx13 on Windows) is bounded at RDNA4's per-CU rate."""
    _fake_device(monkeypatch, os_name="windows", hip="7.0", gcnArchName="gfx1300", multi_processor_count=40,
                 clock_rate=2_800_000)
    assert ls.work_bound(torch.device("cuda", 0)) == pytest.approx(2048 * 40 * 2.8e9 * 0.2 * 0.25, rel=1e-9)
    bound = ls.device_bound(torch.device("cuda", 0))
    assert (bound.arch, bound.ops_per_clock, bound.cus, bound.seconds, bound.os) == ("gfx1300", 2048, 40, 0.25,
                                                                                     "windows")


@pytest.mark.parametrize("platform_name,release,expected", [
    ("win32", "10", "windows"), ("linux", "5.15.153.1-microsoft-standard-WSL2", "wsl"),
    ("linux", "6.8.0-45-generic", "linux"), ("darwin", "24.0.0", "darwin"),
])
def test_host_os(monkeypatch, platform_name, release, expected):
    import platform
    monkeypatch.setattr(ls.sys, "platform", platform_name)
    monkeypatch.setattr(platform, "release", lambda: release)
    assert ls.host_os() == expected


def test_launch_seconds_per_os():
    assert ls.launch_seconds("linux", rocm=True) == 1.0
    assert ls.launch_seconds("linux", rocm=False) == 0.25  # an NVIDIA GPU driving X has a watchdog
    assert ls.launch_seconds("wsl", rocm=True) == 0.25
    assert ls.launch_seconds("windows", rocm=True) == 0.25


def test_work_bound_off_a_gpu_and_the_seam():
    """Off a GPU: RDNA4's rate at the assumed clock on 32 CUs and the watchdog's 0.25 s (an RX 9060 XT on
    Windows at 2.0 GHz); the verification seam sits above every device."""
    assert ls.WORK_PER_CU == pytest.approx(2048 * 2.0e9 * 0.2 * 0.25, rel=1e-12)
    assert ls.work_bound(torch.device("cpu")) == ls.WORK_PER_CU * ls.DEFAULT_CUS
    assert ls.work_bound(None) == ls.WORK_PER_CU * 32
    with ls.work_bound_override(5.0):
        assert ls.work_bound(torch.device("cpu")) == 5.0
    assert ls.work_bound(torch.device("cpu")) == ls.WORK_PER_CU * ls.DEFAULT_CUS


def test_quantized_piece_views():
    from comfyui_sage_rdna4.kernels import quant
    q, k, v = (torch.randn(2, h, 100, 64) for h in (6, 2, 2))
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125)
    part = ls.quantized_piece(qq, ls.Piece(1, 2, 3, 6, 0, 100), 3)
    assert torch.equal(part.q8, qq.q8[1:2, 3:6]) and torch.equal(part.q_scale, qq.q_scale[1:2, 3:6])
    assert torch.equal(part.k8, qq.k8[1:2, 1:2]) and torch.equal(part.v_scale, qq.v_scale[1:2, 1:2])
    assert torch.equal(part.k_mean, qq.k_mean[1:2, 1:2]) and part.v_mean is None
    row = ls.quantized_piece(qq, ls.Piece(0, 1, 4, 5, 32, 64), 3)
    assert torch.equal(row.q8, qq.q8[0:1, 4:5, 32:64]) and torch.equal(row.k8, qq.k8[0:1, 1:2])


# ------------------------------------------------------------------------------------------ HIP host simulator
def _host_sim():
    from comfyui_sage_rdna4.kernels.verify import host_sim
    if host_sim.host_compiler() is None:
        pytest.skip("no host C++ compiler for the simulator")
    return host_sim


def _hip_split_vs_one(pv, causal, b, hq, hkv, nq, nk, units, dtype=torch.float16):
    from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
    from comfyui_sage_rdna4.kernels.verify import hip_checks
    host_sim = _host_sim()
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, 64, dtype, torch.device("cpu"), layout="nhd")
    sm = 1 / math.sqrt(64)
    qq = hip_checks.prologue(host_sim.run, q, k, v, sm_scale=sm, pv=pv)
    head = ls.call_work(ls.visible_keys(0, nq, nk, causal), 64, 64, pv)
    results = []
    for bound in (None, units * head):
        with ls.work_bound_override(bound):
            out, lse, launches = kernel_abi.attention_plan(qq, pv=pv, is_causal=causal, out_dtype=dtype,
                                                           return_lse=True, q=q, sm_scale=sm)
        host_sim.run(launches)
        results.append((out, lse, len(launches)))
    (one, one_lse, n_one), (split, split_lse, n_split) = results
    assert n_one == 1 and n_split > 1
    assert torch.isfinite(one.float()).all() and float(one.float().abs().sum()) > 0
    assert torch.equal(one, split) and torch.equal(one_lse, split_lse)
    return n_split


def test_hip_split_bit_identical_rows_host_sim():
    """Non-causal, one row block of a GQA head a launch (1 x 2 heads x 2 row blocks: 4 launches)."""
    assert _hip_split_vs_one("fp8", False, 1, 2, 1, 150, 70, 1e-9) == 4


@SLOW
def test_hip_split_bit_identical_heads_causal_host_sim():
    """Causal: batch elements, then one head per launch (2 x 2 = 4)."""
    assert _hip_split_vs_one("fp16", True, 2, 2, 2, 130, 130, 1.0) == 4


@SLOW
def test_hip_split_bit_identical_groups_host_sim():
    """Groups of 2 q heads on one kv head, per batch element: 2 x 2 launches."""
    assert _hip_split_vs_one("fp8", False, 2, 4, 2, 40, 100, 2.0) == 4


# ------------------------------------------------------------------------------------------ Triton interpreter
if not CHILD:
    @pytest.mark.timeout(900)  # the child's own limit below; its tests have theirs (pyproject.toml)
    @pytest.mark.parametrize("child_marks", [pytest.param("not slow", id="quick"),
                                             pytest.param("slow", id="full", marks=SLOW)])
    def test_triton_interpreter_cases_in_child_process(child_marks):
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               str(Path(__file__)), "-x", "-m", child_marks, "-k", "interpreter_split"]
        r = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert " passed" in r.stdout and " failed" not in r.stdout
else:
    @pytest.mark.parametrize("kernel,causal,b,hq,hkv,nq,nk,units,masked", [
        ("triton_int8_fp8", False, 1, 2, 1, 70, 50, 1e-9, False),                           # rows of one head
        pytest.param("triton_int8_fp16", True, 2, 4, 2, 40, 40, 2.0, False, marks=SLOW),    # groups, causal
        pytest.param("triton_int8_fp8", False, 3, 2, 2, 33, 40, 4.0, False, marks=SLOW),    # batch ranges
        ("triton_int8_fp16", False, 2, 4, 2, 33, 70, 2.0, True),  # groups, a key mask per (batch, head)
    ])
    def test_interpreter_split_bit_identical(monkeypatch, kernel, causal, b, hq, hkv, nq, nk, units, masked):
        """Through the backend (NHD inputs, the NHD output view, smooth_k's LSE term): split == one launch."""
        from comfyui_sage_rdna4.kernels.api import sage_attention
        from comfyui_sage_rdna4.kernels.backends.triton import attention
        calls = []
        real = attention.attention_from_quantized_triton
        monkeypatch.setattr(attention, "attention_from_quantized_triton",
                            lambda *a, **kw: calls.append(1) or real(*a, **kw))
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(b, n, h, 64, generator=g).half() for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
        pv = kernel.rsplit("_", 1)[1]
        head = ls.call_work(ls.visible_keys(0, nq, nk, causal), 64, 64, pv)
        mask = None
        if masked:  # each (batch, head) its own padding: a piece must take its own rows of the bias, key end and
            mask = torch.ones(b, hq, 1, nk, dtype=torch.bool)  # plain flag (every other row has a hole: not plain)
            for i in range(b * hq):
                mask.view(b * hq, nk)[i, nk - 5 - 9 * i:] = False
                if i % 2:
                    mask.view(b * hq, nk)[i, 3:6] = False
        runs = []
        for bound in (None, units * head):
            calls.clear()
            with ls.work_bound_override(bound):
                out, lse = sage_attention(q, k, v, tensor_layout="NHD", is_causal=causal, kernel=kernel,
                                          return_lse=True, attn_mask=mask)
            runs.append((out, lse, len(calls)))
        (one, one_lse, n_one), (split, split_lse, n_split) = runs
        assert n_one == 1 and n_split > 1
        assert torch.isfinite(one.float()).all() and float(one.float().abs().sum()) > 0
        assert torch.equal(one, split) and torch.equal(one_lse, split_lse)
