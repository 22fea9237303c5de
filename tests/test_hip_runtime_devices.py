"""The real `HipRuntime` against a fake two-device libamdhip64 (issue 12, section 5).

The fake is made of ctypes callbacks, so HipRuntime binds it and calls it through ctypes exactly as it
calls the real library (argument conversion, byref out-parameters, the image pointer). It checks what
clr checks or does, and records every breach instead of aborting the process as clr would:
  * the current device is per thread, 0 until set;
  * a module belongs to the device current at hipModuleLoadData; hipModuleGetFunction and launches
    with another device current hit clr's `guarantee(... "Device mismatch from where this module is
    loaded")`;
  * a launch on the NULL stream runs on the current device; a stream handle belongs to its device;
  * the loaded image is read again at launch (clr registers the pointer without copying the bytes).
"""
import ctypes
import gc
import os
import struct
import threading
import types

import pytest
import torch

from comfyui_sage_rdna4.kernels import disk_cache
from comfyui_sage_rdna4.kernels.backends.hip import compiler, platform, runtime

MAGIC = b"FAKECO\0\0"
NOT_FOUND, INVALID_DEVICE, INVALID_HANDLE, CALLBACK_RAISED = 500, 101, 400, 999
# torch's current stream per device: device 0 on its default stream (handle 0 = the NULL stream),
# device 1 on a side stream, as after `with torch.cuda.stream(s)` on that device.
SIDE_STREAM_1 = 0xD1
STREAMS = {0: 0, 1: SIDE_STREAM_1}


def fake_image(entries, pad=4096):
    """A 'code object': magic, length, the entry names; padded so it lives in malloc'd (reusable) memory."""
    body = b"\0".join(e.encode() for e in entries) + b"\0" * pad
    return MAGIC + struct.pack("<Q", len(body)) + body


class FakeHip:
    """libamdhip64 with `devices` GPUs, as ctypes function pointers."""

    _name = "fake libamdhip64 (2 devices)"

    def __init__(self, devices=2, streams=None):
        self.devices = devices
        self.streams = {h: d for d, h in (streams or STREAMS).items() if h}  # handle -> device
        self._tls = threading.local()
        self._next_handle = 0x1000
        self.modules = {}      # handle -> {"device", "ptr", "size", "bytes"}
        self.functions = {}    # handle -> (module handle, name)
        self.calls = []        # (api, current device, thread name)
        self.launches = []
        self.violations = []   # what would have aborted the process or gone to the wrong device
        self._error_text = ctypes.create_string_buffer(b"fake hip error")
        vp, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        pvp, pi32 = ctypes.POINTER(vp), ctypes.POINTER(i32)
        table = {
            "hipGetErrorString": (vp, [i32], lambda status: ctypes.addressof(self._error_text)),
            "hipRuntimeGetVersion": (i32, [pi32], self._runtime_version),
            "hipGetDevice": (i32, [pi32], self._get_device),
            "hipSetDevice": (i32, [i32], self._set_device),
            "hipModuleLoadData": (i32, [pvp, vp], self._load),
            "hipModuleGetFunction": (i32, [pvp, vp, ctypes.c_char_p], self._get_function),
            "hipModuleLaunchKernel": (i32, [vp] + [u32] * 7 + [vp, pvp, pvp], self._launch),
            "hipGetLastError": (i32, [], lambda: 0),
        }
        for name, (restype, argtypes, fn) in table.items():
            setattr(self, name, ctypes.CFUNCTYPE(restype, *argtypes)(self._guarded(name, fn)))

    def _guarded(self, name, fn):
        def call(*args):
            try:
                return fn(*args)
            except Exception as exc:  # an exception cannot cross a ctypes callback: record it
                self.violations.append(f"{name} raised {exc!r}")
                return CALLBACK_RAISED
        return call

    # -- state ----------------------------------------------------------------------------------
    @property
    def current(self):
        return getattr(self._tls, "device", 0)

    def _log(self, api):
        self.calls.append((api, self.current, threading.current_thread().name))

    def _handle(self):
        self._next_handle += 0x10
        return self._next_handle

    # -- the API --------------------------------------------------------------------------------
    def _runtime_version(self, out):
        out[0] = 70051
        return 0

    def _get_device(self, out):
        out[0] = self.current
        return 0

    def _set_device(self, device):
        if not 0 <= device < self.devices:
            return INVALID_DEVICE
        self._tls.device = device
        return 0

    def _load(self, out, image):
        self._log("hipModuleLoadData")
        head = ctypes.string_at(image, len(MAGIC) + 8)
        if head[:len(MAGIC)] != MAGIC:
            return INVALID_HANDLE
        size = len(MAGIC) + 8 + struct.unpack("<Q", head[len(MAGIC):])[0]
        handle = self._handle()
        self.modules[handle] = {"device": self.current, "ptr": image, "size": size,
                                "bytes": ctypes.string_at(image, size)}
        out[0] = handle
        return 0

    def _get_function(self, out, module, name):
        self._log("hipModuleGetFunction")
        mod = self.modules.get(module)
        if mod is None:
            return INVALID_HANDLE
        if mod["device"] != self.current:
            self.violations.append(f"hipModuleGetFunction({name.decode()}): module of device {mod['device']}, "
                                   f"device {self.current} current: clr aborts")
        if b"\0" + name + b"\0" not in mod["bytes"]:
            return NOT_FOUND
        handle = self._handle()
        self.functions[handle] = (module, name.decode())
        out[0] = handle
        return 0

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self._log("hipModuleLaunchKernel")
        module, name = self.functions[function]
        mod = self.modules[module]
        ran_on = self.current if not stream else self.streams[stream]
        if mod["device"] != self.current:
            self.violations.append(f"launch of {name}: module of device {mod['device']}, "
                                   f"device {self.current} current: clr aborts")
        if ran_on != mod["device"]:
            self.violations.append(f"launch of {name} went to device {ran_on}, its module is on {mod['device']}")
        if ctypes.string_at(mod["ptr"], mod["size"]) != mod["bytes"]:
            self.violations.append(f"launch of {name}: the code object buffer was freed or overwritten")
        self.launches.append({"name": name, "device": ran_on, "stream": stream or 0, "grid": (gx, gy, gz),
                              "first_arg": ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int32))[0]})
        return 0


class FakeCompiler(compiler.RtcCompiler):
    kind = "fake"

    def __init__(self):
        self.compiles = 0

    def version(self):
        return "fake-cc-1"

    def options(self, target, extra_flags):
        return [f"--arch={target}", *extra_flags]

    def target_for_device(self, device_index):
        return "gfx1201"

    def compile(self, source, target, extra_flags=()):
        self.compiles += 1
        return fake_image(["k_add", "k_scale"])


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
    return runtime.KernelLoader(runtime.HipRuntime(lib=fake), FakeCompiler(), disk_cache.EntryStore(disk_cache.HIP_CODE_OBJECTS, str(tmp_path)))


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
    plan = [types.SimpleNamespace(kernel="k_add", grid=(4, 1, 1), block=(64, 1, 1), args=[("i32", 5)], shared_bytes=0),
            types.SimpleNamespace(kernel="k_scale", grid=(1, 1, 1), block=(64, 1, 1), args=[("i32", 6)], shared_bytes=0)]
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
            1 / 0
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
