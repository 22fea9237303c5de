"""The field report (kernels/field_report.py, the root field_report.py) end to end on the CPU: its JSON schema,
the Markdown sections, a planted self-check failure shown with its reason in both files, and errors (a whole
section's, one benchmark run's) recorded with their tracebacks while the rest of the report still runs.
The self-check runs a few small cases here (the real ones take 5-15 s of CPU on the reference)."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from comfyui_sage_rdna4.kernels import field_report as fr
from comfyui_sage_rdna4.kernels.self_check import Case

ROOT = Path(__file__).resolve().parents[1]
SMALL_CASES = (Case("small-peaked", "peaked", torch.float16, 64, 1, 2, 1, 130, 200),
               Case("small-lse", "peaked", torch.bfloat16, 64, 1, 2, 2, 70, 90, is_causal=True, return_lse=True))
HEADINGS = ("## Summary", "## Environment", "## Libraries", "## HIP code path", "## Hardware probes",
            "## Self-check", "## Kernel time and accuracy against SDPA", "## What auto chose", "## First use",
            "## Errors")


def _written(out: str, folder: Path):
    """The JSON and Markdown paths the run printed, read back."""
    paths = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith(("JSON:", "Markdown:"))}
    assert set(paths) == {"JSON", "Markdown"}, out
    for p in paths.values():
        assert Path(p).parent == folder and Path(p).is_file()
    return json.loads(Path(paths["JSON"]).read_text()), Path(paths["Markdown"]).read_text()


def test_root_script_on_the_cpu_end_to_end(tmp_path):
    """The root script, with traps for ComfyUI on the path: it runs every section, imports neither ComfyUI nor
    kernels/verify, and writes both files where --out says."""
    traps = tmp_path / "traps"
    for name in ("comfy", "comfy_api"):
        (traps / name).mkdir(parents=True)
        (traps / name / "__init__.py").write_text(f"raise SystemExit('the field report imported {name}')\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    driver = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["field_report.py", "--out", {str(out_dir)!r}]
        entry = runpy.run_path({str(ROOT / "field_report.py")!r}, run_name="field_report_entry")
        fr = entry["field_report_module"]()
        from comfyui_sage_rdna4.kernels.self_check import Case
        import torch
        fr.CASES = (Case("small-peaked", "peaked", torch.float16, 64, 1, 2, 1, 130, 200),)
        fr.main()
        bad = [m for m in sys.modules if m in ("comfy", "comfy_api") or m.startswith(("comfy.", "comfy_api."))
               or m.startswith(("comfyui_sage_rdna4.kernels.verify", "comfyui_sage_rdna4.nodes"))]
        assert not bad, bad
    """)
    env = dict(os.environ, PYTHONPATH=str(traps))
    r = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report, md = _written(r.stdout, out_dir)
    for line in ("[", "environment ...", "self_check ...", "benchmark ...", "auto ..."):
        assert line in r.stdout  # progress lines
    assert report["schema"] == fr.SCHEMA and report["device"] == "cpu" and report["errors"] == []
    assert report["status"] == "complete" and report["missing"] == {} and "**Missing:**" not in md
    assert list(report["sections"]) == list(fr.SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok" and isinstance(sec["seconds"], float), name
    env_data = report["sections"]["environment"]["data"]
    assert env_data["torch"] == torch.__version__ and env_data["python"] == sys.version.split()[0]
    # conftest.py sets the self-check cache (off unless set): the report gives the text and the value used
    from comfyui_sage_rdna4.kernels import settings
    assert env_data["settings"]["SAGE_RDNA4_SELF_CHECK_CACHE"] == {
        "text": os.environ["SAGE_RDNA4_SELF_CHECK_CACHE"], "used": settings.self_check_cache_enabled()}
    probes = report["sections"]["hardware_probes"]["data"]
    assert probes["status"] == "not run" and probes["note"].startswith(fr.PROBES_NOT_RUN + ": no GPU (cpu)")
    checks = {t["kernel"]: t for t in report["sections"]["self_check"]["data"]}
    for name in fr.QUANTIZED:
        assert checks[name]["status"] == "not available" and checks[name]["reason"]
    spec = checks["reference (the spec, CPU)"]
    assert spec["status"] == "passed" and [c["verdict"] for c in spec["cases"]] == ["passed"]
    assert 0.99 < spec["cases"][0]["worst_cosine"] <= 1.0
    runs = report["sections"]["benchmark"]["data"]["runs"]
    assert [r_["inputs"] for r_ in runs] == list(fr.bench.INPUT_KINDS)
    for run in runs:
        rows = {row["backend"]: row for row in run["rows"]}
        assert rows["sdpa"]["cos"] > 0.9999 and 0.99 < rows["reference"]["cos"] < 1.0
    assert runs[0]["timed"] and rows["reference"]["ms"] is not None
    auto = report["sections"]["auto"]["data"][0]
    assert auto["shape"] == "tiny" and "no quantized kernel" in auto["exact_reason"]
    positions = [md.index(h) for h in HEADINGS]
    assert positions == sorted(positions), "every section, in order"
    assert probes["note"] in md and fr.CPU_NOTE in md and "| tiny | reference |" in md
    # The first-use ledger: the spec's self-check, with the seconds its section gives it; beside it only loading
    # backends and checking their availability, where one took 10 ms or more on this machine.
    parts = report["first_use"]["parts"]
    checks = [p for p in parts if p["part"].startswith("self-check")]
    assert [p["part"] for p in checks] == ["self-check reference (the spec, CPU) (torch prologue, per-token INT8, "
                                           "smooth_k on) on cpu"], parts
    assert all(p["part"].startswith(("loading ", "checking that ")) for p in parts if p not in checks), parts
    assert abs(checks[0]["seconds"] - spec["seconds"]) < 2e-3 and checks[0]["seconds"] > 0
    assert report["first_use"]["total_seconds"] == pytest.approx(sum(p["seconds"] for p in parts), abs=2e-3)
    assert f"| {checks[0]['part']} | {checks[0]['seconds']:.2f} |" in md.split("## First use")[1]


def test_planted_failure_and_errors_show_in_both_files(tmp_path, monkeypatch, capsys):
    """A kernel whose output is 10 % low fails its self-check, with the reason, in the JSON and the Markdown;
    a section that raises and one benchmark run that raises are recorded with tracebacks, and every other
    section and run still happens."""
    monkeypatch.setattr(fr, "CASES", SMALL_CASES)
    real_targets = fr.self_check_targets

    def with_a_broken_kernel(device):
        targets = real_targets(device)
        good = targets[-1]["attention"]

        def low(q, k, v, is_causal=False, return_lse=False):
            res = good(q, k, v, is_causal=is_causal, return_lse=return_lse)
            return (res[0] * 0.9, res[1]) if return_lse else res * 0.9
        return targets + [{"kernel": "planted_low_kernel", "variant": "x0.9", "attention": low,
                           "refuse": lambda case: None}]
    monkeypatch.setattr(fr, "self_check_targets", with_a_broken_kernel)

    def broken_libraries(device):
        raise RuntimeError("planted library lookup failure")
    monkeypatch.setattr(fr, "libraries_section", broken_libraries)
    real_bench = fr.bench.bench_shape

    def bench(shape, device, backends, reps, warmup, kind):
        if kind == "diffuse":
            raise ValueError("planted benchmark failure")
        return real_bench(shape, device, backends, reps, warmup, kind)
    monkeypatch.setattr(fr.bench, "bench_shape", bench)

    assert fr.main(["--out", str(tmp_path)]) == 0
    report, md = _written(capsys.readouterr().out, tmp_path)
    sec = report["sections"]
    assert sec["libraries"]["status"] == "error" and "planted library lookup failure" in sec["libraries"]["error"]
    assert "Traceback" in sec["libraries"]["traceback"] and "broken_libraries" in sec["libraries"]["traceback"]
    for name in ("hardware_probes", "self_check", "hip_code_path", "benchmark", "auto"):
        assert sec[name]["status"] == "ok", name  # the sections after the failed one ran
    planted = next(t for t in sec["self_check"]["data"] if t["kernel"] == "planted_low_kernel")
    assert planted["status"] == "failed" and "rel L1" in planted["reason"]
    assert next(t for t in sec["self_check"]["data"] if t["kernel"].startswith("reference"))["status"] == "passed"
    runs = {r["inputs"]: r for r in sec["benchmark"]["data"]["runs"]}
    assert "planted benchmark failure" in runs["diffuse"]["error"] and "rows" in runs["diffuse_voffset"]
    where = {e["where"] for e in report["errors"]}
    assert where == {"libraries", "benchmark: tiny / diffuse"}, where
    assert all("Traceback" in e["traceback"] for e in report["errors"])
    # The Markdown: the failure with its reason, both errors with their tracebacks.
    row = next(line for line in md.splitlines() if line.startswith("| planted_low_kernel | x0.9 |"))
    assert "| failed |" in row and planted["reason"] in row
    assert "self-check failed: planted_low_kernel (x0.9)" in md
    errors = md[md.index("## Errors"):]
    assert "planted library lookup failure" in errors and "planted benchmark failure" in errors
    assert errors.count("Traceback (most recent call last)") == 2
    assert "errors: 2" in md
    assert "| tiny | - | - | - | - |" in md and "diffuse: ValueError: planted benchmark failure" in md


def test_hip_code_path_read_through_one_function(monkeypatch):
    from comfyui_sage_rdna4.kernels.backends.hip import runtime
    monkeypatch.setattr(runtime, "code_path_line", lambda: "prebuilt gfx1201 1a2b3c4d", raising=False)
    assert fr.hip_code_path_section(torch.device("cpu")) == {"path": "prebuilt gfx1201 1a2b3c4d"}
    monkeypatch.setattr(runtime, "code_path_line", lambda: None)
    assert fr.hip_code_path_section(torch.device("cpu"))["path"].startswith("none")
    monkeypatch.delattr(runtime, "code_path_line")
    assert fr.hip_code_path_section(torch.device("cpu"))["path"] == "unknown"


def _no_section_may_run(monkeypatch):
    def collect(*args, **kwargs):
        raise AssertionError("a section ran")
    monkeypatch.setattr(fr, "collect", collect)


def test_out_must_be_a_folder(tmp_path, capsys, monkeypatch):
    _no_section_may_run(monkeypatch)
    assert fr.main(["--out", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err == f"field_report.py: error: --out {str(tmp_path / 'missing')!r} is not a folder\n"


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder no file can be made in: read-only by its mode, or (root ignores modes) /proc/self."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    candidates = [folder, Path("/proc/self")]
    try:
        for candidate in candidates:
            try:
                probe = tempfile.NamedTemporaryFile(dir=candidate)
            except OSError:
                yield candidate
                return
            probe.close()
        pytest.skip("no folder here refuses a new file (root without /proc)")
    finally:
        folder.chmod(0o755)


def test_an_unwritable_out_fails_fast_with_one_line(unwritable_folder, capsys, monkeypatch):
    """Before any section runs (they take 5-15 minutes on a card): one line on stderr, exit code 2."""
    _no_section_may_run(monkeypatch)
    start = time.perf_counter()
    assert fr.main(["--out", str(unwritable_folder)]) == 2
    assert time.perf_counter() - start < 5
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"field_report.py: error: cannot write the report into --out {str(unwritable_folder)!r}: ")


def _cheap_sections(monkeypatch, check=None):
    """The sections that take time replaced by small stand-ins of the same shape; `check(name)` runs first in each
    section (the files as the previous sections left them)."""
    stand_ins = {"self_check_section": lambda device, say, sink: [{"kernel": "k", "variant": "v", "status": "passed",
                                                                   "seconds": 0.1, "cases": []}],
                 "benchmark_section": lambda device, say, sink: {"backends": [], "reps": 1, "runs": []},
                 "auto_section": lambda device, say, sink: [{"shape": "tiny", "chosen": "sdpa"}]}
    for name, section in zip(fr.SECTIONS, ("environment_section", "libraries_section", "probes_section",
                                           "self_check_section", "hip_code_path_section", "pv_chain_section",
                                           "benchmark_section", "auto_section")):
        real = stand_ins.get(section) or getattr(fr, section)

        def wrapped(*args, _name=name, _real=real):
            if check:
                check(_name)
            return _real(*args)
        monkeypatch.setattr(fr, section, wrapped)


def test_the_first_use_ledger_lists_each_part_with_its_time(tmp_path, monkeypatch, capsys):
    """Every first-use part the run pays (kernels/first_use_costs.py), in order, with its seconds and the total:
    in the JSON after each section and in the Markdown's First use table and summary; parts recorded before the
    run are not in it."""
    from comfyui_sage_rdna4.kernels import first_use_costs
    first_use_costs.record("a part paid before the report", 99.0)
    planted = {"hardware_probes": ("hardware probes on cuda:0", 1.25),
               "self_check": ("self-check triton_int8_fp8 (planted) on cuda:0", 9.5),
               "auto": ("auto measured B1 H24 N4608 D128 alone", 0.375)}
    ledgers = {}

    def record(name):
        ledgers[name] = json.loads(sorted(tmp_path.glob("*.json"))[0].read_text())["first_use"]
        if name in planted:
            first_use_costs.record(*planted[name])
    _cheap_sections(monkeypatch, record)
    assert fr.main(["--out", str(tmp_path)]) == 0
    report, md = _files(tmp_path)
    want = [{"part": part, "seconds": seconds} for part, seconds in planted.values()]
    assert report["first_use"] == {"total_seconds": 11.125, "parts": want}
    # written as the run goes: the probes' part is in the files the self-check section starts with
    assert ledgers["environment"] == {"total_seconds": 0.0, "parts": []}
    assert ledgers["self_check"]["parts"] == want[:1] and ledgers["auto"]["parts"] == want[:2]
    table = md.split("## First use")[1].split("## Errors")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["| part | seconds |", "| hardware probes on cuda:0 | 1.25 |",
                    "| self-check triton_int8_fp8 (planted) on cuda:0 | 9.50 |",
                    "| auto measured B1 H24 N4608 D128 alone | 0.38 |", "| total | 11.12 |"]
    assert ("first use: 11.1 s in 3 parts (slowest: self-check triton_int8_fp8 (planted) on cuda:0, 9.5 s; "
            "under First use)") in md
    assert "a part paid before the report" not in md


def _files(folder):
    paths = sorted(folder.glob("sage_rdna4_field_report_*"))
    assert [p.suffix for p in paths] == [".json", ".md"], paths  # the two files, no temporary left
    return json.loads(paths[0].read_text()), paths[1].read_text()


def test_the_files_are_complete_and_valid_after_each_section(tmp_path, monkeypatch, capsys):
    """Each section starts with both files on disk, valid, holding every section finished so far and naming the
    rest as missing (not run yet)."""
    seen = []

    def check(name):
        report, md = _files(tmp_path)
        done = list(fr.SECTIONS[:fr.SECTIONS.index(name)])
        assert report["status"] == "running" and list(report["sections"]) == done
        assert report["missing"] == {n: fr.NOT_RUN_YET for n in fr.SECTIONS if n not in done}
        assert md.count("**Missing:** " + fr.NOT_RUN_YET) == len(report["missing"])
        assert "missing sections (running): " + "; ".join(f"{n}: {fr.NOT_RUN_YET}" for n in report["missing"]) in md
        seen.append(name)
    _cheap_sections(monkeypatch, check)
    assert fr.main(["--out", str(tmp_path)]) == 0
    assert seen == list(fr.SECTIONS)
    report, md = _files(tmp_path)
    assert report["status"] == "complete" and report["missing"] == {} and list(report["sections"]) == list(fr.SECTIONS)
    assert "Missing" not in md and "missing sections" not in md
    assert "rewritten after each section" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["self_check", "auto"])
def test_ctrl_c_writes_what_finished_and_exits_130(tmp_path, monkeypatch, capsys, where):
    """KeyboardInterrupt inside a section: the sections before it are in both files, it and the later ones are
    listed as missing with the reason, and the exit code is 130."""
    def interrupt(name):
        if name == where:
            raise KeyboardInterrupt
    _cheap_sections(monkeypatch, interrupt)
    assert fr.main(["--out", str(tmp_path)]) == 130
    out = capsys.readouterr().out
    report, md = _written(out, tmp_path)
    done = list(fr.SECTIONS[:fr.SECTIONS.index(where)])
    later = list(fr.SECTIONS[fr.SECTIONS.index(where) + 1:])
    assert report["status"] == "interrupted" and list(report["sections"]) == done
    assert all(report["sections"][n]["status"] == "ok" for n in done)
    assert list(report["missing"]) == [where] + later
    assert report["missing"][where].startswith("stopped (Ctrl-C) while it ran, after ")
    assert all(report["missing"][n] == fr.INTERRUPTED for n in later)
    assert f"stopped (Ctrl-C) in {where}: writing what finished" in out
    assert f"missing: {', '.join([where] + later)}." in out
    assert "missing sections (interrupted): " + where + ": stopped (Ctrl-C) while it ran" in md
    assert md.count("**Missing:**") == 1 + len(later)
    positions = [md.index(h) for h in HEADINGS]
    assert positions == sorted(positions), "every heading, the missing sections' too"


def test_ctrl_c_in_the_benchmark_keeps_the_runs_it_finished(tmp_path, monkeypatch, capsys):
    """The long sections keep what they finished: Ctrl-C during the benchmark's second input kind leaves the
    first kind's timed run in both files, the section marked 'interrupted', and exit code 130."""
    monkeypatch.setattr(fr, "CASES", SMALL_CASES[:1])
    real_bench = fr.bench.bench_shape

    def bench(shape, device, backends, reps, warmup, kind):
        if kind != fr.bench.INPUT_KINDS[0]:
            raise KeyboardInterrupt
        return real_bench(shape, device, backends, reps, warmup, kind)
    monkeypatch.setattr(fr.bench, "bench_shape", bench)
    assert fr.main(["--out", str(tmp_path)]) == 130
    report, md = _written(capsys.readouterr().out, tmp_path)
    sec = report["sections"]["benchmark"]
    assert sec["status"] == "interrupted" and [r["inputs"] for r in sec["data"]["runs"]] == ["standard"]
    rows = {r["backend"]: r for r in sec["data"]["runs"][0]["rows"]}
    assert rows["sdpa"]["cos"] > 0.9999 and rows["reference"]["ms"] is not None
    assert report["missing"]["benchmark"].startswith("stopped (Ctrl-C) while it ran, after ")
    assert report["missing"]["benchmark"].endswith("what it had finished is kept")
    assert report["missing"]["auto"] == fr.INTERRUPTED and "auto" not in report["sections"]
    assert report["sections"]["self_check"]["status"] == "ok"
    part = md[md.index("## Kernel time and accuracy against SDPA"):md.index("## What auto chose")]
    assert "**Part of it:** stopped (Ctrl-C)" in part and "| tiny | reference |" in part
    assert "**Missing:** " + fr.INTERRUPTED in md[md.index("## What auto chose"):]


def test_ctrl_c_in_the_self_check_keeps_the_targets_before_it(tmp_path, monkeypatch, capsys):
    """On the CPU the four quantized kernels are 'not available' before the spec's check runs; Ctrl-C in that
    check keeps them, and shows the target it hit as 'interrupted'."""
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(fr, "run_self_check", stopped)
    assert fr.main(["--out", str(tmp_path)]) == 130
    report, md = _written(capsys.readouterr().out, tmp_path)
    sec = report["sections"]["self_check"]
    assert sec["status"] == "interrupted"
    assert [t["status"] for t in sec["data"]] == ["not available"] * len(fr.QUANTIZED) + ["interrupted"]
    assert sec["data"][-1]["kernel"] == "reference (the spec, CPU)"
    assert list(report["missing"]) == ["self_check", "hip_code_path", "hip_pv_chain", "benchmark", "auto"]
    assert "| reference (the spec, CPU) | torch prologue, per-token INT8, smooth_k on | interrupted |" in md


def test_ctrl_c_between_sections_still_writes(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the files are being rewritten (outside any section) is caught by main: the last complete
    state, marked interrupted, and 130."""
    _cheap_sections(monkeypatch)
    real = fr.ReportFiles.write_quietly
    calls = []

    def write_quietly(self, report, say):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, report, say)
    monkeypatch.setattr(fr.ReportFiles, "write_quietly", write_quietly)
    assert fr.main(["--out", str(tmp_path)]) == 130
    report, md = _written(capsys.readouterr().out, tmp_path)
    assert report["status"] == "interrupted" and list(report["sections"]) == list(fr.SECTIONS[:2])
    assert report["missing"] == {n: fr.INTERRUPTED for n in fr.SECTIONS[2:]}


def test_a_failed_write_mid_run_does_not_stop_the_sections(tmp_path, monkeypatch, capsys):
    """A full disk after the start: the sections go on, each write tries again, and the exit code says it failed."""
    _cheap_sections(monkeypatch)
    real = fr.ReportFiles.write
    calls = []

    def write(self, report):
        calls.append(len(report["sections"]))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(self, report)
    monkeypatch.setattr(fr.ReportFiles, "write", write)
    assert fr.main(["--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert calls == list(range(len(fr.SECTIONS) + 1))  # the start, then after every section
    assert out.count("could not write the report files: [Errno 28] No space left on device") == 1  # said once
    assert err == "field_report.py: error: could not write the report files: [Errno 28] No space left on device\n"


def test_libraries_on_rocm_name_what_was_found_and_what_was_not(monkeypatch):
    """Under ROCm PyTorch: the HIP runtime's path and version as the loader opened it, and hiprtc's refusal
    (with what was tried) when it is missing."""
    from types import SimpleNamespace

    from comfyui_sage_rdna4.kernels.backends.hip import compiler, runtime
    rt = SimpleNamespace(library="/opt/rocm/lib/libamdhip64.so.7", version=lambda: "hip-70051")
    monkeypatch.setattr(runtime, "runtime_kind", lambda: "hip")
    monkeypatch.setattr(runtime, "runtime_unavailable_reason", lambda kind=None: None)
    monkeypatch.setattr(runtime, "get_runtime", lambda kind=None: rt)
    monkeypatch.setattr(compiler, "compiler_unavailable_reason",
                        lambda kind: f"{kind}: hiprtc not found; tried: libhiprtc.so.7")
    monkeypatch.setattr(compiler, "hiprtc_candidates", lambda: [__file__, "libhiprtc.so.7"])
    got = fr.libraries_section(torch.device("cpu"))
    assert got["runtime_kind"] == "hip"
    assert got["runtime"] == {"found": True, "path": "/opt/rocm/lib/libamdhip64.so.7", "version": "hip-70051"}
    assert got["compiler"] == {"kind": "hiprtc", "found": False,
                               "reason": "hiprtc: hiprtc not found; tried: libhiprtc.so.7"}
    assert got["hiprtc_on_disk"] == [__file__]  # only candidates that exist as files
