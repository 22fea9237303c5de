"""Self-check passes kept on disk, so a later process on the same GPU, driver and code skips the check."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import settings
from .cache_identity import code_digest, gpu_identity, pack_version  # the keys; tests patch them here
from .disk_cache import SELF_CHECK_PASSES, EntryStore, cache_key


class PassCache:
    """Self-check passes on disk, in the cache folder's self_check_passes/ (kernels/disk_cache.py; `root`:
    another folder for them). A key hashes the backend, the variant, the code digest, the cases, the GPU's
    name and arch, the driver/runtime versions and the pack version: any change is a new key and the check
    runs again. Failures are never cached. SAGE_RDNA4_SELF_CHECK_CACHE=0 turns it off (kernels/settings.py)."""

    PASS = "pass"

    def __init__(self, root: Optional[str] = None, enabled: Optional[bool] = None):
        self._root = root
        self.enabled = enabled if enabled is not None else settings.self_check_cache_enabled()
        self._store: Optional[EntryStore] = None

    def _entries(self) -> EntryStore:
        if self._store is None:
            self._store = EntryStore(SELF_CHECK_PASSES, self._root)
        return self._store

    def key(self, backend: str, variant, device: Optional[torch.device], checks: str,
            identity: Optional[dict] = None) -> Optional[str]:
        """The entry's key, or None (nothing cached) when disabled or when the GPU or driver cannot be told.
        `checks`: what the check ran (self_check.checks_fingerprint: its cases and bounds), from the caller."""
        if not self.enabled:
            return None
        try:
            identity = identity if identity is not None else gpu_identity(device)
            if identity is None:
                return None
            return cache_key(kind="self-check pass", backend=backend, variant=list(variant or ()),
                             code=code_digest(), checks=checks,
                             pack=pack_version(), **identity)
        except Exception:
            return None

    def checked(self, key: Optional[str], backend: str, run: Callable[[], object]):
        """`run()`'s self-check result (self_check.SelfCheckResult), kept under `key` when it passed; None when a
        pass of `key` is on disk already, and nothing runs. Without a key nothing is recalled or kept."""
        if key and self.has_pass(key, backend):
            return None
        result = run()
        if key and result.reason is None:
            self.store_pass(key, backend, result)
        return result

    def has_pass(self, key: str, backend: str) -> bool:
        try:
            entry = self._entries().load_json(key, f"selfcheck-{backend}")
        except Exception:
            return False
        return isinstance(entry, dict) and entry.get("verdict") == self.PASS

    def store_pass(self, key: str, backend: str, result=None) -> Optional[str]:
        """`result` (self_check.SelfCheckResult): what the pass measured, written beside it."""
        entry = {"verdict": self.PASS, "backend": backend}
        if result is not None:  # what the pass measured, for whoever reads the file
            entry.update(seconds=round(result.seconds, 3),
                         cases={r.case.name: {"rel_l1": r.worst_rel_l1, "cosine": r.worst_cosine}
                                for r in result.results})
        try:
            return self._entries().store_json(key, f"selfcheck-{backend}", entry)
        except Exception:
            return None
