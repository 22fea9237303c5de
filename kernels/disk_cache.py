"""The pack's files on the user's disk, for every kind of entry: where they live, how they are keyed, and how
one is written and read back. Kinds: HIP code objects (kernels/backends/hip), self-check passes
(pass_cache.PassCache) and auto's measured choices (decisions.DecisionStore), each in its own subfolder.

Folder: $SAGE_RDNA4_CACHE if set; else %LOCALAPPDATA%\\comfyui_sage_rdna4 on Windows, $XDG_CACHE_HOME (or
~/.cache)/comfyui_sage_rdna4 elsewhere; then one subfolder per kind (`KINDS`). A kind whose folder cannot
be created or written goes to this user's folder in the system temp folder, <temp>/comfyui_sage_rdna4-<uid>/<kind>
(made 0700); one there that another user owns or may write is refused, since entries planted in it would be
trusted (passes) or loaded (code objects). Failing that, memory only.

Keys hash everything that shapes an entry (`cache_key`, with this module's ENTRY_FORMAT): a changed input is
a different key, so a stale entry is never read; it is simply left behind.

One entry format for all kinds: one file per key, holding a binary header (magic, SHA-256 of the payload,
payload and metadata lengths), JSON metadata carrying the key, then the payload: a code object's own bytes,
or JSON for passes and decisions. Why this one: code objects stay bytes with no re-encoding, and one file
per key means no writer ever reads, merges and rewrites entries another process wrote, so none is lost;
the checksum catches a truncated or edited file the same way for every kind.

Writes go to a temporary file in the same folder and are renamed into place (atomic on POSIX and Windows),
so a crash or a concurrent process never leaves a half-written entry under the real name. A crash between the
two leaves the temporary file (`.tmp-*.part`); a store removes those older than STALE_TEMP_SECONDS when it
opens its folder (a writer renames its file within seconds, so one that old is nobody's). A truncated,
corrupt or mismatched entry is a miss and is removed, and so is one larger than MAX_ENTRY_BYTES, refused from
its size before any of it is read (a code object is under 1 MB; a file far larger is not ours). Any filesystem
failure degrades to the memory copy; nothing here raises to its callers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import struct
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from . import settings

log = logging.getLogger(__name__)

FOLDER_NAME = "comfyui_sage_rdna4"
HIP_CODE_OBJECTS = "hip_code_objects"
SELF_CHECK_PASSES = "self_check_passes"
AUTO_DECISIONS = "auto_decisions"
KINDS = (HIP_CODE_OBJECTS, SELF_CHECK_PASSES, AUTO_DECISIONS)

ENTRY_FORMAT = 2  # part of every key: a new format never reads an old one's entries
MAGIC = b"SAGEENT2"
# magic, payload sha256, payload length, metadata length
HEADER = struct.Struct("<8s32sQI")
MAX_ENTRY_BYTES = 64 * 2 ** 20  # an entry file above this is refused unread: shipped code objects are ~0.3 MB
MAX_META_BYTES = 2 ** 20        # metadata is a few keys
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".part"
STALE_TEMP_SECONDS = 15 * 60    # a temporary file this old is a crashed writer's, not one being written


# -- where ------------------------------------------------------------------------------------------

def cache_root() -> str:
    """The folder every kind's subfolder goes in ($SAGE_RDNA4_CACHE, else the user cache folder)."""
    chosen = settings.cache_dir()
    if chosen:
        return chosen
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser(os.path.join("~", "AppData", "Local"))
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(base, FOLDER_NAME)


def default_folder(kind: str) -> str:
    return os.path.join(cache_root(), kind)


def fallback_root() -> str:
    """This user's folder in the system temp folder, which every user can write to."""
    if not hasattr(os, "getuid"):
        # Windows: tempfile.gettempdir() is %TEMP%, inside the user's own profile and private to the user already.
        return os.path.join(tempfile.gettempdir(), FOLDER_NAME)
    return os.path.join(tempfile.gettempdir(), f"{FOLDER_NAME}-{os.getuid()}")


def fallback_folder(kind: str) -> str:
    return os.path.join(fallback_root(), kind)


def not_private(folder: str) -> Optional[str]:
    """Why another user could have written into `folder` (not ours, or writable by group or others), or None.
    Always None where there are no POSIX owners (Windows: see fallback_root)."""
    if not hasattr(os, "getuid"):
        return None
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder (a link?)"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_refused_logged: set = set()  # temp folders refused in this process: each is reported once, not per store


def _private_fallback(kind: str) -> Optional[str]:
    """The kind's temp folder, made 0700 for this user; None when it, or the folder above it, is not private.
    Another user can predict its name and plant entries there first (a pass, a code object to load)."""
    root, folder = fallback_root(), fallback_folder(kind)
    problem = None
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for path in (root, folder):  # the one above too: its owner could swap the kind's folder for another
            why = not_private(path)
            if why:
                problem = f"{path} is {why}"
                break
    except OSError as exc:
        problem = f"{folder} is unusable ({exc})"
    if problem is None:
        return folder
    if problem not in _refused_logged:
        _refused_logged.add(problem)
        log.warning("cache folder refused: %s; %s entries are kept in memory only", problem, kind)
    return None


def usable_folder(kind: str, preferred: Optional[str] = None) -> Optional[str]:
    """`preferred` (default: the kind's folder under cache_root) if it can be created and written, else this
    user's private temp folder (`_private_fallback`); None when neither can be used."""
    preferred = preferred if preferred is not None else default_folder(kind)
    try:
        os.makedirs(preferred, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    log.warning("cache folder %s is not writable", preferred)
    folder = _private_fallback(kind)
    return folder if folder is not None and os.access(folder, os.W_OK) else None


# -- keys and entries -------------------------------------------------------------------------------

def cache_key(**parts) -> str:
    """SHA-256 over the canonical JSON of everything that shapes the entry (and of ENTRY_FORMAT)."""
    blob = json.dumps({**parts, "entry_format": ENTRY_FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:80] or "entry"


def encode_entry(key: str, payload: bytes, meta: Optional[dict] = None) -> bytes:
    meta_blob = json.dumps({**(meta or {}), "key": key}, sort_keys=True, default=str).encode()
    return HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload), len(meta_blob)) + meta_blob + payload


def _split(blob: bytes) -> Tuple[Optional[dict], Optional[bytes], bytes, str]:
    """(metadata, payload, recorded digest, '') of an entry's bytes, or (None, None, b'', what is wrong)."""
    if len(blob) < HEADER.size:
        return None, None, b"", "shorter than its header"
    magic, digest, size, meta_size = HEADER.unpack_from(blob)
    if magic != MAGIC:
        return None, None, b"", "not a cache entry of this format"
    if len(blob) != HEADER.size + meta_size + size:
        return None, None, b"", f"size {len(blob)} does not match its header"
    try:
        meta = json.loads(blob[HEADER.size:HEADER.size + meta_size].decode())
    except (UnicodeDecodeError, ValueError):
        return None, None, b"", "unreadable metadata"
    if not isinstance(meta, dict):  # valid JSON, but [], 1, "x" or null: not ours
        return None, None, b"", "metadata that is not a JSON object"
    return meta, blob[HEADER.size + meta_size:], digest, ""


def decode_entry(blob: bytes, key: str) -> Tuple[Optional[bytes], str]:
    """(payload, '') for a sound entry of `key`, else (None, what is wrong with it)."""
    meta, payload, digest, problem = _split(blob)
    if problem:
        return None, problem
    if meta.get("key") != key:
        return None, "written for another key (stale)"
    if hashlib.sha256(payload).digest() != digest:
        return None, "payload checksum mismatch"
    return payload, ""


def read_bounded(path: str, limit: int = MAX_ENTRY_BYTES) -> Tuple[Optional[bytes], str]:
    """(the file's bytes, '') when it holds at most `limit` bytes, else (None, why). The size is taken from the
    open file before anything is read, and the read stops at `limit` + 1 bytes whatever the file grows to."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            return None, f"{size} bytes, above the {limit}-byte bound for a cache entry"
        blob = fh.read(limit + 1)
    if len(blob) > limit:
        return None, f"larger than the {limit}-byte bound for a cache entry"
    return blob, ""


def read_meta(path: str) -> Optional[dict]:
    """The metadata of the entry at `path` (for reports and tests), or None when it is not a readable entry.
    Reads the header and the metadata only, never the payload."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER.size)
            if len(head) < HEADER.size:
                return None
            magic, _, _, meta_size = HEADER.unpack(head)
            if magic != MAGIC or meta_size > MAX_META_BYTES:
                return None
            meta_blob = fh.read(meta_size)
    except OSError:
        return None
    try:
        meta = json.loads(meta_blob.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def remove_stale_temporaries(folder: str, older_than: float = STALE_TEMP_SECONDS) -> List[str]:
    """Remove the `.tmp-*.part` files in `folder` last written more than `older_than` seconds ago (left by a
    writer that crashed between writing and renaming); returns their names. A younger one may be another
    process's write in progress and is left alone."""
    removed = []
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than:
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone already, or held open (Windows): another process's business
            continue
    if removed:
        log.info("removed %d stale temporary file(s) from %s", len(removed), folder)
    return removed


def write_atomically(path: str, data: bytes) -> None:
    """Put `data` at `path` through a temporary file in the same folder and os.replace. The temporary file
    is removed when anything fails, and the error is raised to the caller."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- one kind's entries -----------------------------------------------------------------------------

class EntryStore:
    """One kind's entries: in memory for this process, and on disk in `folder` (default: the kind's folder
    under cache_root, read when the store is made). `folder` is None when nothing on disk is usable. Making a
    store clears its folder of stale temporary files (`remove_stale_temporaries`)."""

    def __init__(self, kind: str, folder: Optional[str] = None):
        self.kind = kind
        self.folder = usable_folder(kind, folder)
        self.memory: Dict[str, bytes] = {}
        if self.folder is not None:
            remove_stale_temporaries(self.folder)

    def path(self, key: str, label: str) -> Optional[str]:
        return None if self.folder is None else os.path.join(self.folder, f"{safe_label(label)}-{key[:40]}.bin")

    def load(self, key: str, label: str) -> Tuple[Optional[bytes], Optional[str]]:
        """(payload, path) on a hit from disk, (payload, None) from memory; (None, None) on a miss. A bad file
        is removed and counts as a miss."""
        if key in self.memory:
            return self.memory[key], None
        path = self.path(key, label)
        if path is None or not os.path.isfile(path):
            return None, None
        try:
            blob, problem = read_bounded(path)
        except OSError as exc:
            log.warning("cache entry %s unreadable (%s); treated as missing", path, exc)
            return None, None
        payload = None
        if blob is not None:
            payload, problem = decode_entry(blob, key)
        if payload is None:
            log.warning("cache entry %s is %s; removed", path, problem)
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
        blob = encode_entry(key, payload, {"kind": self.kind, **(meta or {})})
        if len(blob) > MAX_ENTRY_BYTES:  # it would be refused when read back
            log.warning("cache entry %s not written: %d bytes, above the %d-byte bound for a cache entry", path,
                        len(blob), MAX_ENTRY_BYTES)
            return None
        try:
            write_atomically(path, blob)
            return path
        except OSError as exc:  # full disk, read-only folder, a Windows reader holding the file, ...
            log.warning("could not write cache entry %s: %s", path, exc)
            return None

    def load_json(self, key: str, label: str) -> Any:
        """The JSON payload of `key`, or None on a miss; a payload that is not JSON is removed like a corrupt file."""
        payload, path = self.load(key, label)
        if payload is None:
            return None
        try:
            return json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            log.warning("cache entry %s holds no JSON; removed", path or key)
            self.discard(path, key)
            return None

    def store_json(self, key: str, label: str, value: Any, meta: Optional[dict] = None) -> Optional[str]:
        try:
            payload = json.dumps(value, sort_keys=True, default=str).encode("utf-8")
        except (TypeError, ValueError) as exc:  # a value JSON cannot hold is not worth a failed call
            log.warning("cache entry %s not written: %s", label, exc)
            return None
        return self.store(key, label, payload, meta)

    def discard(self, path: Optional[str], key: Optional[str] = None) -> None:
        """Forget `key` and remove the file at `path` (and the memory copy of whatever key that file held)."""
        if key is not None:
            self.memory.pop(key, None)
        if path is None:
            return
        meta = read_meta(path)
        if meta is not None and isinstance(meta.get("key"), str):
            self.memory.pop(meta["key"], None)
        try:
            os.unlink(path)
        except OSError:
            pass
