"""Reusable prologue buffers: the quantized Q/K/V and their statistics, kept per call signature.

Allocating the prologue's twelve buffers costs 3-4 µs of host time each on the H200's host
(tools/host_profile.py), about a tenth of a Flux-size call's host time. A workspace is reused by the next
call with the same signature on the same device, stream and thread: stream order then guarantees the
previous call's kernels have read it before the next one writes. Only the backend's own
prologue -> attention path uses it (the QuantizedQKV it returns is dead after the call); the public
prologue function always allocates.

Memory: a workspace is kept only while all kept workspaces together stay within the budget
(SAGE_RDNA4_WORKSPACE_MB, default 128 MiB; 0 keeps none), least recently used first out. Flux at 2 MP
needs 80 MiB; long video calls, where allocation costs nothing next to the kernels, do not fit and
allocate per call as before. Nothing is kept while a CUDA graph is being captured.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable, Optional, Tuple

import torch

from ... import settings


def current_stream(index: Optional[int]) -> int:
    """The raw handle of the current stream of a CUDA/HIP device (what Triton launches on)."""
    from triton.runtime import driver
    return driver.active.get_current_stream(torch.cuda.current_device() if index is None else index)


def budget_bytes() -> int:
    """SAGE_RDNA4_WORKSPACE_MB in bytes (kernels/settings.py), read when a cache is made."""
    return settings.workspace_budget_bytes()


def nbytes(buffers) -> int:
    """Device bytes behind `buffers.tensors()`, each storage counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers.tensors()}
    return sum(storages.values())


class WorkspaceCache:
    def __init__(self, budget: Optional[int] = None):
        self.budget = budget_bytes() if budget is None else budget
        self._kept: "OrderedDict[Hashable, Tuple[int, object]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, signature: Hashable, device: torch.device, make: Callable[[], object]):
        """The buffers of `signature` on `device` for this stream and thread: kept ones, or `make()`'s."""
        if device.type != "cuda" or self.budget <= 0 or torch.cuda.is_current_stream_capturing():
            return make()
        key = (signature, device.index, current_stream(device.index), threading.get_ident())
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept[1]
        buffers = make()
        size = nbytes(buffers)
        if size > self.budget:
            return buffers
        with self._lock:
            while self._kept and self._bytes + size > self.budget:
                _, (old, _) = self._kept.popitem(last=False)
                self._bytes -= old
            self._kept[key] = (size, buffers)
            self._bytes += size
        return buffers

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    @property
    def kept_bytes(self) -> int:
        return self._bytes
