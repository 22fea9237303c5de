"""kernels/settings.py: the one place SAGE_RDNA4_* variables are read. The README's Settings table names
exactly the variables it declares, no other module of the pack reads one, and each is parsed as documented."""
import ast
import os
import re
from pathlib import Path

import pytest

from comfyui_sage_rdna4.kernels import settings

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"SAGE_RDNA4_[A-Z0-9_]+")
SCANNED = ("kernels", "sage_patch", "nodes")
# Read through a module constant, not settings, until the lead's rewrite of SelfCheck.guard lands
# (it then asks settings.self_check_enabled()); drop the entry with that rewrite.
PENDING = set()  # (file, name) of a setting still read directly while it moves; none now


def test_every_setting_is_declared_once_with_a_default_and_a_meaning():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) == 10
    for s in settings.SETTINGS:
        assert NAME.fullmatch(s.name) and s.default and s.doc and "\n" not in s.doc, s


def test_the_readme_names_exactly_the_declared_settings():
    """The README's Settings table lists each variable; if the README lists others, or misses one, this fails."""
    in_readme = set(NAME.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert in_readme == {s.name for s in settings.SETTINGS}


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path.relative_to(ROOT).as_posix(), path


def _docstrings(tree):
    """The string nodes that are docstrings (of the module, a class or a function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _environment_keys(tree):
    """The key expression of every os.environ[...] / os.environ.get(...) / os.getenv(...) / ... in os.environ."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            yield node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (is_environ(node.func.value) and node.func.attr in ("get", "pop", "setdefault")) or \
                    node.func.attr == "getenv":
                yield node.args[0]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.left


def test_no_module_but_settings_reads_a_sage_rdna4_variable():
    """Outside kernels/settings.py no code names a SAGE_RDNA4_ variable (docstrings and comments may) and
    every environment read names its variable literally, so none can hide behind a constant."""
    named, indirect = [], []
    for rel, path in _sources():
        if rel == "kernels/settings.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), rel)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and NAME.search(node.value):
                named.append(f"{rel}:{node.lineno}: {node.value!r}")
        for key in _environment_keys(tree):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if NAME.search(key.value):
                    named.append(f"{rel}:{key.lineno}: reads {key.value}")
            elif not (isinstance(key, ast.Name) and (rel, key.id) in PENDING):
                indirect.append(f"{rel}:{key.lineno}: {ast.unparse(key)}")
    assert named == [] and indirect == []


def test_the_scan_sees_what_it_must_refuse(tmp_path):
    bad = ('import os\nX = os.environ.get("SAGE_RDNA4_AUTOTUNE")\nNAME = "FOO"\n'
           'Y = os.environ[NAME]\nZ = "SAGE_RDNA4_CACHE" in os.environ\n')
    tree = ast.parse(bad)
    keys = [ast.unparse(k) for k in _environment_keys(tree)]
    assert keys == ["'SAGE_RDNA4_AUTOTUNE'", "NAME", "'SAGE_RDNA4_CACHE'"]
    assert not _docstrings(tree)


# -- parsing ----------------------------------------------------------------------------------------

SWITCHES = [  # (setting, its function, value when unset)
    (settings.AUTOTUNE, settings.autotune_enabled, True),
    (settings.AUTOTUNE_CACHE, settings.autotune_cache_enabled, True),
    (settings.SELF_CHECK, settings.self_check_enabled, True),
    (settings.SELF_CHECK_CACHE, settings.self_check_cache_enabled, True),
    (settings.HIP_EMULATE, settings.hip_emulation_requested, False),
    (settings.TRITON_FP8_CVT, settings.triton_fp8_cvt_software, False),
    (settings.TRITON_LAUNCH, settings.triton_launch_through_triton, False),
]


@pytest.mark.parametrize("setting, read, unset", SWITCHES, ids=[s.name for s, _, _ in SWITCHES])
def test_switches_default_when_unset_or_empty(monkeypatch, setting, read, unset):
    monkeypatch.delenv(setting.name, raising=False)
    assert read() is unset
    monkeypatch.setenv(setting.name, "")
    assert read() is unset


@pytest.mark.parametrize("setting, read", [(s, f) for s, f, unset in SWITCHES if unset],
                         ids=[s.name for s, _, unset in SWITCHES if unset])
def test_on_switches_turn_off_only_with_zero(monkeypatch, setting, read):
    for text, want in (("0", False), ("1", True), ("no", True), ("false", True), (" 0", True)):
        monkeypatch.setenv(setting.name, text)
        assert read() is want, text


@pytest.mark.parametrize("setting, read, value", [
    (settings.HIP_EMULATE, settings.hip_emulation_requested, "1"),
    (settings.TRITON_FP8_CVT, settings.triton_fp8_cvt_software, "software"),
    (settings.TRITON_LAUNCH, settings.triton_launch_through_triton, "triton"),
], ids=["HIP_EMULATE", "TRITON_FP8_CVT", "TRITON_LAUNCH"])
def test_off_switches_turn_on_only_with_their_value(monkeypatch, setting, read, value):
    monkeypatch.setenv(setting.name, value)
    assert read() is True
    for other in {"0", "yes", value.upper(), value + " "} - {value}:
        monkeypatch.setenv(setting.name, other)
        assert read() is False, other


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.CACHE.name, raising=False)
    assert settings.cache_dir() is None
    monkeypatch.setenv(settings.CACHE.name, "")
    assert settings.cache_dir() is None
    monkeypatch.setenv(settings.CACHE.name, str(tmp_path / "c"))
    assert settings.cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv(settings.CACHE.name, os.path.join("~", "sage"))
    assert settings.cache_dir() == os.path.expanduser(os.path.join("~", "sage"))


@pytest.mark.parametrize("text, mib", [
    (None, 128), ("", 128), ("0", 0), ("2", 2), ("0.5", 0.5), ("-3", 0),
    ("lots", 128), ("12MB", 128), ("inf", 128), ("nan", 128),
])
def test_the_workspace_budget(monkeypatch, text, mib):
    if text is None:
        monkeypatch.delenv(settings.WORKSPACE_MB.name, raising=False)
    else:
        monkeypatch.setenv(settings.WORKSPACE_MB.name, text)
    assert settings.workspace_budget_bytes() == int(mib * 2 ** 20)
    assert settings.DEFAULT_WORKSPACE_MB == 128 and settings.WORKSPACE_MB.default == "128"


def test_settings_are_read_when_asked(monkeypatch):
    monkeypatch.setenv(settings.AUTOTUNE.name, "0")
    assert not settings.autotune_enabled()
    monkeypatch.setenv(settings.AUTOTUNE.name, "1")
    assert settings.autotune_enabled()
