"""kernels/disk_cache.py: the cache folder, keys, atomic writes and the one entry format every kind uses
(HIP code objects, self-check passes, auto's decisions): round trips, corrupt and stale entries as misses
that are removed, and an unwritable disk degrading to memory."""
import json
import os
import time
import tracemalloc

import pytest

from comfyui_sage_rdna4.kernels import disk_cache
from comfyui_sage_rdna4.kernels.pass_cache import PassCache
from comfyui_sage_rdna4.kernels.settings import CACHE

BASE = dict(source="s" * 64, target="gfx1201", compiler="hiprtc-7.0", runtime="hip-70000", flags=["-O3"])
KIND = disk_cache.HIP_CODE_OBJECTS


def store(folder):
    return disk_cache.EntryStore(KIND, str(folder))


@pytest.mark.parametrize("part, other", [
    ("source", "t" * 64), ("target", "gfx1200"), ("compiler", "hiprtc-6.4"), ("runtime", "hip-60400"),
    ("flags", ["-O2"]),
])
def test_cache_key_changes_with_every_part(part, other):
    assert disk_cache.cache_key(**BASE) == disk_cache.cache_key(**dict(BASE))
    assert disk_cache.cache_key(**{**BASE, part: other}) != disk_cache.cache_key(**BASE)


def test_cache_key_follows_the_entry_format(monkeypatch):
    key = disk_cache.cache_key(**BASE)
    monkeypatch.setattr(disk_cache, "ENTRY_FORMAT", disk_cache.ENTRY_FORMAT + 1)
    assert disk_cache.cache_key(**BASE) != key
    assert disk_cache.cache_key(**BASE, format=1) != disk_cache.cache_key(**BASE)  # a part named format is a part


def test_folders_per_kind_under_the_env_override_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE.name, str(tmp_path / "here"))
    assert disk_cache.cache_root() == str(tmp_path / "here")
    for kind in disk_cache.KINDS:
        assert disk_cache.EntryStore(kind).folder == str(tmp_path / "here" / kind)
    assert len(set(disk_cache.KINDS)) == 3
    monkeypatch.delenv(CACHE.name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if os.name != "nt":
        assert disk_cache.cache_root() == str(tmp_path / "xdg" / disk_cache.FOLDER_NAME)
        assert disk_cache.default_folder(KIND) == str(tmp_path / "xdg" / disk_cache.FOLDER_NAME / KIND)


def test_roundtrip_is_atomic(tmp_path):
    c = store(tmp_path)
    key = disk_cache.cache_key(**BASE)
    path = c.store(key, "attn-gfx1201", b"\x7fELF" + bytes(range(256)), {"target": "gfx1201"})
    assert path and os.path.isfile(path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]  # no temp file left
    payload, hit = store(tmp_path).load(key, "attn-gfx1201")  # a new process: nothing in memory
    assert payload == b"\x7fELF" + bytes(range(256)) and hit == path
    assert disk_cache.read_meta(path) == {"key": key, "kind": KIND, "target": "gfx1201"}


def test_json_entries_roundtrip(tmp_path):
    c = disk_cache.EntryStore(disk_cache.AUTO_DECISIONS, str(tmp_path))
    key = disk_cache.cache_key(what="a decision")
    assert c.store_json(key, "autotune", {"timings": {"sdpa": 1.5}})
    assert disk_cache.EntryStore(disk_cache.AUTO_DECISIONS, str(tmp_path)).load_json(key, "autotune") == \
        {"timings": {"sdpa": 1.5}}
    circular = {}
    circular["self"] = circular
    assert c.store_json(key, "autotune", circular) is None  # JSON cannot hold it: not written, no exception


def test_a_payload_that_is_no_json_is_a_miss_and_removed(tmp_path):
    c = store(tmp_path)
    key = disk_cache.cache_key(what="x")
    path = c.store(key, "pass", b"\xff\xfe not json")
    assert store(tmp_path).load_json(key, "pass") is None
    assert not os.path.exists(path)


def _corrupt(path, how):
    blob = open(path, "rb").read()
    if how == "truncate":
        blob = blob[: len(blob) - 7]
    elif how == "flip":
        blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
    elif how == "garbage":
        blob = b"not a code object at all"
    elif how == "empty":
        blob = b""
    open(path, "wb").write(blob)


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_entry_is_a_miss_and_removed(tmp_path, how):
    key = disk_cache.cache_key(**BASE)
    path = store(tmp_path).store(key, "attn", b"payload" * 100)
    _corrupt(path, how)
    payload, hit = store(tmp_path).load(key, "attn")
    assert payload is None and hit is None
    assert not os.path.exists(path)


@pytest.mark.parametrize("meta", [b"[]", b"1", b'"x"', b"null", b"{not json", b"\xff"])
def test_metadata_that_is_no_json_object_is_a_miss_and_removed(tmp_path, meta):
    """Valid JSON that is not an object (or no JSON at all) in the metadata: a miss, never an AttributeError."""
    key = disk_cache.cache_key(**BASE)
    c = store(tmp_path)
    path = c.path(key, "attn")
    payload = b"payload"
    header = disk_cache.HEADER.pack(disk_cache.MAGIC, __import__("hashlib").sha256(payload).digest(),
                                    len(payload), len(meta))
    with open(path, "wb") as fh:
        fh.write(header + meta + payload)
    assert disk_cache.decode_entry(open(path, "rb").read(), key)[0] is None
    assert disk_cache.read_meta(path) is None
    assert c.load(key, "attn") == (None, None)
    assert not os.path.exists(path)


def _peak_bytes_allocated(fn):
    """(fn's result, the peak of Python allocations while it ran)."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("header", ["claims-the-size", "zeros"])
def test_an_entry_above_the_size_bound_is_refused_unread_and_removed(tmp_path, caplog, header):
    """A 512 MiB (sparse) file under an entry's name: refused from its size, with the size in the log, before any
    of it is read (the peak of Python allocations stays under 1 MiB; reading it would take 512 MiB)."""
    key = disk_cache.cache_key(**BASE)
    c = store(tmp_path)
    path = c.path(key, "attn")
    size = 512 * 2 ** 20
    with open(path, "wb") as fh:
        if header == "claims-the-size":  # a header that agrees with the file's size: only the bound refuses it
            meta = json.dumps({"key": key}).encode()
            fh.write(disk_cache.HEADER.pack(disk_cache.MAGIC, b"\0" * 32, size - disk_cache.HEADER.size - len(meta),
                                            len(meta)) + meta)
        fh.truncate(size)
    assert os.path.getsize(path) == size > disk_cache.MAX_ENTRY_BYTES
    if header == "claims-the-size":
        meta_read, peak = _peak_bytes_allocated(lambda: disk_cache.read_meta(path))
        assert meta_read == {"key": key} and peak < 2 ** 20, peak  # the metadata without the payload
    with caplog.at_level("WARNING", logger=disk_cache.__name__):
        got, peak = _peak_bytes_allocated(lambda: c.load(key, "attn"))
    assert got == (None, None) and peak < 2 ** 20, peak
    assert not os.path.exists(path)
    assert any(f"{size} bytes, above the {disk_cache.MAX_ENTRY_BYTES}-byte bound" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_read_stops_at_the_bound_even_when_the_size_was_small(tmp_path, monkeypatch):
    """The bound holds for a file that grows between the size check and the read: at most bound + 1 bytes."""
    path = tmp_path / "entry.bin"
    path.write_bytes(b"x" * 100)
    assert disk_cache.read_bounded(str(path), limit=100) == (b"x" * 100, "")
    assert disk_cache.read_bounded(str(path), limit=99)[0] is None
    real_fstat = os.fstat
    monkeypatch.setattr(disk_cache.os, "fstat", lambda fd: os.stat_result((0,) * 6 + (10,) + (0,) * 3)
                        if fd >= 0 else real_fstat(fd))  # the size says 10 bytes
    blob, problem = disk_cache.read_bounded(str(path), limit=50)
    assert blob is None and "larger than the 50-byte bound" in problem


def test_an_entry_above_the_bound_is_not_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_cache, "MAX_ENTRY_BYTES", 4096)
    c = store(tmp_path)
    assert c.store("k" * 64, "big", b"x" * 4096) is None
    assert c.load("k" * 64, "big") == (b"x" * 4096, None)  # kept in memory
    assert not list(tmp_path.glob("*.bin")) and "above the 4096-byte bound" in caplog.text
    assert c.store("k" * 64, "small", b"x" * 1000) is not None


def test_stale_temporary_files_are_removed_when_a_store_opens_its_folder(tmp_path):
    """A writer that died between writing and renaming leaves .tmp-*.part: one older than STALE_TEMP_SECONDS is
    removed; a fresh one (a write in progress in another process) and files of other names are left alone."""
    old = time.time() - disk_cache.STALE_TEMP_SECONDS - 60
    names = {"stale": ".tmp-abc123.part", "fresh": ".tmp-def456.part", "entry_like": "attn-0123.bin",
             "old_other": "notes.part", "old_dot": ".tmp-keep.txt"}
    for what, name in names.items():
        (tmp_path / name).write_bytes(b"x" * 10)
        if what != "fresh":
            os.utime(tmp_path / name, (old, old))
    (tmp_path / ".tmp-dir.part").mkdir()  # not a file: left alone
    os.utime(tmp_path / ".tmp-dir.part", (old, old))
    store(tmp_path)
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(set(names.values()) - {names["stale"]} | {".tmp-dir.part"}), left
    assert disk_cache.remove_stale_temporaries(str(tmp_path), older_than=-1) == [names["fresh"]]
    assert disk_cache.remove_stale_temporaries(str(tmp_path / "missing")) == []


def test_entry_of_another_key_is_stale(tmp_path):
    c = store(tmp_path)
    key, other = disk_cache.cache_key(**BASE), disk_cache.cache_key(**{**BASE, "runtime": "hip-1"})
    path = c.store(other, "attn", b"old build")
    os.replace(path, c.path(key, "attn"))  # an entry under the right name whose contents are for another key
    assert store(tmp_path).load(key, "attn") == (None, None)
    assert not os.path.exists(c.path(key, "attn"))


def test_discard_forgets_the_memory_copy_of_the_key_the_file_held(tmp_path):
    c = store(tmp_path)
    key = disk_cache.cache_key(**BASE)
    path = c.store(key, "attn", b"image")
    c.discard(path)
    assert key not in c.memory and not os.path.exists(path)
    c.discard(str(tmp_path / "never-there.bin"), "k")  # nothing to remove: no exception


def test_unwritable_cache_keeps_memory_copy(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(disk_cache.tempfile, "gettempdir", lambda: str(blocker))
    c = store(blocker / "sub")  # cannot create a folder under a file, nor the temp fallback
    assert c.folder is None
    assert c.store("k" * 64, "attn", b"abc") is None
    assert c.load("k" * 64, "attn") == (b"abc", None)
    assert c.store_json("j" * 64, "pass", {"verdict": "pass"}) is None
    assert c.load_json("j" * 64, "pass") == {"verdict": "pass"}


def test_a_folder_it_cannot_create_falls_back_to_the_temp_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(disk_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    c = disk_cache.EntryStore(disk_cache.SELF_CHECK_PASSES, str(blocker / "sub"))
    assert c.folder == disk_cache.fallback_folder(disk_cache.SELF_CHECK_PASSES)
    assert c.folder.startswith(str(tmp_path / "tmp" / disk_cache.FOLDER_NAME))


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "dir_in_the_way"
    target.mkdir()
    (target / "child").write_text("x")  # os.replace onto a non-empty folder fails
    with pytest.raises(OSError):
        disk_cache.write_atomically(str(target), b"data")
    assert sorted(os.listdir(tmp_path)) == ["dir_in_the_way"]


def test_every_kind_writes_the_same_entry_format(tmp_path):
    """Passes and decisions are JSON payloads in the checksummed entry, as code objects are bytes in it."""
    for kind in disk_cache.KINDS:
        c = disk_cache.EntryStore(kind, str(tmp_path / kind))
        path = c.store_json(disk_cache.cache_key(kind=kind), kind, {"kind": kind})
        blob = open(path, "rb").read()
        assert blob.startswith(disk_cache.MAGIC)
        payload, problem = disk_cache.decode_entry(blob, disk_cache.cache_key(kind=kind))
        assert problem == "" and json.loads(payload) == {"kind": kind}


# -- the shared temp folder: private to this user, or not used --------------------------------------------------

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes (Windows: per-user temp)")


def unusable_cache(tmp_path, monkeypatch):
    """The cache folder cannot be made (a file is in the way); the system temp folder is tmp_path/tmp."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv(CACHE.name, str(blocker / "cache"))
    monkeypatch.setattr(disk_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def plant(kind, key, mode=None, root_mode=None):
    """Another user's entry for `key` in the temp fallback of `kind` (a pass, a decision, a code object)."""
    folder = disk_cache.fallback_folder(kind)
    planted = disk_cache.EntryStore(kind, folder).store(key, "planted", b'{"verdict": "pass"}')
    assert planted and os.path.isfile(planted)
    if mode is not None:
        os.chmod(folder, mode)
    if root_mode is not None:
        os.chmod(os.path.dirname(folder), root_mode)
    return folder


@posix_only
def test_the_temp_fallback_is_per_user_and_private(tmp_path, monkeypatch):
    unusable_cache(tmp_path, monkeypatch)
    c = disk_cache.EntryStore(KIND)
    root = tmp_path / "tmp" / f"{disk_cache.FOLDER_NAME}-{os.getuid()}"
    assert c.folder == str(root / KIND)
    for folder in (root, root / KIND):
        assert os.stat(folder).st_mode & 0o777 == 0o700, oct(os.stat(folder).st_mode)
    assert c.store(disk_cache.cache_key(**BASE), "attn", b"image")  # and it is used
    assert store(root / KIND).load(disk_cache.cache_key(**BASE), "attn")[0] == b"image"


@posix_only
@pytest.mark.parametrize("kind", disk_cache.KINDS)
@pytest.mark.parametrize("how", ["kind folder 0777", "its parent 0777", "owned by another user"])
def test_a_temp_fallback_others_can_write_or_own_is_refused(tmp_path, monkeypatch, caplog, kind, how):
    """Whatever the temp fallback is named, one that another user owns or may write (and may have planted a
    self-check pass, a decision or a code object in) is not read: memory only, logged once."""
    unusable_cache(tmp_path, monkeypatch)
    key = disk_cache.cache_key(what="planted")
    if how == "owned by another user":
        real = os.getuid()
        monkeypatch.setattr(disk_cache.os, "getuid", lambda: real + 1)  # the folder below is real's, not ours
        folder = plant(kind, key)
    else:
        folder = plant(kind, key, **({"mode": 0o777} if how == "kind folder 0777" else {"root_mode": 0o777}))
    with caplog.at_level("WARNING", logger=disk_cache.__name__):
        first, second = disk_cache.EntryStore(kind), disk_cache.EntryStore(kind)
    assert first.folder is None and second.folder is None
    assert first.load(key, "planted") == (None, None)
    assert first.load_json(key, "planted") is None
    refusals = [r for r in caplog.records if folder in r.getMessage() or os.path.dirname(folder) in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    assert first.store(key, "mine", b"kept") is None and first.load(key, "mine") == (b"kept", None)  # memory


@posix_only
def test_a_planted_pass_in_a_shared_temp_folder_is_no_pass(tmp_path, monkeypatch):
    """End to end through the pass cache: a pass another user could have written never skips a self-check."""
    unusable_cache(tmp_path, monkeypatch)
    cache = PassCache(enabled=True)
    key = cache.key("hip_int8_fp8", None, None, "checks", identity={"gpu": "AMD Radeon RX 9070 XT", "arch": "gfx1201"})
    folder = disk_cache.fallback_folder(disk_cache.SELF_CHECK_PASSES)
    os.makedirs(folder)
    disk_cache.EntryStore(disk_cache.SELF_CHECK_PASSES, folder).store_json(
        key, "selfcheck-hip_int8_fp8", {"verdict": "pass", "backend": "hip_int8_fp8"})
    os.chmod(folder, 0o777)
    assert not cache.has_pass(key, "hip_int8_fp8")


def test_without_posix_owners_the_temp_fallback_is_the_per_user_temp_folder(tmp_path, monkeypatch):
    """Windows has no os.getuid: its temp folder is the user's own (%TEMP% in the profile), used as it is."""
    unusable_cache(tmp_path, monkeypatch)
    monkeypatch.delattr(disk_cache.os, "getuid", raising=False)
    assert disk_cache.EntryStore(KIND).folder == str(tmp_path / "tmp" / disk_cache.FOLDER_NAME / KIND)
