"""tests/triton_prewarm.py, the background compiles of the Triton GPU fuzz's kernels, on the CPU: which tests start
them, the order they leave, and what the run's summary says of processes that finish, fail or are stopped (stand-in
processes; the real one is tests/test_fuzz.py --prewarm-shard, checked in test_fuzz.py)."""
import json
import sys
from types import SimpleNamespace

import pytest
import triton_prewarm


@pytest.fixture
def fresh():
    """The module's record of processes, empty for the test and put back after it."""
    saved, waited = list(triton_prewarm.SHARDS), dict(triton_prewarm.WAITED)
    triton_prewarm.SHARDS.clear()
    triton_prewarm.WAITED.clear()
    yield triton_prewarm
    triton_prewarm.stop_all()
    triton_prewarm.SHARDS[:] = saved
    triton_prewarm.WAITED.clear()
    triton_prewarm.WAITED.update(waited)


def python(code: str):
    """A command factory running `code` with the shard's kernel, index and count in KERNEL, INDEX, COUNT."""
    return lambda kernel, index, count: [sys.executable, "-c", f"KERNEL, INDEX, COUNT = {kernel!r}, {index}, {count}\n"
                                         + code]


def test_only_the_triton_gpu_fuzz_tests_start_processes_and_move_last():
    ids = ["tests/test_autotune.py::test_a", "tests/test_fuzz.py::test_fuzz_gpu[hip_int8_fp8]",
           "tests/test_fuzz.py::test_fuzz_gpu[triton_int8_fp16]", "tests/test_fuzz.py::test_fuzz_cpu[quick]",
           "tests/test_fuzz.py::test_fuzz_gpu[triton_int8_fp8]", "tests/test_triton_gpu.py::test_b[triton_int8_fp8]"]
    assert triton_prewarm.fuzz_kernels(ids) == ["triton_int8_fp16", "triton_int8_fp8"]
    assert triton_prewarm.fuzz_kernels(ids[:2] + ids[3:4]) == []
    items = [SimpleNamespace(nodeid=i) for i in ids]
    assert [i.nodeid for i in triton_prewarm.fuzz_last(items)] == [ids[0], ids[1], ids[3], ids[5], ids[2], ids[4]]


def test_two_processes_per_backend_on_a_16_core_host():
    assert [triton_prewarm.processes_per_kernel(n) for n in (1, 2, 8, 16, 24, 64, 128)] == [1, 1, 1, 2, 3, 4, 4]


def test_finished_processes_are_summed_per_backend(fresh):
    fresh.start(["triton_int8_fp8"], 2, python(
        "import json; print('compiling...')\n"
        "print(json.dumps({'distinct': 9, 'mine': 5 - INDEX, 'compiled': 5 - INDEX, 'collect_s': 1.5 + INDEX,\n"
        "                  'seconds': 30 + INDEX, 'load_1min': 7.5}))"))
    shards = fresh.wait("triton_int8_fp8", timeout=60)
    assert [s.index for s in shards] == [0, 1] and all(s.process.returncode == 0 for s in shards)
    assert [s.result()["compiled"] for s in shards] == [5, 4]
    line, *per_shard = fresh.summary_lines()
    assert line.startswith("[triton prewarm triton_int8_fp8] 2 of 2 processes compiled 9 of 9 kernels; its test "
                           "asked ")
    assert " s after they started and waited " in line
    assert per_shard == [f"[triton prewarm triton_int8_fp8] shard {i}: {5 - i} kernels; its launches collected in "
                         f"{1.5 + i} s, done in {30 + i} s; host load 7.5 at its end" for i in (0, 1)]
    assert fresh.wait("triton_int8_fp16") == []  # a backend no process was started for: nothing to wait for


def test_a_failing_process_is_named_with_its_last_words(fresh):
    fresh.start(["triton_int8_fp16"], 2, python(
        "import json, sys\n"
        "if INDEX == 1: print('Traceback ...'); print('RuntimeError: no CUDA'); sys.exit(3)\n"
        "print(json.dumps({'distinct': 7, 'compiled': 4}))"))
    fresh.wait("triton_int8_fp16", timeout=60)
    lines = fresh.summary_lines()
    assert lines[0].startswith("[triton prewarm triton_int8_fp16] 1 of 2 processes compiled 4 of 7 kernels")
    assert lines[2] == ("[triton prewarm triton_int8_fp16] shard 1: exit status 3: Traceback ... | "
                        "RuntimeError: no CUDA")


def test_a_process_past_the_wait_is_stopped_and_said_so(fresh):
    fresh.start(["triton_int8_fp8"], 1, python("import time; time.sleep(60)"))
    shard, = fresh.wait("triton_int8_fp8", timeout=0.5)
    assert shard.stopped and shard.process.returncode is not None
    assert shard.result()["error"].startswith("stopped after")
    assert fresh.summary_lines()[1].startswith("[triton prewarm triton_int8_fp8] shard 0: stopped after")


def test_the_run_ends_no_process_it_started_outlives(fresh):
    fresh.start(["triton_int8_fp8", "triton_int8_fp16"], 1, python("import time; time.sleep(60)"))
    fresh.stop_all()
    assert all(s.process.returncode is not None and s.stopped for s in fresh.SHARDS)
    assert all("its test never asked" in line for line in fresh.summary_lines() if "processes compiled" in line)


def test_an_unreadable_result_line_is_an_error_not_a_crash(fresh):
    fresh.start(["triton_int8_fp8"], 1, python("print('{not json')"))
    shard, = fresh.wait("triton_int8_fp8", timeout=60)
    assert shard.result() == {"error": "unreadable result line: {not json"}
    assert json.loads(json.dumps(shard.result()))  # the summary can always print it


def test_one_switch_turns_every_prewarm_off(monkeypatch):
    for value, on in (("0", False), (" 0 ", False), ("1", True), ("", True)):
        monkeypatch.setenv("SAGE_TEST_PREWARM", value)
        assert triton_prewarm.enabled() is on
    monkeypatch.delenv("SAGE_TEST_PREWARM")
    assert triton_prewarm.enabled()
