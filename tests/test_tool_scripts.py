"""The tools that drive ComfyUI from a script find what they share with the tests from tools/: tools/ab_real_size.py
the models of tests/comfy_harness.py, tools/template_thumbnails.py the browser driver of tests/comfy_browser.py.
(Running them needs ComfyUI, and a GPU or Chromium.)"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import comfy_browser

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def test_template_thumbnails_without_comfyui_says_what_it_needs():
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    proc = subprocess.run([sys.executable, str(TOOLS / "template_thumbnails.py")], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "COMFYUI_PATH" in proc.stderr and "Traceback" not in proc.stderr


def test_template_thumbnails_uses_only_what_comfy_browser_has():
    """Every `cb.NAME` the tool uses exists in tests/comfy_browser.py (a rename there would break the tool only
    when it is run against ComfyUI)."""
    used = set(re.findall(r"\bcb\.(\w+)", (TOOLS / "template_thumbnails.py").read_text()))
    assert {"Page", "ComfyServer", "open_comfy", "load_and_snapshot", "workflows"} <= used
    assert not [name for name in used if not hasattr(comfy_browser, name)]


def test_ab_real_size_loads_the_harness_and_the_pack_through_pack_loader(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # what `python tools/ab_real_size.py` has first on sys.path
    spec = importlib.util.spec_from_file_location("sage_rdna4_ab_real_size", TOOLS / "ab_real_size.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert Path(tool.harness.__file__).resolve() == ROOT / "tests" / "comfy_harness.py"
    for name in ("FLUX_1MP", "WAN_13B", "WAN_14B", "FLUX_TINY", "WAN_TINY", "build_model", "comfy_import"):
        assert hasattr(tool.harness, name), name
    import pack_loader
    assert tool.load_pack is pack_loader.load_pack
    assert tool.load_pack().__name__ == "comfyui_sage_rdna4"


@pytest.mark.comfyui
def test_compile_real_size_times_eager_and_compiled_runs_of_a_tiny_model(tmp_path):
    """tools/compile_real_size.py --tiny on the CPU: every run is written with its steps, graph breaks and stats, the
    patched runs carry latent PSNR against the unpatched run of their own mode, and the patch adds no graph break."""
    runs = "eager:sdpa,eager:reference,aot_eager:sdpa,aot_eager:reference"
    proc = subprocess.run([sys.executable, str(TOOLS / "compile_real_size.py"), "--tiny", "--out", str(tmp_path),
                           "--runs", runs, "--steps", "3"], capture_output=True, text=True, timeout=600,
                          cwd=str(TOOLS))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["mode"], r["kernel"]): r for r in json.loads((tmp_path / "flux.json").read_text())["rows"]}
    assert list(rows) == [tuple(r.split(":")) for r in runs.split(",")]
    for row in rows.values():
        assert "error" not in row and len(row["step_s"]) == 3 and row["median_step_s"] > 0
    compiled = rows[("aot_eager", "reference")]
    assert compiled["graph_breaks"] == 0 and compiled["unique_graphs"] >= 1
    assert compiled["stats"]["calls"] == {"reference": 6} and not compiled["stats"]["fallbacks"]
    assert compiled["latent_psnr_vs_aot_eager_sdpa_db"] > 60 and compiled["latent_psnr_vs_eager_sdpa_db"] > 60
    assert "latent_psnr_vs_eager_sdpa_db" in rows[("aot_eager", "sdpa")]


@pytest.mark.comfyui
def test_moe_routing_counts_expert_flips_and_replays_the_routing():
    """tools/moe_routing.py --tiny on the CPU: one JSON line per run, each with per-call rel L1 for the specs (FP16
    P.V's below FP8's), a count of expert-choice flips, and a PSNR with the routing replayed that is at least the
    free run's (replaying the exact run's choices removes flips, never adds error)."""
    proc = subprocess.run([sys.executable, str(TOOLS / "moe_routing.py"), "--tiny", "--side", "8", "--steps", "2",
                           "--smooth-v"], capture_output=True, text=True, timeout=600, cwd=str(TOOLS))
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {r["run"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert list(runs) == ["FP8 P.V spec", "FP16 P.V spec", "exact, bf16-rounded", "FP8 P.V spec, smooth_v"]
    # smooth_v changes what the FP8 spec computes (V's channel means out before quantizing): other per-call errors
    assert runs["FP8 P.V spec, smooth_v"]["rel_l1_per_call"] != runs["FP8 P.V spec"]["rel_l1_per_call"]
    fp8, fp16 = runs["FP8 P.V spec"], runs["FP16 P.V spec"]
    assert fp8["rel_l1_per_call"] and len(fp8["rel_l1_per_call"]) == len(fp16["rel_l1_per_call"])
    assert max(fp16["rel_l1_per_call"]) < min(fp8["rel_l1_per_call"])
    for r in runs.values():
        assert r["gate_tokens"] > 0 and 0 <= r["routing_flips"] <= r["gate_tokens"]
        assert r["routing_replayed_psnr_db"] >= r["latent_psnr_db"] - 0.5


def test_override_overhead_times_masked_calls_through_the_padding_cut():
    """tools/override_overhead.py --masks: one line per case (no mask, a padded end of the keys, kept keys that are
    not a prefix), each with both timings and the overhead; the override ran every call (the tool asserts it)."""
    proc = subprocess.run([sys.executable, str(TOOLS / "override_overhead.py"), "--masks", "--calls", "40"],
                          capture_output=True, text=True, timeout=300, cwd=str(TOOLS))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "overhead" in line]
    assert [line.split(" cpu:")[0] for line in lines] == ["no mask", "padded end", "kept keys not a prefix"]
    assert all(re.search(r"overhead +-?\d+\.\d us/call", line) for line in lines), lines


GIL_TOOL = ROOT / "kernels" / "verify" / "triton_compile_gil.py"


def test_triton_compile_gil_times_each_mode_on_the_cpu():
    """kernels/verify/triton_compile_gil.py (AOT sm_90 compiles, no GPU): one JSON line per mode asked, each with its
    wall time, the busy-thread mode with the share of its rate the spinner kept."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(GIL_TOOL), "--kernels", "1", "--modes", "serial,busy_thread"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    if proc.returncode == 2 and "NVIDIA backend" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["serial", "busy_thread"] and all(r["kernels"] == 1 for r in rows)
    assert all(r["wall_s"] > 0 for r in rows) and 0 < rows[1]["spinner_rate_kept"] <= 1.5, rows
    bad = subprocess.run([sys.executable, str(GIL_TOOL), "--modes", "fast"], capture_output=True, text=True,
                         cwd=str(ROOT), timeout=120)
    assert bad.returncode == 2 and "modes from serial" in bad.stderr
