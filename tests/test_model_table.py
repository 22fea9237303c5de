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


@pytest.fixture(scope="module")
def table(monkeypatch_module):
    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("COMFYUI_PATH is not set")
    monkeypatch_module.setenv("TRITON_INTERPRET", "1")
    monkeypatch_module.syspath_prepend(str(TOOLS))
    import comfy_harness as harness

    harness.comfy_import(cpu=True)
    spec = importlib.util.spec_from_file_location("sage_rdna4_model_table", TOOLS / "model_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool, harness


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def run_families(table, tmp_path, families):
    tool, harness = table
    rows = tool.run_table(families, [KERNEL], tmp_path, steps=1, tiny=True, harness=harness, say=lambda s: None)
    saved = json.loads((tmp_path / "model_table.json").read_text())
    assert [r["family"] for r in saved["rows"]] == families  # rewritten after each family, all kept
    assert (tmp_path / "model_table.md").read_text().count("\n| ") >= len(families) + 1
    return {r["family"]: r for r in rows}


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
    assert entry["latent_psnr_db"] > 40, entry["latent_psnr_db"]


@pytest.mark.timeout(300)
def test_masked_families_take_key_masks_and_refuse_row_masks(table, tmp_path):
    rows = run_families(table, tmp_path, MASKED + ["sd35"])
    for name, row in rows.items():
        check_family(name, row)
    # SD3's pos_embed is a buffer ComfyUI allocates empty (the checkpoint fills it): the tool gives it values.
    assert rows["sd35"]["random_buffers"] == ["pos_embed"]
    # HunyuanVideo: the refiner's per-row mask is the only fallback, the blocks' key mask runs quantized.
    hv = rows["hunyuan_video"]["kernels"][KERNEL]["by_mask"]
    assert hv["rows"]["quantized"] == 0 < hv["keys"]["quantized"] == hv["keys"]["calls"]


@pytest.mark.slow
def test_every_family_builds_samples_and_reports(table, tmp_path):
    tool, harness = table
    rows = run_families(table, tmp_path, list(harness.FAMILIES))
    for name, row in rows.items():
        check_family(name, row)
    # Mochi's T5 pooler calls torch's SDPA directly: attention the override never sees, and the table says so.
    assert rows["mochi"]["sdpa_outside_override"] > 0
    assert all(r["sdpa_outside_override"] == 0 for n, r in rows.items() if n != "mochi")


@pytest.mark.timeout(300)
def test_a_family_that_fails_is_a_row_and_the_run_goes_on(table, tmp_path, monkeypatch):
    tool, harness = table
    flux = harness.FAMILIES["flux"]
    broken = harness.Family("broken", "Broken", "Flux", dict(flux.real), cut={}, full_depth="-",
                            tiny=dict(flux.tiny, num_heads=3), inputs=flux.inputs, masks="none", size="-")
    monkeypatch.setitem(harness.FAMILIES, "broken", broken)
    rows = run_families(table, tmp_path, ["broken", "flux"])
    # 256 wide in 3 heads: ComfyUI's Flux refuses to build it
    assert rows["broken"]["error"].startswith("ValueError") and "traceback" in rows["broken"]
    check_family("flux", rows["flux"])
    assert "failed:" in (tmp_path / "model_table.md").read_text()
