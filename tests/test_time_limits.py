"""Every test runs under a time limit (pytest-timeout): pyproject.toml's default, a larger one for tests marked
slow (tests/conftest.py), and the GPU fuzz's own. A test past its limit fails and the run goes on, so
`pytest -m gpu tests` and CI end even when a kernel hangs. CI must have the plugin; a developer without it
gets a skip and a line in pytest's header."""
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[1]


def _plugin_or_skip():
    if importlib.util.find_spec("pytest_timeout") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("pytest-timeout is not installed in CI's environment (requirements-test.txt lists it)")
        pytest.skip("pytest-timeout is not installed: python -m pip install -r requirements-test.txt")


def test_the_default_limit_is_set_and_the_plugin_is_required():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pytest_section = pyproject[pyproject.index("[tool.pytest.ini_options]"):].split("\n[", 1)[0]
    assert re.findall(r"^timeout = (\d+)$", pytest_section, re.M) == ["120"]
    required = (ROOT / "requirements-test.txt").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("pytest-timeout>=") for line in required)


def test_the_limit_applies_in_this_run(request):
    _plugin_or_skip()
    assert float(request.config.getini("timeout")) == 120.0


class _Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


def _item(*names, timeout=None):
    marks = [getattr(pytest.mark, n).mark for n in names]
    if timeout is not None:
        marks.append(pytest.mark.timeout(timeout).mark)
    return _Item(keywords={n: True for n in names}, marks=marks)


def test_slow_tests_get_the_larger_limit_unless_they_set_their_own(monkeypatch):
    monkeypatch.setenv("COMFYUI_PATH", "")
    items = {"default": _item(), "slow": _item("slow"), "slow_own": _item("slow", timeout=900),
             "own": _item(timeout=30)}
    conftest.pytest_collection_modifyitems(SimpleNamespace(), list(items.values()))

    def limit(name):
        mark = items[name].get_closest_marker("timeout")
        return mark.args[0] if mark else None
    assert (limit("default"), limit("slow"), limit("slow_own"), limit("own")) == \
        (None, conftest.SLOW_TEST_TIMEOUT_S, 900, 30)
    assert conftest.SLOW_TEST_TIMEOUT_S == 1800


def test_a_test_past_its_limit_fails_and_the_run_goes_on(tmp_path):
    """In a separate pytest: a test sleeping 30 s under a 1 s limit fails within seconds, and the test after it
    still runs and passes."""
    _plugin_or_skip()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\n")
    (tmp_path / "test_limit.py").write_text(textwrap.dedent("""
        import time

        def test_runaway():
            time.sleep(30)

        def test_after():
            assert True
    """))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - start
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    assert "Timeout (>1.0s) from pytest-timeout" in run.stdout and "1 failed, 1 passed" in run.stdout, run.stdout
    assert took < 25, took


def test_a_test_stuck_in_c_past_its_limit_ends_the_process_with_tracebacks():
    """pytest-timeout's signal is handled only between bytecodes, so a call that stays in C (here pbkdf2, minutes
    long; a GPU wait on the device) outlives it; conftest's hang guard for GPU tests ends such a run instead, with
    every thread's traceback (where it hung) on stderr."""
    code = textwrap.dedent("""
        import hashlib, sys
        sys.path.insert(0, {tests!r})
        from conftest import hang_guard
        with hang_guard(1.0):
            hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10 ** 9)  # one C call of minutes
        print("finished")
    """).format(tests=str(ROOT / "tests"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0 and "finished" not in proc.stdout
    assert "Timeout" in proc.stderr and "pbkdf2_hmac" not in proc.stdout and "<string>" in proc.stderr


def test_the_hang_guard_reads_each_tests_limit(request):
    _plugin_or_skip()
    marked = SimpleNamespace(get_closest_marker=lambda name: SimpleNamespace(args=(240,)))
    unmarked = SimpleNamespace(get_closest_marker=lambda name: None)
    assert conftest.per_test_limit_s(marked, request.config) == 240.0
    assert conftest.per_test_limit_s(unmarked, request.config) == 120.0
    broken = SimpleNamespace(getini=lambda key: (_ for _ in ()).throw(ValueError("unknown configuration value")))
    assert conftest.per_test_limit_s(unmarked, broken) == 0.0
    assert conftest.GPU_HANG_GRACE_S > 0
