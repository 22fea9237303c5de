"""The first-use ledger (kernels/first_use_costs.py) names loading a backend and checking that it is available,
when either takes REPORTED_S or more: an installed peer's check imports its package, a cost of the first step that
the ledger did not name before."""
import sys
import time

import pytest

from comfyui_sage_rdna4.kernels import first_use_costs, registry
from comfyui_sage_rdna4.kernels.backends.peers import ComfyKitchenBackend
from fakes import FakeBackend

SLOW_S = 0.05  # well past REPORTED_S


class SlowToCheck(FakeBackend):
    def __init__(self, seconds):
        super().__init__("slow_to_check")
        self.seconds = seconds
        self.checked = 0

    def _unavailable(self, device_type, index):
        self.checked += 1
        time.sleep(self.seconds)
        return None


def test_a_slow_availability_check_is_a_part_once_per_device():
    backend = SlowToCheck(SLOW_S)
    mark = first_use_costs.mark()
    assert backend.unavailable("cuda", 0) is None and backend.unavailable("cuda", 0) is None
    backend.unavailable("cuda", 1)
    parts = first_use_costs.since(mark)
    assert [part for part, _ in parts] == ["checking that slow_to_check is available on cuda:0",
                                           "checking that slow_to_check is available on cuda:1"]
    assert backend.checked == 2 and all(seconds >= SLOW_S for _, seconds in parts)


def test_a_fast_check_is_not_a_part():
    mark = first_use_costs.mark()
    SlowToCheck(0.0).unavailable("cpu")
    assert first_use_costs.since(mark) == []


def test_an_installed_peers_import_is_a_part(tmp_path, monkeypatch):
    """A comfy-kitchen whose import takes 50 ms: the check imports it, and the ledger names it with its time."""
    (tmp_path / "comfy_kitchen.py").write_text(
        f"import time\ntime.sleep({SLOW_S})\n"
        "def int8_attention(q, k, v, scale=None, attn_mask=None):\n    return q\n"
        "def int8_attention_is_available(device):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "comfy_kitchen", raising=False)
    mark = first_use_costs.mark()
    assert ComfyKitchenBackend().unavailable("cuda", 0) is None
    (part, seconds), = first_use_costs.since(mark)
    assert part == "checking that comfy_kitchen is available on cuda:0" and seconds >= SLOW_S
    assert "comfy_kitchen" in sys.modules


def test_a_slow_backend_load_is_a_part(monkeypatch):
    def slow_loader():
        time.sleep(SLOW_S)
        return FakeBackend("sageattention")
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_LOADERS", {**registry._LOADERS, "sageattention": slow_loader})
    mark = first_use_costs.mark()
    registry.get_backend("sageattention")
    registry.get_backend("sageattention")  # made already: nothing more
    (part, seconds), = first_use_costs.since(mark)
    assert part == "loading sageattention (its modules)" and seconds >= SLOW_S


@pytest.mark.parametrize("seconds, kept", [(first_use_costs.REPORTED_S, True), (0.0099, False)])
def test_the_threshold(seconds, kept):
    mark = first_use_costs.mark()
    first_use_costs.record_if_slow("part", seconds)
    assert (first_use_costs.since(mark) == [("part", seconds)]) is kept
