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
PENDING = set()  # (file, name) of a setting still read directly while it moves; none now


def test_every_setting_is_declared_once_with_a_default_and_a_meaning():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) == 13
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

@pytest.fixture(autouse=True)
def parsed_afresh(monkeypatch):
    """Each test parses (and warns) as a new process would: values are remembered per process."""
    monkeypatch.setattr(settings, "_parsed", {})


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == settings.__name__ and r.levelname == "WARNING"]


SWITCHES = [  # (setting, its function, value when unset)
    (settings.AUTOTUNE, settings.autotune_enabled, True),
    (settings.AUTOTUNE_CACHE, settings.autotune_cache_enabled, True),
    (settings.SELF_CHECK, settings.self_check_enabled, True),
    (settings.SELF_CHECK_CACHE, settings.self_check_cache_enabled, True),
    (settings.HIP_EMULATE, settings.hip_emulation_requested, False),
    (settings.EMU_FP8_NONSAT, settings.emu_fp8_nonsat_requested, False),
    (settings.TRITON_PRECOMPILE, settings.triton_precompile, True),
]
CHOICES = [  # (setting, its function: True for the non-default word, that word)
    (settings.TRITON_FP8_CVT, settings.triton_fp8_cvt_software, "software"),
    (settings.TRITON_LAUNCH, settings.triton_launch_through_triton, "triton"),
]
ON_WORDS = ("1", "true", "True", "ON", "yes", " yes ", "\tYes\n")
OFF_WORDS = ("0", " 0", "false", "FALSE", "off", "Off ", "no", "NO")


@pytest.mark.parametrize("setting, read, unset", SWITCHES + [(s, f, False) for s, f, _ in CHOICES],
                         ids=[s.name for s, _, _ in SWITCHES + CHOICES])
def test_settings_default_when_unset_empty_or_blank(monkeypatch, caplog, setting, read, unset):
    monkeypatch.delenv(setting.name, raising=False)
    assert read() is unset
    for blank in ("", " ", "\t"):
        monkeypatch.setenv(setting.name, blank)
        assert read() is unset, repr(blank)
    assert warnings_of(caplog) == []  # unset and blank are the default, nothing to warn about


@pytest.mark.parametrize("setting, read, unset", SWITCHES, ids=[s.name for s, _, _ in SWITCHES])
def test_switches_take_the_documented_words_in_any_case_and_spacing(monkeypatch, caplog, setting, read, unset):
    for text in ON_WORDS:
        monkeypatch.setenv(setting.name, text)
        assert read() is True, repr(text)
    for text in OFF_WORDS:
        monkeypatch.setenv(setting.name, text)
        assert read() is False, repr(text)
    assert warnings_of(caplog) == []
    assert setting.accepted == settings.SWITCH_WORDS == "1/true/on/yes or 0/false/off/no"


@pytest.mark.parametrize("setting, read, unset", SWITCHES, ids=[s.name for s, _, _ in SWITCHES])
def test_any_other_switch_value_is_the_default_with_one_warning(monkeypatch, caplog, setting, read, unset):
    for text in ("2", "-1", "nope", "0x0", "o n", "enable"):
        caplog.clear()
        monkeypatch.setenv(setting.name, text)
        assert read() is unset and read() is unset, text  # asked twice: warned once
        got = warnings_of(caplog)
        assert len(got) == 1 and "\n" not in got[0], got
        assert got[0].startswith(f"{setting.name}={text!r} ") and settings.SWITCH_WORDS in got[0]
        assert got[0].endswith(f"using the default, {'1 (on)' if unset else '0 (off)'}"), got[0]


def test_the_issues_switch_values(monkeypatch):
    """The values that used to read wrong: "false" and " 0" left the self-check on, "false" turned the
    emulation's non-saturating FP8 on."""
    for text in ("false", " 0", "off", "No"):
        monkeypatch.setenv(settings.SELF_CHECK.name, text)
        assert settings.self_check_enabled() is False, text
    monkeypatch.setenv(settings.EMU_FP8_NONSAT.name, "false")
    assert settings.emu_fp8_nonsat_requested() is False
    monkeypatch.setenv(settings.HIP_EMULATE.name, "yes")
    assert settings.hip_emulation_requested() is True


@pytest.mark.parametrize("setting, read, word", CHOICES, ids=[s.name for s, _, _ in CHOICES])
def test_choices_take_their_words_in_any_case_and_spacing(monkeypatch, caplog, setting, read, word):
    default = setting.default
    assert setting.accepted == f"{default} or {word}"
    for text in (word, word.upper(), f" {word.capitalize()} "):
        monkeypatch.setenv(setting.name, text)
        assert read() is True, repr(text)
    for text in (default, default.upper() + " "):
        monkeypatch.setenv(setting.name, text)
        assert read() is False, repr(text)
    assert warnings_of(caplog) == []
    for text in (word[:-1], "1", "yes", word + "s"):
        caplog.clear()
        monkeypatch.setenv(setting.name, text)
        assert read() is False, text
        got = warnings_of(caplog)
        assert len(got) == 1 and got[0].startswith(f"{setting.name}={text!r} ") and \
            got[0].endswith(f"using the default, {default}"), got


def test_the_cache_folder(monkeypatch, caplog, tmp_path):
    monkeypatch.delenv(settings.CACHE.name, raising=False)
    assert settings.cache_dir() is None
    for blank in ("", " ", "\t "):
        monkeypatch.setenv(settings.CACHE.name, blank)
        assert settings.cache_dir() is None
    monkeypatch.setenv(settings.CACHE.name, str(tmp_path / "c"))
    assert settings.cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv(settings.CACHE.name, f"  {tmp_path / 'c'} ")
    assert settings.cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv(settings.CACHE.name, os.path.join("~", "sage"))
    assert settings.cache_dir() == os.path.expanduser(os.path.join("~", "sage"))
    assert os.path.isabs(settings.cache_dir())
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("text", ["-1", "../../x", "cache", os.path.join(".", "c"), "~nosuchuser_sage/x"])
def test_a_relative_cache_folder_is_the_default_with_a_warning(monkeypatch, caplog, tmp_path, text):
    """A relative path would land wherever ComfyUI happened to start: the default folder is used instead, and
    nothing is created under the working directory."""
    from comfyui_sage_rdna4.kernels import disk_cache
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "xdg"))
    monkeypatch.setenv(settings.CACHE.name, text)
    assert settings.cache_dir() is None
    got = warnings_of(caplog)
    assert got == [f"{settings.CACHE.name}={text!r} is not an absolute path; using the default, the user cache "
                   f"folder"], got
    assert disk_cache.usable_folder(disk_cache.AUTO_DECISIONS) == str(tmp_path / "xdg" / disk_cache.FOLDER_NAME /
                                                                        disk_cache.AUTO_DECISIONS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xdg"]  # nothing made relative to the working directory


@pytest.mark.parametrize("text, mib, warned", [
    (None, 128, None), ("", 128, None), (" ", 128, None), ("0", 0, None), ("2", 2, None), (" 2 ", 2, None),
    ("0.5", 0.5, None), ("65536", 65536, None),
    ("-3", 0, "is outside 0..65536 MiB; using 0"),
    ("99999999999999999999999", 65536, "is outside 0..65536 MiB; using 65536"),
    ("1e300", 65536, "is outside 0..65536 MiB; using 65536"),
    ("lots", 128, "is not a number of MiB; using the default, 128"),
    ("12MB", 128, "is not a number of MiB; using the default, 128"),
    ("inf", 128, "is not a number of MiB; using the default, 128"),
    ("nan", 128, "is not a number of MiB; using the default, 128"),
])
def test_the_workspace_budget(monkeypatch, caplog, text, mib, warned):
    if text is None:
        monkeypatch.delenv(settings.WORKSPACE_MB.name, raising=False)
    else:
        monkeypatch.setenv(settings.WORKSPACE_MB.name, text)
    assert settings.workspace_budget_bytes() == int(mib * 2 ** 20)
    assert settings.DEFAULT_WORKSPACE_MB == 128 and settings.WORKSPACE_MB.default == "128"
    assert settings.MAX_WORKSPACE_MB == 65536
    want = [] if warned is None else [f"{settings.WORKSPACE_MB.name}={text!r} {warned}"]
    assert warnings_of(caplog) == want


def test_settings_are_read_when_asked(monkeypatch):
    monkeypatch.setenv(settings.AUTOTUNE.name, "0")
    assert not settings.autotune_enabled()
    monkeypatch.setenv(settings.AUTOTUNE.name, "1")
    assert settings.autotune_enabled()
    monkeypatch.setenv(settings.AUTOTUNE.name, "off")
    assert not settings.autotune_enabled()


def test_in_effect_names_each_set_variable_with_the_value_used(monkeypatch):
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    monkeypatch.setenv(settings.SELF_CHECK.name, " False ")
    monkeypatch.setenv(settings.WORKSPACE_MB.name, "1e30")
    monkeypatch.setenv(settings.CACHE.name, "rel")
    assert settings.in_effect() == {
        settings.CACHE.name: {"text": "rel", "used": None},
        settings.SELF_CHECK.name: {"text": " False ", "used": False},
        settings.WORKSPACE_MB.name: {"text": "1e30", "used": 65536.0}}


def test_the_readme_documents_the_accepted_values():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Settings"):readme.index("## Tests")]
    assert "`1`, `true`, `on`, `yes`" in table and "`0`, `false`, `off`, `no`" in table
    assert "case and\nsurrounding spaces ignored" in table and "absolute" in table and "one-line warning" in table
    assert str(settings.MAX_WORKSPACE_MB) in table


def test_hip_pv_chain_takes_its_three_words(monkeypatch, caplog):
    """auto (default), two-level or single, in any case and spacing; anything else is auto with one warning."""
    assert settings.HIP_PV_CHAIN.accepted == "auto, two-level or single"
    monkeypatch.delenv(settings.HIP_PV_CHAIN.name, raising=False)
    assert settings.hip_pv_chain() == "auto"
    for text, want in ((" Single ", "single"), ("TWO-LEVEL", "two-level"), ("auto", "auto")):
        monkeypatch.setenv(settings.HIP_PV_CHAIN.name, text)
        assert settings.hip_pv_chain() == want, text
    assert warnings_of(caplog) == []
    monkeypatch.setenv(settings.HIP_PV_CHAIN.name, "twolevel")
    assert settings.hip_pv_chain() == "auto"
    assert len(warnings_of(caplog)) == 1 and "twolevel" in warnings_of(caplog)[0]
