"""The Triton backend's host shortcuts, on the CPU with stand-ins for the GPU parts: when the direct launch
reuses a compiled kernel and when it goes back to Triton's own path, and how the kept prologue workspace is
keyed and bounded. tests/test_triton_launch_gpu.py checks the same on a GPU against Triton itself."""
import types

import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels import settings  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton import launcher, workspace  # noqa: E402
from fakes import FakeJit  # noqa: E402


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.delenv(settings.TRITON_LAUNCH.name, raising=False)
    monkeypatch.setattr(launcher, "_triton_version", lambda: launcher.SUPPORTED_TRITON[0])
    # Triton 3.6 keeps each hook as a chain of calls, empty unless a profiler installs one
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                  launch_exit_hook=types.SimpleNamespace(calls=[]))

    def make(fn):
        runner = launcher.DirectLauncher(fn)
        runner._knobs = types.SimpleNamespace(runtime=hooks)
        runner._driver = types.SimpleNamespace(active=types.SimpleNamespace(
            get_current_device=lambda: 0, get_current_stream=lambda device: 1234))
        return runner
    make.hooks = hooks
    return make


def test_the_first_launch_of_a_specialization_goes_through_triton_then_direct(direct):
    fn = FakeJit()
    runner = direct(fn)
    meta = {"A": 3, "B": True, "num_warps": 4}
    runner((5, 2), ("x", 7), meta, key=("k",))
    assert len(fn.slow) == 1 and fn.runs == []
    runner((5, 2), ("y", 7), meta, key=("k",))
    assert len(fn.slow) == 1
    # grid padded to 3-D, the current stream, the kernel's handles, no hooks, runtime args then constexprs in order
    assert fn.runs == [(5, 2, 1, 1234, "fn-handle", "packed", None, None, None, "y", 7, 3, True)]


def test_a_new_key_or_a_new_meta_goes_back_to_triton(direct):
    fn = FakeJit()
    runner = direct(fn)
    meta = {"A": 3, "B": True}
    runner((1,), ("x", 7), meta, key="a")
    runner((1,), ("x", 7), meta, key="b")
    runner((1,), ("x", 7), dict(meta), key="a")  # an equal but different plan's meta: not trusted
    assert len(fn.slow) == 3 and fn.runs == []


def test_a_launch_hook_or_the_environment_keeps_tritons_own_path(direct, monkeypatch):
    fn = FakeJit()
    runner = direct(fn)
    meta = {"A": 1, "B": False}
    runner((1,), ("x", 1), meta, key=None)
    direct.hooks.launch_enter_hook.calls.append(print)  # a profiler is watching launches
    runner((1,), ("x", 1), meta, key=None)
    direct.hooks.launch_enter_hook = None  # a Triton that keeps no chain: None is no hook
    runner((1,), ("x", 1), meta, key=None)
    direct.hooks.launch_exit_hook = print  # nor a chain: a plain callable is a hook
    runner((1,), ("x", 1), meta, key=None)
    assert len(fn.slow) == 3 and len(fn.runs) == 1
    monkeypatch.setenv(settings.TRITON_LAUNCH.name, "triton")
    runner = direct(FakeJit())
    assert "triton" in runner.refusal


def test_unsupported_triton_or_parameter_order_is_refused(monkeypatch):
    monkeypatch.delenv(settings.TRITON_LAUNCH.name, raising=False)
    monkeypatch.setattr(launcher, "_triton_version", lambda: (3, 2))
    assert "3.6" in launcher.DirectLauncher(FakeJit()).refusal
    monkeypatch.setattr(launcher, "_triton_version", lambda: launcher.SUPPORTED_TRITON[0])
    assert launcher.DirectLauncher(FakeJit()).refusal == ""
    assert "constexpr" in launcher.DirectLauncher(FakeJit(constexpr_first=True)).refusal


def test_anything_but_a_compiled_kernel_is_launched_as_usual():
    fn = FakeJit()  # not a JITFunction: the interpreter's kernels and test stand-ins are called as they are
    launcher.launch(fn, (2,), ("x", 1), {"A": 1, "B": 2}, key=None)
    launcher.launch(fn, (2,), ("x", 1), {"A": 1, "B": 2}, key=None)
    assert len(fn.slow) == 2 and fn not in launcher._LAUNCHERS


def test_tensor_key_sees_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.float16)
    assert launcher.tensor_key(base) == (torch.float16, True)
    assert launcher.tensor_key(base[1:]) == (torch.float16, False)  # 2 bytes off
    assert launcher.tensor_key(base[8:]) == (torch.float16, True)   # 16 bytes off


# -- workspace ------------------------------------------------------------------------------------------------
class Buffers:
    def __init__(self, *tensors):
        self._t = tensors

    def tensors(self):
        return self._t


@pytest.fixture
def cuda_like(monkeypatch):
    """A 'cuda' device for the cache's keying on a CPU machine: a settable stream, no graph capture."""
    state = types.SimpleNamespace(stream=1, capturing=False)
    monkeypatch.setattr(workspace, "current_stream", lambda index: state.stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    return state


def make_counter(nbytes=1024):
    made = []

    def make():
        made.append(Buffers(torch.empty(nbytes, dtype=torch.uint8)))
        return made[-1]
    return made, make


def test_workspace_is_kept_per_signature_stream_and_thread(cuda_like):
    cache = workspace.WorkspaceCache(budget=10_000)
    dev = torch.device("cuda", 0)
    made, make = make_counter()
    a = cache.get("sig", dev, make)
    assert cache.get("sig", dev, make) is a and len(made) == 1
    assert cache.get("other", dev, make) is not a
    cuda_like.stream = 2
    assert cache.get("sig", dev, make) is not a  # another stream: its own
    cuda_like.stream = 1
    cuda_like.capturing = True
    assert cache.get("sig", dev, make) is not a  # never handed out while a graph is captured
    assert cache.get("sig", torch.device("cpu"), make) is not a  # CPU calls always allocate
    assert len(made) == 5


def test_workspace_budget_evicts_least_recently_used(cuda_like):
    cache = workspace.WorkspaceCache(budget=2500)
    dev = torch.device("cuda", 0)
    made, make = make_counter(1000)
    first = cache.get("a", dev, make)
    cache.get("b", dev, make)
    assert cache.get("a", dev, make) is first  # a is now the most recently used
    cache.get("c", dev, make)                  # 3000 bytes > 2500: b goes
    assert cache.kept_bytes == 2000
    assert cache.get("a", dev, make) is first
    n = len(made)
    cache.get("b", dev, make)
    assert len(made) == n + 1
    too_big = workspace.WorkspaceCache(budget=500)
    too_big.get("a", dev, make)
    assert too_big.kept_bytes == 0
    off = workspace.WorkspaceCache(budget=0)
    off.get("a", dev, make)
    assert off.kept_bytes == 0


def test_workspace_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(settings.WORKSPACE_MB.name, "0")
    assert workspace.budget_bytes() == 0
    monkeypatch.setenv(settings.WORKSPACE_MB.name, "2")
    assert workspace.budget_bytes() == 2 * 2 ** 20
    monkeypatch.setenv(settings.WORKSPACE_MB.name, "lots")
    assert workspace.budget_bytes() == settings.DEFAULT_WORKSPACE_MB * 2 ** 20
