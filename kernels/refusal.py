"""How a refusal reads: the error an explicitly requested backend raises, naming it once."""
from __future__ import annotations


def named_reason(backend: str, reason: str) -> str:
    """`reason` naming `backend` once, also when it already starts with its name."""
    named = reason.startswith(f"{backend}:") or reason.startswith(f"{backend} ")
    return reason if named else f"{backend}: {reason}"


class KernelRefused(RuntimeError):
    """An explicitly requested backend cannot take this call; `reason` says why (the message names it once)."""

    def __init__(self, backend: str, reason: str):
        super().__init__(named_reason(backend, reason))
        self.backend = backend
        self.reason = reason
