"""Ahead-of-time compilation of every shipped RDNA4 Triton configuration, on the CPU.

For gfx1201 and gfx1200: the kernel compiles with num_stages=1, its ISA uses the gfx12 INT8 WMMA for
Q.K^T and the FP8 (or F16) WMMA for P.V, no VGPR is spilled (no scratch), and LDS fits 64 KiB.
SGPR spills are reported, not failed: they go to VGPR lanes, not memory (docs/MEASUREMENTS.md states
which configurations spill them and how many). Prints VGPRs, SGPRs, spills, LDS and occupancy per configuration
(run with -s to see them).
Both P.V accumulation forms ("mma", "split") are compiled for the FP8 entries, and the IR shows that
the shipped one is what runs (Triton's combiner would otherwise fold "split" back into "mma").
"""
import dataclasses

import pytest

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels import settings  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton.configs import (  # noqa: E402
    RDNA4_ARCHS,
    attention_config,
    padded_head_dim,
    shipped_rdna4_configs,
)
from comfyui_sage_rdna4.kernels.verify import triton_aot  # noqa: E402

_missing = triton_aot.amd_backend_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"AOT for gfx12 impossible here: {_missing}")


SUMMARY = []  # filled by check(); the session fixture below hands it to the run's summary


@pytest.fixture(autouse=True, scope="module")
def _to_summary(summary_lines):
    yield
    summary_lines.extend(SUMMARY)


def check(report: triton_aot.KernelReport, pv: str, mode: str, spills_allowed: bool = False, loops: int = 1):
    print(report.line())
    SUMMARY.append(report.line())
    assert report.vgprs > 0, "no .vgpr_count in the ISA metadata"
    if not spills_allowed:
        assert report.vgpr_spills == 0 and report.scratch_bytes == 0, "VGPRs spilled to scratch"
    assert report.lds_bytes <= triton_aot.LDS_LIMIT
    assert report.isa_ops[triton_aot.WMMA_INT8] > 0, "Q.K^T is not on the INT8 WMMA"
    pv_op = triton_aot.WMMA_FP8 if pv == "fp8" else triton_aot.WMMA_F16
    assert report.isa_ops[pv_op] > 0, f"P.V is not on {pv_op}"
    # Two P.V dots per key loop (full tiles, masked tiles); "split" must keep them starting from zero.
    assert report.pv_dots == 2 * loops
    assert report.pv_dots_fresh == (2 * loops if mode == "split" else 0), f"P.V is not accumulated as {mode!r}"


def test_shipped_configs_use_one_stage():
    for _, _, cfg in shipped_rdna4_configs():
        assert cfg.num_stages == 1 and cfg.block_m % cfg.block_n == 0
    for arch in RDNA4_ARCHS:
        for d in (40, 64, 80, 128, 160, 256):
            assert attention_config(arch, d, "fp8").num_stages == 1


@pytest.mark.parametrize("arch", RDNA4_ARCHS)
@pytest.mark.parametrize("d,pv,cfg", shipped_rdna4_configs(),
                         ids=[f"D{d}-{pv}" for d, pv, _ in shipped_rdna4_configs()])
def test_attention_compiles_for_gfx12(arch, d, pv, cfg):
    mode = cfg.pv_accumulate
    check(triton_aot.compile_attention(arch, d, pv, cfg), pv, mode)
    if arch == "gfx1201":  # the causal + LSE + fp16-output + smooth_v variant, and an SD1.5 padded head dim
        check(triton_aot.compile_attention(arch, d, pv, cfg, is_causal=True, return_lse=True, out_dtype="fp16",
                                           kv_group=4, smooth_v=True), pv, mode)
        odd = {32: 24, 64: 40, 128: 80, 256: 160}[d]
        assert padded_head_dim(odd) == d
        check(triton_aot.compile_attention(arch, odd, pv, cfg), pv, mode)


# Key-loop bounds (non-WMMA instructions per v_wmma, gfx1201, Triton 3.6: configs.py has the history): with
# k_scale rows padded to 16 entries (the Triton prologue's pad_k_scale_rows) FP8 33.9 / 17.2 / 10.3 / 11.0 at
# D32 / 64 / 128 / 256, FP16 31.3 / 20.3 / 9.3 / 14.4 (unpadded, at a key count that is no multiple of 16: FP8
# 45.1 / 21.2 / 13.1 / 12.6, FP16 39.9 / 26.2 / 11.9 / 16.0). A bound ~10-15 % above each, so a lost hardware
# conversion, byte-wise V reads or per-key scale reads fail.
LOOP_BOUND = {(32, "fp8"): 38, (64, "fp8"): 19.5, (128, "fp8"): 11.5, (256, "fp8"): 12.5,
              (32, "fp16"): 35, (64, "fp16"): 23, (128, "fp16"): 10.5, (256, "fp16"): 16.0}


@pytest.mark.parametrize("d,pv,cfg", shipped_rdna4_configs(),
                         ids=[f"D{d}-{pv}" for d, pv, _ in shipped_rdna4_configs()])
def test_key_loop_instruction_budget_on_gfx1201(d, pv, cfg):
    """What the shipped key loop spends besides its WMMAs, and that FP8 P uses the hardware conversion and
    FP8 V is read from LDS in wide loads (Triton 3.6 converts in software and reads bytes otherwise)."""
    report = triton_aot.compile_attention("gfx1201", d, pv, cfg)
    print(report.line())
    SUMMARY.append(report.line())
    ratio = report.loop_non_wmma_per_wmma
    assert ratio is not None and ratio <= LOOP_BOUND[(d, pv)], report.line()
    if pv == "fp8":
        assert report.loop_ops.get("v_cvt_pk_fp8_f32", 0) > 0, "P is not converted with v_cvt_pk_fp8_f32"
        if d < 256:  # D256's 16-key tiles still read 8 V bytes singly per loop (8 of 1198 instructions)
            assert report.loop_ops.get("ds_load_u8", 0) == 0, "FP8 V is read from LDS a byte at a time"


# The key-only mask's variant as shipped (attention.PLAIN_MASK_ROWS off): one key loop adding the bias (a bias load
# per key tile, the row scale and the bias in one FMA per score, no FOLD_Q_SCALE). gfx1201, Triton 3.6, non-WMMA per
# v_wmma: FP8 12.69 / 20.12, FP16 10.38 / 22.69 at D128 / D64 (unmasked 10.47 / 17.56, 9.59 / 20.50).
# With PLAIN_MASK_ROWS the kernel holds two (`triton_aot.key_loops_ops`, ISA order): the plain padding rows' (the
# unmasked loop, cut at the key end) and the biased rows': plain / biased FP8 10.53 / 12.62, FP16 10.62 / 10.72 at
# D128, FP8 16.69 / 19.88, FP16 19.88 / 21.88 at D64. Bounds ~10 % above each.
PLAIN_LOOP_BOUND = {(128, "fp8"): 11.6, (64, "fp8"): 18.5, (128, "fp16"): 11.7, (64, "fp16"): 22.0}
KEY_MASK_LOOP_BOUND = {(128, "fp8"): 14.0, (64, "fp8"): 22.0, (128, "fp16"): 11.8, (64, "fp16"): 25.0}
RDNA4_64_128 = [c for c in shipped_rdna4_configs() if c[0] in (64, 128)]
RDNA4_64_128_IDS = [f"D{d}-{pv}" for d, pv, _ in RDNA4_64_128]


@pytest.mark.parametrize("d,pv,cfg", RDNA4_64_128, ids=RDNA4_64_128_IDS)
def test_key_mask_variant_compiles_for_gfx1201(d, pv, cfg):
    report = triton_aot.compile_attention("gfx1201", d, pv, cfg, key_mask=True)
    check(report, pv, cfg.pv_accumulate)
    assert len(report.loops) == 1, report.line()
    ratio = report.loop_non_wmma_per_wmma
    assert ratio is not None and ratio <= KEY_MASK_LOOP_BOUND[(d, pv)], report.line()


@pytest.mark.parametrize("d,pv,cfg", RDNA4_64_128, ids=RDNA4_64_128_IDS)
def test_key_mask_variant_with_plain_rows_compiles_for_gfx1201(d, pv, cfg):
    report = triton_aot.compile_attention("gfx1201", d, pv, cfg, key_mask=True, plain_rows=True)
    check(report, pv, cfg.pv_accumulate, loops=2)
    assert len(report.loops) == 2, report.line()
    plain, biased = report.loops_non_wmma_per_wmma
    assert plain <= PLAIN_LOOP_BOUND[(d, pv)] and biased <= KEY_MASK_LOOP_BOUND[(d, pv)], report.line()
    assert plain < biased, report.line()  # what the plain path is for
    if pv == "fp8":
        assert all(ops.get("v_cvt_pk_fp8_f32", 0) > 0 for ops in report.loops), "P is not converted in hardware"


def test_key_loop_counter_reads_the_loop_with_the_most_wmma():
    asm = """k:
.LBB0_1:
	v_wmma_f32_16x16x16_f16 v[0:7], v[8:11], v[12:15], v[0:7]
	s_branch .LBB0_2
.LBB0_2:
	v_wmma_i32_16x16x16_iu8 v[0:7], v[8:9], v[10:11], v[0:7]
	v_wmma_f32_16x16x16_fp8_fp8 v[0:7], v[8:9], v[10:11], v[0:7]
	v_exp_f32_e32 v1, v1
	s_wait_dscnt 0x0
	; a comment
	s_cbranch_scc1 .LBB0_2
"""
    ops = triton_aot.key_loop_ops(asm)
    assert ops == {"v_wmma_i32_16x16x16_iu8": 1, "v_wmma_f32_16x16x16_fp8_fp8": 1, "v_exp_f32_e32": 1,
                   "s_wait_dscnt": 1, "s_cbranch_scc1": 1}
    report = triton_aot.KernelReport("x", "gfx1201", 0, 0, 0, 0, 0, 0, None, loop_ops=ops)
    assert report.loop_non_wmma_per_wmma == 1.5
    # The loops over full tiles: blocks with the most v_wmma that branch back to themselves, in order.
    assert triton_aot.key_loops_ops(asm) == [ops]
    exp = "v_exp_f32_e32 v1, v1\n"
    two = asm + asm.replace(".LBB0_2", ".LBB0_3").replace(exp, exp + "\tv_fma_f32 v1, v1, v2, v3\n")
    loops = triton_aot.key_loops_ops(two)
    assert [triton_aot.non_wmma_per_wmma(o) for o in loops] == [1.5, 2.0]


FP8 = [(d, cfg) for d, pv, cfg in shipped_rdna4_configs() if pv == "fp8"]


@pytest.mark.parametrize("arch", RDNA4_ARCHS)
@pytest.mark.parametrize("d,cfg", FP8, ids=[f"D{d}" for d, _ in FP8])
def test_fp8_accumulation_modes_for_gfx12(arch, d, cfg):
    """The FP8 entries in both accumulation forms: the shipped one ("split") is held to no spills above;
    the other is compiled and its figures recorded, so the choice can be revisited (VGPRs, spills, LDS)."""
    assert cfg.pv_accumulate == "split"
    other = dataclasses.replace(cfg, pv_accumulate="mma")
    check(triton_aot.compile_attention(arch, d, "fp8", other), "fp8", "mma", spills_allowed=True)


def test_accumulation_forms_on_nvidia_targets():
    """Where the FP8 MMA truncates (sm_89, sm_90), the shipped form is what the compiled kernel does."""
    missing = triton_aot.nvidia_missing()
    if missing:
        pytest.skip(missing)
    cfg = attention_config("sm_89", 128, "fp8")
    assert cfg.pv_accumulate == "split"
    got = triton_aot.nvidia_pv_dots("sm_89", 128, "fp8", cfg)
    assert got["ttgir"] == (2, 2), f"sm_89: the split P.V dots were folded back into the MMA: {got}"
    cfg = attention_config("sm_90", 128, "fp8")
    assert cfg.pv_accumulate == "imprecise_k"
    got = triton_aot.nvidia_pv_dots("sm_90", 128, "fp8", cfg)
    assert got["max_num_imprecise_acc"] == [cfg.block_n] * 2, got


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("smooth_v", [False, True])
def test_prologue_compiles_for_gfx1201(pv, smooth_v):
    for r in triton_aot.compile_prologue("gfx1201", 128, pv, smooth_v=smooth_v):
        print(r.line())
        SUMMARY.append(r.line())
        assert r.vgpr_spills == 0 and r.scratch_bytes == 0 and r.lds_bytes <= triton_aot.LDS_LIMIT


@pytest.mark.parametrize("arch", ["gfx1201", "sm_90"])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_quantized_outputs_are_stored_wide_at_any_length(arch, pv):
    """The quantize kernel writes 16 bytes per store even when the sequence length is no multiple of 16 (the
    AOT signature gives it no divisibility, as at Wan 480p's 32760 tokens). Masking V's (Dv, Nk) rows at Nk
    itself made every FP8 byte a store of its own there: V took 880 us instead of ~170 us on the H200."""
    missing = triton_aot.nvidia_missing() if arch.startswith("sm_") else triton_aot.amd_backend_missing()
    if missing:
        pytest.skip(missing)
    got = triton_aot.narrow_stores(arch, 128, pv)
    assert got and all(n == 0 for n in got.values()), got


def test_value_head_dim_may_differ_from_query_head_dim():
    """A model whose V is narrower than Q/K (found by the GPU fuzz: D192/DV3 failed to compile, because the
    prologue's if/else branches gave one variable two widths)."""
    for r in triton_aot.compile_prologue("gfx1201", 192, "fp8", v_head_dim=3, smooth_v=True):
        assert r.vgpr_spills == 0
    cfg = attention_config("gfx1201", 192, "fp8")
    report = triton_aot.compile_attention("gfx1201", 192, "fp8", cfg, v_head_dim=3)
    assert report.isa_ops[triton_aot.WMMA_INT8] > 0


def test_fp8_conversion_can_be_switched_to_software(monkeypatch):
    """SAGE_RDNA4_TRITON_FP8_CVT=software takes the inline-asm conversion out of the RDNA4 FP8 configs only."""
    from comfyui_sage_rdna4.kernels.backends.triton import configs
    assert attention_config("gfx1201", 128, "fp8").fp8_cvt_asm
    monkeypatch.setenv(settings.TRITON_FP8_CVT.name, "software")
    configs._table_config.cache_clear()
    try:
        soft = attention_config("gfx1201", 128, "fp8")
        assert not soft.fp8_cvt_asm and soft.v_transposed and soft.pv_accumulate == "split"
        assert not attention_config("sm_90", 128, "fp8").fp8_cvt_asm
        report = triton_aot.compile_attention("gfx1201", 128, "fp8", soft)
        assert report.vgpr_spills == 0 and report.loop_ops.get("v_cvt_pk_fp8_f32", 0) == 0
    finally:
        configs._table_config.cache_clear()
