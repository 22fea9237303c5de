"""tools/model_table.py on the tiny CPU versions of every model family, in a real ComfyUI (COMFYUI_PATH).

Each family is built through ComfyUI's own classes with the conditioning ComfyUI passes (padded prompts with their
attention masks where the model takes them), sampled unpatched and with triton_int8_fp8 (under Triton's
interpreter), and the share of calls the kernel took is checked against the pack's rule for masks: no mask and
key-only masks are taken, a mask that differs between query rows falls back with a reason that says so. The mask
kinds each family shows are checked against what ComfyUI's model code passes (read from its source). No timing.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui
ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
KERNEL = "triton_int8_fp8"

# The masks ComfyUI 0.3.64's model code passes with the table's inputs (tests/comfy_harness.py says why per family).
EXPECTED_MASKS = {
    "hunyuan_video": {"keys", "rows"},  # blocks: (1, 1, N) bias; token refiner: (B, 1, L, L); cfg 1: no uncond
    "ltxv": {"keys", "none"},                   # cross-attention: (B, 1, 1, 128) bias; self-attention: none
    "lumina2": {"keys", "none"},                # refiners and layers with the padded prompt; the uncond has none
}
MASKED = ["hunyuan_video", "ltxv", "lumina2"]


# The table runs in a child process: Triton's interpreter is chosen when the pack's kernels are decorated, so a
# process whose earlier tests imported them without TRITON_INTERPRET=1 could not run them on the CPU.
CHILD = """
import json, sys
sys.path[:0] = [{tools!r}, {tests!r}]
from pathlib import Path
from pack_loader import load_harness, load_pack
load_pack()
harness = load_harness()
harness.comfy_import(cpu=True)
import importlib.util
spec = importlib.util.spec_from_file_location("sage_rdna4_model_table", {tool!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
if {broken!r}:  # 256 wide in 3 heads: ComfyUI's Flux refuses to build it
    flux = harness.FAMILIES["flux"]
    harness.FAMILIES["broken"] = harness.Family("broken", "Broken", "Flux", dict(flux.real), cut={{}}, full_depth="-",
                                                tiny=dict(flux.tiny, num_heads=3), inputs=flux.inputs, masks="none",
                                                size="-")
tool.run_table({families!r}, [{kernel!r}], Path({out!r}), steps={steps!r}, tiny=True, harness=harness,
               say=lambda s: None, profile={profile!r}, rounds={rounds!r})
"""


@pytest.fixture(scope="module")
def family_names():
    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("COMFYUI_PATH is not set")
    spec = importlib.util.spec_from_file_location("sage_rdna4_comfy_harness_names", ROOT / "tests" / "comfy_harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return list(harness.FAMILIES)


def run_families(tmp_path, families, broken=False, profile=False, steps=1, rounds=1):
    code = CHILD.format(tools=str(TOOLS), tests=str(ROOT / "tests"), tool=str(TOOLS / "model_table.py"),
                        broken=broken, families=families, kernel=KERNEL, out=str(tmp_path), profile=profile,
                        steps=steps, rounds=rounds)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "model_table.json").read_text())
    assert [r["family"] for r in saved["rows"]] == families  # rewritten after each family, all kept
    assert (tmp_path / "model_table.md").read_text().count("\n| ") >= len(families) + 1
    return {r["family"]: r for r in saved["rows"]}


def check_family(name, row):
    assert "error" not in row, row.get("traceback")
    entry = row["kernels"][KERNEL]
    assert "error" not in entry, entry
    kinds = set(row["seen"]["mask_kinds"])
    assert kinds == EXPECTED_MASKS.get(name, {"none"}), (name, row["seen"])
    assert entry["calls"] == sum(row["seen"]["mask_kinds"].values()) > 0
    by_mask = entry["by_mask"]
    assert set(by_mask) == kinds
    # The pack's rule: no mask and key-only masks run quantized, per-row masks fall back naming their kind.
    for kind, counts in by_mask.items():
        expected = 0 if kind == "rows" else counts["calls"]
        assert counts["quantized"] == expected, (name, kind, by_mask, entry["fallbacks"])
    rows_calls = by_mask.get("rows", {}).get("calls", 0)
    assert entry["call_share"] == pytest.approx(1 - rows_calls / entry["calls"])
    assert sum(entry["fallbacks"].values()) == rows_calls
    assert all("differs between query rows" in reason for reason in entry["fallbacks"]), entry["fallbacks"]
    assert entry["ran"].get(KERNEL, 0) == entry["quantized_calls"]
    # The quantized run stays close to the unpatched one (tiny models, one step): a broken kernel would not.
    assert float(entry["latent_psnr_db"]) > 40, entry["latent_psnr_db"]  # JSON writes inf as "inf"


@pytest.mark.timeout(300)
def test_masked_families_take_key_masks_and_refuse_row_masks(family_names, tmp_path):
    rows = run_families(tmp_path, MASKED + ["sd35"])
    for name, row in rows.items():
        check_family(name, row)
    # SD3's pos_embed is a buffer ComfyUI allocates empty (the checkpoint fills it): the tool gives it values.
    assert rows["sd35"]["random_buffers"] == ["pos_embed"]
    # HunyuanVideo: the refiner's per-row mask is the only fallback, the blocks' key mask runs quantized.
    hv = rows["hunyuan_video"]["kernels"][KERNEL]["by_mask"]
    assert hv["rows"]["quantized"] == 0 < hv["keys"]["quantized"] == hv["keys"]["calls"]
    # A prompt's padding mask is cut from K and V from its second call in the step (kernels/padding_masks.py): the
    # blocks share one mask object per model evaluation, so all but its first call are cut (tiny LTX-Video has one
    # layer: its one masked call is that first call).
    cuts = {name: rows[name]["kernels"][KERNEL]["cut_calls"] for name in MASKED}
    assert cuts["hunyuan_video"] == hv["keys"]["calls"] - 1 and cuts["lumina2"] > 0 and cuts["ltxv"] == 0, cuts
    for name in MASKED:
        entry = rows[name]["kernels"][KERNEL]
        # Per-call accuracy of every quantized call of the step against the call site's own attention.
        assert 0 < entry["rel_l1_max"] < 0.1, (name, entry["rel_l1_max"])


@pytest.mark.slow
def test_every_family_builds_samples_and_reports(family_names, tmp_path):
    rows = run_families(tmp_path, family_names)
    for name, row in rows.items():
        check_family(name, row)
    # Mochi's T5 pooler calls torch's SDPA directly: attention the override never sees, and the table says so.
    assert rows["mochi"]["sdpa_outside_override"] > 0
    assert all(r["sdpa_outside_override"] == 0 for n, r in rows.items() if n != "mochi")


@pytest.mark.timeout(300)
def test_a_family_that_fails_is_a_row_and_the_run_goes_on(family_names, tmp_path):
    rows = run_families(tmp_path, ["broken", "flux"], broken=True)
    # 256 wide in 3 heads: ComfyUI's Flux refuses to build it
    assert rows["broken"]["error"].startswith("ValueError") and "traceback" in rows["broken"]
    check_family("flux", rows["flux"])
    assert "failed:" in (tmp_path / "model_table.md").read_text()


@pytest.mark.timeout(300)
def test_the_table_profiles_its_runs_and_takes_the_median_of_rounds(family_names, tmp_path):
    """--profile: each timed run again under torch.profiler, its host time and busiest ops per step (a cut model's
    step ratio follows the host's speed: docs/MEASUREMENTS.md). --rounds 2: a second unpatched run and kernel run,
    each round's ratio kept, the reported one their median."""
    flux = run_families(tmp_path, ["flux"], profile=True, steps=2, rounds=2)["flux"]
    for profile in (flux["baseline_profile"], flux["kernels"][KERNEL]["profile"]):
        assert profile["host_ms_per_step"] > 0 and profile["top_host"]
        assert all(count > 0 and ms >= 0 for _, count, ms in profile["top_host"])
    assert any(name.startswith("aten::") for name, _, _ in flux["baseline_profile"]["top_host"])
    entry = flux["kernels"][KERNEL]
    assert len(entry["round_ratios"]) == 2 and all(r > 0 for r in entry["round_ratios"]), entry["round_ratios"]
    assert entry["median_step_ratio"] == pytest.approx(sum(entry["round_ratios"]) / 2)
