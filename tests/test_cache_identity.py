"""kernels/cache_identity.py on the CPU: the GPU identity that keys the pass and decision caches, with the
driver version read by a stand-in. No driver version: no identity, so nothing is cached. On NVIDIA the
version comes from the CUDA driver torch loaded, never through the HIP runtime or the verification code."""
import ctypes
import sys
import types

import pytest
import torch

from comfyui_sage_rdna4.kernels import cache_identity

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0)
R9700 = types.SimpleNamespace(name="AMD Radeon AI PRO R9700", major=12, minor=0, gcnArchName="gfx1201:xnack-")


@pytest.fixture
def nvidia(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)


def test_identity_on_nvidia_takes_the_cuda_driver_version(nvidia, monkeypatch):
    monkeypatch.setattr(cache_identity, "cuda_driver_version", lambda: "cuda-driver-13000")
    monkeypatch.setattr(cache_identity, "hip_runtime_version", lambda: pytest.fail("the HIP runtime was asked"))
    ident = cache_identity.gpu_identity(torch.device("cuda", 0))
    assert ident["driver"] == "cuda-driver-13000" and ident["arch"] == "sm_90" and ident["gpu"] == "NVIDIA H200"
    assert ident["cuda"] == "13.0" and ident["hip"] is None and ident["torch"] == torch.__version__


def test_identity_on_rocm_takes_the_hip_runtime_version(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: R9700)
    monkeypatch.setattr(torch.version, "hip", "7.1.0", raising=False)
    monkeypatch.setattr(cache_identity, "hip_runtime_version", lambda: "hip-70100")
    monkeypatch.setattr(cache_identity, "cuda_driver_version", lambda: pytest.fail("the CUDA driver was asked"))
    ident = cache_identity.gpu_identity(torch.device("cuda", 0))
    assert ident["driver"] == "hip-70100" and ident["arch"] == "gfx1201:xnack-"


@pytest.mark.parametrize("reader", [lambda: None, lambda: "", lambda: (_ for _ in ()).throw(OSError("no driver"))])
def test_no_driver_version_means_no_identity(nvidia, monkeypatch, reader):
    monkeypatch.setattr(cache_identity, "cuda_driver_version", reader)
    assert cache_identity.driver_version() is None
    assert cache_identity.gpu_identity(torch.device("cuda", 0)) is None


def test_no_gpu_means_no_identity(monkeypatch):
    def no_gpu(device):
        raise RuntimeError("no CUDA GPUs are available")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    assert cache_identity.gpu_identity(torch.device("cuda", 0)) is None


class FakeDriver:
    """cuDriverGetVersion as a ctypes callback, the way the reader calls the real one."""

    def __init__(self, version=13000, status=0):
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))

        def get(out):
            out[0] = version
            return status
        self.cuDriverGetVersion = proto(get)


def test_the_cuda_driver_reader_through_ctypes():
    assert cache_identity.cuda_driver_version(FakeDriver(12080)) == "cuda-driver-12080"
    assert cache_identity.cuda_driver_version(FakeDriver(12080, status=3)) is None  # CUDA_ERROR_NOT_INITIALIZED
    assert cache_identity.cuda_driver_version(FakeDriver(0)) is None


def test_the_cuda_driver_reader_never_loads_a_driver_of_its_own(monkeypatch):
    """Without a CUDA driver in the process (this CPU machine) there is no version, and none gets loaded."""
    if sys.platform == "win32":
        pytest.skip("RTLD_NOLOAD is POSIX")
    monkeypatch.setattr(cache_identity, "CUDA_DRIVER_NAMES", ("libsage_rdna4_no_such_driver.so.1",))
    monkeypatch.setattr(cache_identity, "_mapped_cuda_drivers", lambda: [])
    assert cache_identity._loaded_cuda_driver() is None
    assert cache_identity.cuda_driver_version() is None
    monkeypatch.setattr(cache_identity, "CUDA_DRIVER_NAMES", ("libc.so.6",))  # loaded, but no CUDA inside
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    if cache_identity._loaded_cuda_driver() is not None:
        with pytest.raises(AttributeError):
            cache_identity.cuda_driver_version()
        assert cache_identity.driver_version() is None  # a library without the entry point: no version


def test_reading_the_driver_on_nvidia_imports_no_hip_or_verify_code(nvidia, monkeypatch):
    monkeypatch.setattr(cache_identity, "_loaded_cuda_driver", lambda: FakeDriver(13000))
    watched = ("comfyui_sage_rdna4.kernels.backends.hip.runtime", "comfyui_sage_rdna4.kernels.verify.cuda_twin")
    for name in watched:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert cache_identity.gpu_identity(torch.device("cuda", 0))["driver"] == "cuda-driver-13000"
    assert not [name for name in watched if name in sys.modules]


def test_mapped_drivers_are_found_by_file_name(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r--p 00000000 08:01 1 /usr/local/nvidia/lib64/libcuda.so.580.159.04\n"
        "7f10-7f20 r-xp 00010000 08:01 1 /usr/local/nvidia/lib64/libcuda.so.580.159.04\n"
        "7f20-7f30 r--p 00000000 08:01 2 /opt/torch/lib/libcudart.so.13\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n")
    assert cache_identity._mapped_cuda_drivers(str(maps)) == ["/usr/local/nvidia/lib64/libcuda.so.580.159.04"]
    assert cache_identity._mapped_cuda_drivers(str(tmp_path / "none")) == []
