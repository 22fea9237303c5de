"""The real `HipRuntime` against a fake two-device libamdhip64 (issue 12, section 5): fakes.FakeHip, made of
ctypes callbacks, so HipRuntime binds it and calls it through ctypes exactly as it calls the real library. It
checks what clr checks or does (the current device per thread; a module belongs to the device current when it
was loaded, and clr aborts on a function lookup or launch with another device current; a launch on the NULL
stream runs on the current device; the image is read again at launch), and records every breach instead of
aborting the process as clr would.
"""
import ctypes
import gc
import os
import threading
import types

import pytest
import torch

from comfyui_sage_rdna4.kernels import disk_cache
from comfyui_sage_rdna4.kernels.backends.hip import compiler, platform, runtime
from fakes import SIDE_STREAM_1, STREAMS, FakeCompiler, FakeHip, fake_image

SRC = compiler.SourceBundle("k.hip", 'extern "C" __global__ void k_add() {}')


@pytest.fixture
def fake(monkeypatch):
    lib = FakeHip()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        cuda_stream=STREAMS[torch.cuda.current_device() if device is None else device]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: lib.current)
    return lib


@pytest.fixture
def loader(fake, tmp_path):
    return runtime.KernelLoader(runtime.HipRuntime(lib=fake), FakeCompiler(entries=("k_add", "k_scale")),
                                disk_cache.EntryStore(disk_cache.HIP_CODE_OBJECTS, str(tmp_path)))


def device_calls(fake):
    return [(api, dev) for api, dev, _ in fake.calls]


def in_worker(fn):
    """Run fn in a fresh thread (its current device starts at 0, as in a ComfyUI worker); re-raise its error."""
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=body, name="worker")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_fake_flags_what_clr_would_abort_on(fake):
    """The fake itself: a get_function or launch with the wrong device current is recorded."""
    handle = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(fake_image(["k_add"]))
    fake._set_device(1)
    assert fake.hipModuleLoadData(ctypes.byref(handle), ctypes.cast(buf, ctypes.c_void_p)) == 0
    fake._set_device(0)
    fn = ctypes.c_void_p()
    fake.hipModuleGetFunction(ctypes.byref(fn), handle, b"k_add")
    assert fake.violations and "clr aborts" in fake.violations[0]


def test_every_device_call_runs_on_the_tensors_device_and_restores(fake, loader):
    """A worker thread on device 0 runs a kernel for a tensor on device 1: load, get_function and launch
    all see device 1 current; the thread is back on device 0 after each."""
    def work():
        assert fake.current == 0
        kern = loader.kernel(1, SRC, "k_add", ["i32"])
        assert fake.current == 0
        kern((2,), (64,), [7])
        assert fake.current == 0
        return kern

    kern = in_worker(work)
    assert fake.violations == []
    assert device_calls(fake) == [("hipModuleLoadData", 1), ("hipModuleGetFunction", 1), ("hipModuleLaunchKernel", 1)]
    (launch,) = fake.launches
    assert launch["device"] == 1 and launch["stream"] == SIDE_STREAM_1 and launch["first_arg"] == 7
    assert kern.module.device_index == 1


def test_null_stream_launch_goes_to_the_tensors_device(fake, loader):
    """Device 0's current torch stream is its default (handle 0): the NULL stream of the *current* device."""
    fake._set_device(1)  # the caller sits on device 1, the tensor is on device 0
    kern = loader.kernel(0, SRC, "k_add", ["i32"])
    kern((1,), (32,), [3])
    assert fake.current == 1
    assert fake.violations == []
    assert [(l["device"], l["stream"]) for l in fake.launches] == [(0, 0)]


def test_modules_are_loaded_and_kept_per_device(fake, loader):
    k0 = loader.kernel(0, SRC, "k_add", ["i32"])
    k1 = loader.kernel(1, SRC, "k_add", ["i32"])
    assert k0.module is not k1.module and k0.module.handle.value != k1.module.handle.value
    assert sorted(m["device"] for m in fake.modules.values()) == [0, 1]
    assert loader.kernel(1, SRC, "k_add", ["i32"]) is k1  # cached per device
    k1b = loader.kernel(1, SRC, "k_scale", ["i32"])
    assert k1b.module is k1.module  # one module per device and source, many functions
    assert loader.compiler.compiles == 1  # one code object serves both devices (same target)
    for kern in (k1, k0, k1b):
        kern((1,), (32,), [1])
    assert [l["device"] for l in fake.launches] == [1, 0, 1]
    assert fake.violations == []


def test_run_launches_uses_the_tensor_device_and_its_stream(fake, loader):
    plan = [types.SimpleNamespace(kernel="k_add", grid=(4, 1, 1), block=(64, 1, 1), args=[("i32", 5)],
                                  shared_bytes=0),
            types.SimpleNamespace(kernel="k_scale", grid=(1, 1, 1), block=(64, 1, 1), args=[("i32", 6)],
                                  shared_bytes=0)]
    in_worker(lambda: runtime.run_launches(1, SRC, plan, loader=loader))
    assert fake.violations == []
    assert [(l["name"], l["device"], l["stream"], l["first_arg"]) for l in fake.launches] == [
        ("k_add", 1, SIDE_STREAM_1, 5), ("k_scale", 1, SIDE_STREAM_1, 6)]
    assert {dev for _, dev in device_calls(fake)} == {1}
    assert fake.current == 0  # this thread never moved


def test_device_none_means_torchs_current_device(fake, loader):
    fake._set_device(1)
    plan = [types.SimpleNamespace(kernel="k_add", grid=(1,), block=(32,), args=[("i32", 1)], shared_bytes=0)]
    runtime.run_launches(None, SRC, plan, loader=loader)
    assert [l["device"] for l in fake.launches] == [1] and fake.violations == []


def test_code_object_buffer_lives_as_long_as_the_module(fake, loader):
    """clr keeps the image pointer; the bytes must still be there at launch, after the loader returned."""
    kern = loader.kernel(1, SRC, "k_add", ["i32"])
    ((mod_handle, record),) = fake.modules.items()
    assert kern.module.handle.value == mod_handle
    assert ctypes.addressof(kern.module.image) == record["ptr"]  # the buffer clr holds is the module's
    gc.collect()
    junk = [ctypes.create_string_buffer(b"\xee" * record["size"]) for _ in range(64)]  # reuse any freed block
    kern((1,), (32,), [0])
    del junk
    assert fake.violations == []
    assert ctypes.string_at(record["ptr"], record["size"]) == record["bytes"]


def test_device_is_restored_when_a_call_fails(fake, loader):
    with pytest.raises(runtime.LaunchError, match="hipModuleGetFunction\\(no_such_kernel\\)"):
        loader.kernel(1, SRC, "no_such_kernel", [])
    assert fake.current == 0 and fake.violations == []
    rt = loader.runtime
    with pytest.raises(runtime.LaunchError, match="hipSetDevice\\(5\\)"):
        rt.launch(None, (1,), (1,), 0, 0, (ctypes.c_void_p * 1)(), 5)
    assert fake.current == 0
    with pytest.raises(ZeroDivisionError):
        with rt.device_scope(1):
            assert fake.current == 1
            raise ZeroDivisionError("raised inside the device scope")
    assert fake.current == 0


def test_no_set_device_when_already_current(fake):
    rt = runtime.HipRuntime(lib=fake)
    calls = []
    real_set = rt._set_device
    rt._set_device = lambda d: calls.append(d) or real_set(d)
    with rt.device_scope(0):
        pass
    assert calls == []
    with rt.device_scope(1):
        pass
    assert calls == [1, 0]


# -- which libamdhip64, when two are mapped ---------------------------------------------------------

MAPS_LINE = "7f0000000000-7f0000001000 r-xp 00000000 08:01 1234                       {}\n"


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


def test_mapped_paths_keep_maps_order_and_skip_anonymous_and_deleted(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("".join(MAPS_LINE.format(p) for p in [
        "/opt/rocm/lib/libamdhip64.so.7", "[heap]", "/x/torch/lib/libamdhip64.so", "",
        "/opt/rocm/lib/libamdhip64.so.7", "/old/libamdhip64.so.6 (deleted)", "/dir with space/libfoo.so"]))
    assert platform.mapped_paths(str(maps)) == ["/opt/rocm/lib/libamdhip64.so.7", "/x/torch/lib/libamdhip64.so",
                                                "/dir with space/libfoo.so"]
    assert platform.mapped_paths(str(tmp_path / "absent")) == []


@pytest.fixture
def two_hips(tmp_path, monkeypatch):
    """A process that mapped /opt/rocm's libamdhip64 (first in address and sorted order) and torch's."""
    torch_lib = tmp_path / "site" / "torch" / "lib"
    wheel_lib = tmp_path / "site" / "_rocm_sdk_core" / "lib"
    system = _touch(tmp_path / "opt" / "rocm" / "lib" / "libamdhip64.so.7")
    torchs = _touch(torch_lib / "libamdhip64.so")
    wheels = _touch(wheel_lib / "libamdhip64.so.7")
    monkeypatch.setattr(platform, "torch_lib_dir", lambda: str(torch_lib))
    monkeypatch.setattr(platform, "rocm_wheel_dirs", lambda: [str(wheel_lib)])
    monkeypatch.setattr(runtime, "torch_lib_dir", lambda: str(torch_lib))
    monkeypatch.setattr(runtime, "rocm_wheel_dirs", lambda: [str(wheel_lib)])
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    return types.SimpleNamespace(system=system, torch=torchs, wheel=wheels, torch_lib=torch_lib)


def _map(monkeypatch, paths):
    monkeypatch.setattr(platform, "mapped_paths", lambda maps_file="/proc/self/maps": list(paths))


def test_the_copy_in_torchs_lib_folder_wins(two_hips, monkeypatch):
    _map(monkeypatch, [two_hips.system, "/usr/lib/libc.so.6", two_hips.torch])
    assert platform.loaded_library_paths("libamdhip64.so") == [two_hips.system, two_hips.torch]  # maps order
    assert runtime.hip_library_candidates()[0] == two_hips.torch
    assert runtime.hip_library_candidates()[1] == two_hips.system  # still a candidate, after it


def test_the_rocm_sdk_wheel_copy_beats_a_system_one(two_hips, monkeypatch):
    _map(monkeypatch, [two_hips.system, two_hips.wheel])
    assert runtime.hip_library_candidates()[:2] == [two_hips.wheel, two_hips.system]
    _map(monkeypatch, [two_hips.wheel, two_hips.system, two_hips.torch])
    assert runtime.hip_library_candidates()[:3] == [two_hips.torch, two_hips.wheel, two_hips.system]


def test_a_torch_lib_link_into_rocm_counts_as_torchs(two_hips, tmp_path, monkeypatch):
    """torch/lib/libamdhip64.so -> /opt/rocm-7.1/lib/libamdhip64.so.7 is mapped under the target's name."""
    target = _touch(tmp_path / "opt" / "rocm-7.1" / "lib" / "libamdhip64.so.7")
    link = two_hips.torch_lib / "libamdhip64.so"
    link.unlink()
    link.symlink_to(target)
    _map(monkeypatch, [two_hips.system, target])
    assert runtime.hip_library_candidates()[0] == target


def test_others_keep_maps_order(two_hips, tmp_path, monkeypatch):
    other = _touch(tmp_path / "a" / "libamdhip64.so.6")
    _map(monkeypatch, [two_hips.system, other])
    assert runtime.hip_library_candidates()[:2] == [two_hips.system, other]  # not sorted by name


def test_hiprtc_is_looked_for_beside_torchs_hip_first(two_hips, monkeypatch):
    torch_rtc = _touch(two_hips.torch_lib / "libhiprtc.so")
    system_rtc = os.path.join(os.path.dirname(two_hips.system), "libhiprtc.so.7")
    open(system_rtc, "wb").close()
    _map(monkeypatch, [two_hips.system, two_hips.torch])
    monkeypatch.setattr(compiler, "torch_lib_dir", lambda: str(two_hips.torch_lib))
    monkeypatch.setattr(compiler, "rocm_wheel_dirs", lambda: [])
    monkeypatch.setattr(compiler.sys, "platform", "linux")
    files = [p for p in compiler.hiprtc_candidates() if "/" in p]
    assert files.index(torch_rtc) < files.index(system_rtc)
