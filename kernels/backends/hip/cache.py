"""Compiled code objects on disk, so a user's GPU compiles each kernel once, not at every start.

An entry's key hashes everything that changes the binary: the sources, the target arch, the
compiler and runtime versions, the build flags and this file's format version. A changed input is
a different key, so stale entries are never read (they are simply left behind). Each file carries
its key and a SHA-256 of its payload: a truncated, corrupt or mismatched file counts as a miss, is
deleted and rebuilt. Writes go to a temporary file in the same folder and are renamed into place,
so a crash or a concurrent process never leaves a half-written entry under the real name. Any
filesystem failure degrades to compiling again; it never raises.

Folder: $SAGE_RDNA4_CACHE if set; else %LOCALAPPDATA%\\comfyui_sage_rdna4\\hip_kernels on Windows,
$XDG_CACHE_HOME (or ~/.cache)/comfyui_sage_rdna4/hip_kernels elsewhere; the temp folder if those
cannot be created; memory only if nothing is writable.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import sys
import tempfile
from typing import Dict, Optional, Tuple

from ...atomic_file import write_atomically

log = logging.getLogger(__name__)

ENV_VAR = "SAGE_RDNA4_CACHE"
FORMAT_VERSION = 1
MAGIC = b"SAGEKCO1"
# magic, payload sha256, payload length, meta length
HEADER = struct.Struct("<8s32sQI")


def default_cache_dir() -> str:
    override = os.environ.get(ENV_VAR)
    if override:
        return os.path.expanduser(override)
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser(os.path.join("~", "AppData", "Local"))
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(base, "comfyui_sage_rdna4", "hip_kernels")


def cache_key(**parts) -> str:
    """SHA-256 over the canonical JSON of everything that shapes the binary."""
    blob = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:80] or "kernel"


def encode_entry(key: str, payload: bytes, meta: Optional[dict] = None) -> bytes:
    meta_blob = json.dumps({"key": key, **(meta or {})}, sort_keys=True, default=str).encode()
    return HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload), len(meta_blob)) + meta_blob + payload


def decode_entry(blob: bytes, key: str) -> Tuple[Optional[bytes], str]:
    """(payload, '') for a sound entry of `key`, else (None, what is wrong with it)."""
    if len(blob) < HEADER.size:
        return None, "shorter than its header"
    magic, digest, size, meta_size = HEADER.unpack_from(blob)
    if magic != MAGIC:
        return None, "not a cache entry of this format"
    if len(blob) != HEADER.size + meta_size + size:
        return None, f"size {len(blob)} does not match its header"
    try:
        meta = json.loads(blob[HEADER.size:HEADER.size + meta_size].decode())
    except (UnicodeDecodeError, ValueError):
        return None, "unreadable metadata"
    if meta.get("key") != key:
        return None, "written for another key (stale)"
    payload = blob[HEADER.size + meta_size:]
    if hashlib.sha256(payload).digest() != digest:
        return None, "payload checksum mismatch"
    return payload, ""


class CodeObjectCache:
    def __init__(self, root: Optional[str] = None):
        self.root = self._usable_root(root if root is not None else default_cache_dir())
        self.memory: Dict[str, bytes] = {}

    @staticmethod
    def _usable_root(preferred: str) -> Optional[str]:
        fallback = os.path.join(tempfile.gettempdir(), "comfyui_sage_rdna4_hip_kernels")
        for folder in (preferred, fallback):
            try:
                os.makedirs(folder, exist_ok=True)
                if os.access(folder, os.W_OK):
                    return folder
            except OSError:
                pass
            log.warning("kernel cache folder %s is not writable", folder)
        return None

    def path(self, key: str, label: str) -> Optional[str]:
        return None if self.root is None else os.path.join(self.root, f"{_safe_label(label)}-{key[:40]}.bin")

    def load(self, key: str, label: str) -> Tuple[Optional[bytes], Optional[str]]:
        """(payload, path) on a hit; (None, None) on a miss. A bad file is removed and counts as a miss."""
        if key in self.memory:
            return self.memory[key], None
        path = self.path(key, label)
        if path is None or not os.path.isfile(path):
            return None, None
        try:
            with open(path, "rb") as fh:
                blob = fh.read()
        except OSError as exc:
            log.warning("kernel cache entry %s unreadable (%s); rebuilding", path, exc)
            return None, None
        payload, problem = decode_entry(blob, key)
        if payload is None:
            log.warning("kernel cache entry %s is %s; rebuilding", path, problem)
            self.discard(path)
            return None, None
        self.memory[key] = payload
        return payload, path

    def store(self, key: str, label: str, payload: bytes, meta: Optional[dict] = None) -> Optional[str]:
        """Write atomically; returns the path, or None when only the memory copy could be kept."""
        self.memory[key] = payload
        path = self.path(key, label)
        if path is None:
            return None
        try:
            write_atomically(path, encode_entry(key, payload, meta))
            return path
        except OSError as exc:  # full disk, read-only folder, a Windows reader holding the file, ...
            log.warning("could not write kernel cache entry %s: %s", path, exc)
            return None

    def discard(self, path: Optional[str], key: Optional[str] = None) -> None:
        if key is not None:
            self.memory.pop(key, None)
        if path is None:
            return
        try:
            with open(path, "rb") as fh:  # drop the memory copy of whatever key this file held
                head = fh.read(HEADER.size + 4096)
            _, _, _, meta_size = HEADER.unpack_from(head)
            stale = json.loads(head[HEADER.size:HEADER.size + meta_size].decode()).get("key")
            self.memory.pop(stale, None)
        except Exception:
            pass
        try:
            os.unlink(path)
        except OSError:
            pass
