"""benchmark.py, the main job, tells the truth: exit status, usage errors, JSON only when asked, what the
columns mean, CPU figures flagged as no speed claims (issue 12 §2). Small shapes (`tiny`), one repeat."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfyui_sage_rdna4.kernels import benchmark
from comfyui_sage_rdna4.kernels.registry import get_backend

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--shapes", "tiny", "--reps", "1"]


def run_cli(*args, env=None):
    """benchmark.py in its own process, as a user runs it."""
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / "benchmark.py"), *args], capture_output=True, text=True,
                          timeout=300, env=full_env, cwd=str(ROOT))


def main(capsys, *args):
    code = benchmark.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# -- exit status --------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where the HIP backend cannot run")
def test_requested_backend_that_cannot_run_fails_the_run():
    proc = run_cli("--backends", "hip_int8_fp8", *TINY)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "self-check passed" not in proc.stdout
    assert "no quantized backend ran" in proc.stdout
    assert "tiny/hip_int8_fp8 did not run: HIP kernels need" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_every_row_erroring_fails_the_run(capsys, monkeypatch):
    ref = get_backend("reference")

    def broken(*a, **k):
        raise RuntimeError("device lost")
    monkeypatch.setattr(ref, "launch", broken)
    code, out, _ = main(capsys, "--backends", "reference", *TINY)
    assert code == 1
    assert "self-check passed" not in out
    assert "tiny/reference failed: RuntimeError: device lost" in out
    assert "no quantized backend ran" in out


def test_a_wrong_result_fails_the_self_check(capsys, monkeypatch):
    ref = get_backend("reference")
    monkeypatch.setattr(ref, "launch", lambda q, k, v, call, sm_scale, mask: (torch.zeros_like(q), None))
    code, out, _ = main(capsys, "--backends", "reference", *TINY)
    assert code == 1 and "SELF-CHECK FAILED: tiny/reference: cosine" in out and "self-check passed" not in out


def test_one_failing_backend_fails_even_when_another_passes(capsys, monkeypatch):
    code, out, _ = main(capsys, "--backends", "reference,hip_int8_fp16", *TINY)
    if get_backend("hip_int8_fp16").unavailable("cpu", None) is None:
        pytest.skip("hip_int8_fp16 runs on this CPU")
    assert code == 1 and "tiny/hip_int8_fp16 did not run" in out and "self-check passed" not in out


def test_default_cpu_run_lists_what_cannot_run_and_passes_on_the_reference(capsys):
    code, out, _ = main(capsys, *TINY)
    assert code == 0, out
    reason = get_backend("hip_int8_fp8").unavailable("cpu", None)
    assert f"hip_int8_fp8: not available here: {reason}" in out
    assert "self-check passed: reference met the accuracy bounds" in out
    table_rows = [line for line in out.splitlines() if line.startswith("tiny ")]
    assert {line.split()[1] for line in table_rows} == {"sdpa", "reference"}  # the others are listed above it


def test_nothing_quantized_asked_for_is_timing_only(capsys):
    code, out, _ = main(capsys, "--backends", "sdpa", *TINY)
    assert code == 0
    assert "no quantized backend ran (none was asked for)" in out and "self-check passed" not in out


def test_default_run_with_nothing_quantized_available_fails(capsys, monkeypatch):
    ref = get_backend("reference")
    monkeypatch.setattr(ref, "_disabled", {("cpu", None): "reference disabled on cpu: self-check failed: NaN"})
    code, out, _ = main(capsys, *TINY)
    assert code == 1
    assert "reference: not available here: reference disabled on cpu: self-check failed: NaN" in out
    assert "no quantized backend ran: none is available on this device" in out


# -- usage errors: one line, no traceback ----------------------------------------------------------------

def test_bad_arguments_give_one_line_in_a_real_process():
    for args, words in ((["--reps", "0"], "--reps: must be a whole number >= 1, got 0"),
                        (["--device", "foo"], "--device: 'foo' is not a device")):
        proc = run_cli(*args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--reps", "0"], "must be a whole number >= 1, got 0"),
    (["--reps", "-1"], "must be a whole number >= 1, got -1"),
    (["--reps", "three"], "must be a whole number >= 1, got 'three'"),
    (["--device", "foo"], "'foo' is not a device"),
    (["--device", "mps"], "only cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--shapes", "nope"], "unknown ['nope']"),
    (["--backends", "hip,reference"], "unknown ['hip']"),
    (["--inputs", "peaky"], "unknown 'peaky'"),
])
def test_bad_arguments_are_one_line_errors(capsys, args, words):
    with pytest.raises(SystemExit) as exc:
        benchmark.main(args)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err and "(see --help)" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "torch sees no GPU here" in err and "use --device cpu" in err and len(err.strip().splitlines()) == 1


def test_reps_are_used_as_given(capsys):
    code, out, _ = main(capsys, "--backends", "sdpa", "--device", "cpu", "--shapes", "tiny", "--reps", "2")
    assert "2 timed repeats per backend" in out


# -- JSON only when asked --------------------------------------------------------------------------------

def test_no_json_on_stdout_unless_asked(capsys):
    _, out, _ = main(capsys, "--backends", "sdpa", *TINY)
    assert not any(line.lstrip().startswith("{") for line in out.splitlines())


def test_json_dash_is_pure_json_on_stdout_with_the_table_on_stderr():
    proc = run_cli("--backends", "reference", "--json", "-", *TINY)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verdict"]["passed"] is True and doc["verdict"]["quantized_backends_run"] == ["reference"]
    assert {r["backend"] for r in doc["rows"]} == {"sdpa", "reference"}
    row = next(r for r in doc["rows"] if r["backend"] == "reference")
    assert row["ms_min"] <= row["ms"] <= row["ms_max"] and row["reps"] == 1
    # host time per call: on the CPU the very same wall time as ms, in microseconds
    for r in doc["rows"]:
        assert r["host_us"] == pytest.approx(r["ms"] * 1e3)
    assert "self-check passed" in proc.stderr and "/sdpa" in proc.stderr


def test_json_path_writes_a_file(capsys, tmp_path):
    path = tmp_path / "results.json"
    code, out, _ = main(capsys, "--backends", "hip_int8_fp8", "--json", str(path), *TINY)
    doc = json.loads(path.read_text())
    assert f"results written to {path}" in out and not out.lstrip().startswith("{")
    if code == 1:
        assert doc["verdict"]["passed"] is False and doc["verdict"]["problems"]


def _no_run(monkeypatch):
    """bench_shape that records being called: a bad --json PATH must stop before any benchmark runs."""
    calls = []
    monkeypatch.setattr(benchmark, "bench_shape", lambda *a, **k: calls.append(a) or [])
    return calls


@pytest.mark.parametrize("where, words", [
    (lambda tmp: tmp / "no-such-folder" / "r.json", "folder does not exist"),
    (lambda tmp: tmp, "is a folder"),
    (lambda tmp: tmp / "file.txt" / "r.json", "is not a folder"),
], ids=["missing-folder", "a-folder", "under-a-file"])
def test_json_path_that_cannot_be_written_is_refused_before_the_run(capsys, monkeypatch, tmp_path, where, words):
    (tmp_path / "file.txt").write_text("x")
    calls = _no_run(monkeypatch)
    path = where(tmp_path)
    with pytest.raises(SystemExit) as exc:
        benchmark.main(["--backends", "reference", "--json", str(path), *TINY])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert calls == [] and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "argument --json" in lines[0] and str(path) in lines[0] and words in lines[0], lines[0]


def test_json_path_in_a_read_only_folder_is_refused_before_the_run(capsys, monkeypatch, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root writes anywhere: let the OS answer as it would a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if (mode & os.W_OK and os.path.abspath(p)
                                                                         == str(folder)) else real(p, mode, **k))
    calls = _no_run(monkeypatch)
    try:
        with pytest.raises(SystemExit) as exc:
            benchmark.main(["--backends", "reference", "--json", str(folder / "r.json"), *TINY])
    finally:
        folder.chmod(0o755)
    assert exc.value.code == 2 and calls == []
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not writable" in err


def test_json_path_unwritable_in_a_real_process_is_one_line(tmp_path):
    proc = run_cli("--backends", "reference", "--json", str(tmp_path / "missing" / "r.json"), *TINY)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "argument --json" in proc.stderr


# -- what the numbers mean -------------------------------------------------------------------------------

def test_help_explains_the_columns_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for words in ("/sdpa", "/best", "above 1 = slower", "fastest SDPA variant", "Exit status", "not speed claims",
                  "TRITON_INTERPRET=1", "--json PATH", "host_us", "without waiting for the GPU",
                  "On the CPU there is no separate device"):
        assert words in text, words


def test_the_columns_are_explained_above_the_table_and_cpu_figures_are_flagged(capsys):
    _, out, _ = main(capsys, "--backends", "reference", *TINY)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("shape "))
    above = "\n".join(lines[:header])
    assert "/sdpa = " in above and "/best = " in above and "above 1 = slower" in above
    assert "not speed claims" in above
    assert "[fastest-slowest]" in lines[header]
    assert "host_us = " in above and "without waiting for the GPU" in above and "same wall" in above
    columns = lines[header].split()
    assert columns.index("host_us") == columns.index("[fastest-slowest]") + 1  # beside the device time
    row = next(line for line in lines[header + 1:] if line.startswith("tiny ") and " reference " in line)
    host_us, ms = float(row.split()[4]), float(row.split()[2])
    assert host_us == pytest.approx(ms * 1e3, rel=1e-3, abs=0.1)  # on the CPU: the same wall time


def test_sm_clock_is_read_where_it_can_be_and_shown_beside_the_time(capsys, monkeypatch):
    """The MHz column: the clock torch reads (NVML / amdsmi) while the repeats ran, '-' where none can be read."""
    assert benchmark.sm_clock_mhz(torch.device("cpu")) is None
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1755)
    assert benchmark.sm_clock_mhz(cuda) == 1755.0

    def missing(device=None):
        raise ModuleNotFoundError("pynvml")
    monkeypatch.setattr(torch.cuda, "clock_rate", missing)
    assert benchmark.sm_clock_mhz(cuda) is None  # no NVML / amdsmi: no figure, never an error
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 0)
    assert benchmark.sm_clock_mhz(cuda) is None
    row = dict(status="ok", shape="s", backend="x", ms=1.0, ms_min=0.9, ms_max=1.1, host_us=50.0, clock_mhz=1899.4,
               vs_sdpa=0.95, vs_best_sdpa=0.95, cos=0.9999, rel_l1=0.002, quantized=True, finite=True)
    header, line = benchmark.format_table([row]).splitlines()
    assert header.split().index("MHz") == header.split().index("host_us") + 1
    assert line.split()[header.split().index("MHz")] == "1899"
    _, no_clock = benchmark.format_table([dict(row, clock_mhz=None)]).splitlines()
    assert no_clock.split()[header.split().index("MHz")] == "-"
    _, out, _ = main(capsys, "--backends", "reference", *TINY)
    assert "MHz = " in out and "power cap" in out  # explained above the table


@pytest.mark.gpu
def test_sm_clock_is_read_on_an_nvidia_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    if torch.version.hip is None:
        pytest.importorskip("pynvml")
    x = torch.randn(4096, 4096, device="cuda")
    t = benchmark.time_ms(lambda: [x @ x for _ in range(20)], torch.device("cuda"), reps=3)
    assert t.clock_mhz is not None and 100 < t.clock_mhz < 5000


def test_cpu_defaults_to_more_repeats_than_before_and_shows_the_range(capsys, monkeypatch):
    seen = {}

    def fake_bench(shape, device, backends, reps, warmup=2, inputs="standard", smooth_v=False, with_auto=False):
        seen["reps"] = reps
        return [{"backend": "sdpa", "status": "ok", "ms": 2.0, "ms_min": 1.0, "ms_max": 9.0, "reps": reps,
                 "cos": 1.0, "rel_l1": 0.0, "quantized": False, "finite": True, "shape": shape.name,
                 "vs_sdpa": 1.0, "vs_best_sdpa": 1.0}]
    monkeypatch.setattr(benchmark, "bench_shape", fake_bench)
    _, out, _ = main(capsys, "--backends", "sdpa", "--device", "cpu", "--shapes", "tiny")
    assert seen["reps"] == benchmark.CPU_REPS >= 5
    assert "[1.000-9.000]" in out
    assert "[1.000-9.000]         -" in out  # a row without host time shows '-' in its column


def test_host_time_is_timed_without_waiting_for_the_device():
    """time_ms on the CPU: host time is the wall time itself; its median sits within the range."""
    calls = []
    t = benchmark.time_ms(lambda: calls.append(1), torch.device("cpu"), reps=5, warmup=1)
    assert len(calls) == 6 and t.reps == 5
    assert t.host == t.median and t.low <= t.host <= t.high


def test_triton_under_the_interpreter_on_the_cpu_warns_of_minutes(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(benchmark, "bench_shape", lambda *a, **k: [])  # the warning is the point, not the run
    _, out, _ = main(capsys, "--backends", "triton_int8_fp8", *TINY)
    assert "TRITON_INTERPRET=1" in out and "minutes per call" in out
    monkeypatch.delenv("TRITON_INTERPRET")
    _, out, _ = main(capsys, "--backends", "triton_int8_fp8", *TINY)
    assert "minutes per call" not in out


def test_a_failed_first_use_self_check_fails_even_the_default_run(capsys, monkeypatch):
    """A failed first-use self-check disables the backend (its unavailable() reason): the run fails."""
    hip = get_backend("hip_int8_fp8")
    reason = "hip_int8_fp8 disabled on cpu: self-check failed on D128 fp16: cosine 0.2"
    monkeypatch.setattr(hip, "_disabled", {("cpu", None): reason})
    code, out, _ = main(capsys, *TINY)
    assert code == 1 and "self-check passed" not in out
    assert f"hip_int8_fp8: not available here: {reason}" in out
    assert f"FAILED: hip_int8_fp8 failed its first-use self-check: {reason}" in out
    rows = [{"backend": "hip_int8_fp16", "status": f"skipped: {reason}", "shape": "tiny", "quantized": True}]
    assert benchmark.run_problems(rows, requested=[]) == [f"tiny/hip_int8_fp16 did not run: {reason}"]
    rows[0]["status"] = "skipped: head_dim 300 is not supported"
    assert benchmark.run_problems(rows, requested=[]) == []  # a refusal in a default run is not a failure


# -- input kinds: diffuse attention and a V channel offset, judged by rel L1 (issue 10) -----------------------

def test_input_kinds_are_what_they_say():
    shape = benchmark.Shape("k", 1, 2, 512, 64, "float32")
    q, k, v = benchmark.make_inputs(shape, torch.device("cpu"), kind="standard")
    dq, dk, dv = benchmark.make_inputs(shape, torch.device("cpu"), kind="diffuse")
    oq, ok, ov = benchmark.make_inputs(shape, torch.device("cpu"), kind="diffuse_voffset")
    logits = lambda a, b: (a @ b.transpose(-1, -2) / 8).std()  # noqa: E731
    assert logits(dq, dk) < 0.6 < logits(q, k)  # near-uniform attention
    assert v.mean(dim=2).abs().max() < 0.3 and dv.mean(dim=2).abs().max() < 0.3
    assert (ov.mean(dim=2) > 1.5).all()  # every channel carries a positive offset


def test_diffuse_voffset_is_judged_by_rel_l1_not_cosine():
    row = dict(status="ok", quantized=True, finite=True, inputs="diffuse_voffset", cos=0.99999, rel_l1=0.05,
               shape="s:diffuse_voffset", backend="x")
    assert "rel L1 0.0500 > 0.02" in benchmark.accuracy_problem(row)  # a 5 % scale loss, invisible to cosine
    assert benchmark.accuracy_problem(dict(row, rel_l1=0.003, cos=0.98)) is None
    assert "cosine" in benchmark.accuracy_problem(dict(row, inputs="standard", cos=0.98, rel_l1=0.01))
    assert benchmark.accuracy_problem(dict(row, quantized=False, rel_l1=0.5)) is None


def test_regional_voffset_inputs_are_what_they_say():
    """Each query weighs its own run of keys most (~0.9), and V's offsets differ between runs, so a global channel
    mean (smooth_v) cannot take them out: the case that broke FP8 "mma" accumulation with smooth_v on the H200."""
    shape = benchmark.Shape("r", 1, 2, 2048, 64, "float32")
    q, k, v = benchmark.make_inputs(shape, torch.device("cpu"), kind="regional_voffset")
    again = benchmark.make_inputs(shape, torch.device("cpu"), kind="regional_voffset")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))  # deterministic per seed
    p = torch.softmax(q @ k.transpose(-1, -2) / 8, dim=-1)
    run = torch.arange(2048) * benchmark.REGIONS // 2048
    own = (p * (run[:, None] == run[None, :])).sum(-1)
    assert 0.8 < float(own.mean()) < 0.95 and float(p.max()) < 0.1  # mostly its own run, yet diffuse within it
    run_means = v.reshape(1, 2, benchmark.REGIONS, -1, 64).mean(dim=3)  # (B, H, runs, D)
    residual = run_means - v.mean(dim=2, keepdim=True)  # what is left after smooth_v's global mean
    assert float(residual.abs().mean()) > 1.5
    row = dict(status="ok", quantized=True, finite=True, inputs="regional_voffset", cos=0.99999, rel_l1=0.05,
               shape="s:regional_voffset", backend="x")
    assert "rel L1 0.0500 > 0.02" in benchmark.accuracy_problem(row)
    assert benchmark.accuracy_problem(dict(row, rel_l1=0.003, cos=0.98)) is None  # cosine does not judge it


def test_inputs_and_smooth_v_reach_the_rows(capsys):
    code, out, _ = main(capsys, *TINY, "--backends", "reference", "--inputs", "diffuse_voffset", "--smooth-v")
    assert code == 0, out
    assert "tiny:diffuse_voffset" in out and "smooth_v" in out
