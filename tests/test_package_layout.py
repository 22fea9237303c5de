"""The package's shape (issue 9): no import cycles between the project's modules, and nothing a user's run
imports reaches kernels/verify/ (the tooling only tests and developers run).

The import graph is read from the source with `ast`: every import statement, also those inside functions,
relative ones resolved against the importing module's package. `from X import a` is an edge to the module
X.a when that is one of ours, else to X. Dynamic imports (importlib) are not edges: the one the pack makes is
checked on its own (`test_the_only_dynamic_import_of_the_verification_folder_is_the_emulations`).
"""
import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACK = "comfyui_sage_rdna4"  # the name tests/conftest.py loads the repository under
VERIFY = f"{PACK}.kernels.verify"
SKIP_DIRS = {"__pycache__", "node_modules"}


def module_files(root: Path, pack: str) -> Dict[str, Path]:
    """Every .py file below `root` by its dotted name as if `root` were the package `pack`."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for f in files:
            if f.endswith(".py"):
                rel = (Path(folder) / f).relative_to(root).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"] if rel.name == "__init__" else list(rel.parts)
                found[".".join([pack] + parts)] = Path(folder) / f
    return found


def _resolve(name: str, modules: Set[str]) -> str:
    """`name` or its longest prefix that is one of our modules ('' when none is)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: Path, pack: str) -> Dict[str, Set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    files = module_files(root, pack)
    modules = set(files)
    graph: Dict[str, Set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges.update(_resolve(alias.name, modules) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in modules else _resolve(base, modules))
        edges.discard("")
        edges.discard(mod)  # `from . import x` inside pkg/__init__ naming itself is no cycle
        graph[mod] = edges
    return graph


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


# ------------------------------------------------------------------ the tools, on graphs with known answers
def test_cycle_finder_on_synthetic_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"x": {"x"}}) == [["x"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}})
    assert sorted(two) == [["a", "b"], ["c", "d"]]


def test_graph_builder_finds_a_cycle_through_a_function_level_relative_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub.b import g\n    return g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\n\ndef g():\n    return 1\n")
    (pkg / "c.py").write_text("from .sub import b\nimport os\n")
    graph = import_graph(pkg, "p")
    assert graph["p"] == {"p.a"}
    assert graph["p.a"] == {"p.sub.b"}
    assert graph["p.sub.b"] == {"p.a"}
    assert graph["p.c"] == {"p.sub.b"}
    assert find_cycles(graph) == [["p.a", "p.sub.b"]]
    (pkg / "a.py").write_text("def f():\n    return 1\n")
    assert find_cycles(import_graph(pkg, "p")) == []


# ------------------------------------------------------------------ the project
@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACK)


def test_the_graph_sees_the_project(graph):
    k = f"{PACK}.kernels"
    assert f"{k}.backends.hip.compiler" in graph[f"{k}.backends.hip.runtime"]
    assert f"{k}.backends.hip.platform" in graph[f"{k}.backends.hip.compiler"]
    assert f"{k}.backends.hip.prologue" in graph[f"{k}.backends.triton.backend"]  # a function-level import
    assert f"{k}.registry" in graph[f"{k}.backends"]
    assert f"{VERIFY}.hip_checks" in graph[f"{PACK}.tests.test_host_sim"]


def test_no_import_cycles(graph):
    assert find_cycles(graph) == []


def test_compiler_and_runtime_do_not_import_each_other(graph):
    hip = f"{PACK}.kernels.backends.hip"
    assert f"{hip}.runtime" not in graph[f"{hip}.compiler"]


def test_only_tests_and_the_verification_tooling_import_it(graph):
    allowed = (VERIFY, f"{PACK}.tests")
    offenders = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
                       if (dep == VERIFY or dep.startswith(VERIFY + "."))
                       and not any(mod == a or mod.startswith(a + ".") for a in allowed))
    assert offenders == []


def _imports(graph, mod: str, prefix: str) -> List[str]:
    return sorted(d for d in graph[mod] if d == prefix or d.startswith(prefix + "."))


def _below(graph, prefix: str) -> List[str]:
    return sorted(m for m in graph if m == prefix or m.startswith(prefix + "."))


def test_calls_go_one_way_nodes_sage_patch_kernels(graph):
    """nodes import sage_patch only (never kernels); kernels import neither; sage_patch never imports nodes."""
    nodes, bridge, kernels = f"{PACK}.nodes", f"{PACK}.sage_patch", f"{PACK}.kernels"
    assert _below(graph, nodes) and _below(graph, bridge) and _below(graph, kernels)
    offenders = [f"{m} -> {d}" for m in _below(graph, nodes) for d in _imports(graph, m, kernels)]
    offenders += [f"{m} -> {d}" for m in _below(graph, kernels) for p in (bridge, nodes) for d in _imports(graph, m, p)]
    offenders += [f"{m} -> {d}" for m in _below(graph, bridge) for d in _imports(graph, m, nodes)]
    assert offenders == []


def _third_party_imports(path: Path) -> Set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_kernels_never_import_comfyui():
    files = module_files(ROOT / "kernels", f"{PACK}.kernels")
    offenders = sorted(str(p.relative_to(ROOT)) for p in files.values()
                       if _third_party_imports(p) & {"comfy", "comfy_api", "comfy_extras", "comfy_execution"})
    assert len(files) > 30 and offenders == []


# The selection's modules, highest first: each imports only modules after it (never one before it), so one call's
# route is asked (routing, registry), gated (gating) and measured (tuner, step_trials, decisions) in one descent.
SELECTION_LAYERS = ("dispatch", "routing", "tuner", "registry", "gating", "pass_cache", "self_check",
                    "step_trials", "decisions", "generation")


def test_the_selection_modules_import_downward_only(graph):
    k = f"{PACK}.kernels"
    for i, name in enumerate(SELECTION_LAYERS):
        above = {f"{k}.{n}" for n in SELECTION_LAYERS[:i]}
        assert f"{k}.{name}" in graph and not graph[f"{k}.{name}"] & above, (name, graph[f"{k}.{name}"] & above)
    # and the one module that takes the steps is the only one that imports both the gate and the tuner
    both = [m for m, deps in graph.items() if {f"{k}.gating", f"{k}.tuner"} <= deps and "tests" not in m]
    assert both == [f"{k}.dispatch"]
    # The pass cache and the numeric check sit side by side: the cache keys by the fingerprint gating hands it.
    assert f"{k}.self_check" not in graph[f"{k}.pass_cache"] and f"{k}.pass_cache" not in graph[f"{k}.self_check"]


def _dynamic_imports(path: Path) -> List[str]:
    """The module names a file passes to importlib.import_module / __import__ as literals or module constants."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    # A function that hands its parameter to importlib (the backends' lazy loader) is judged by what it is called with.
    loaders = {f.name: f.args.args[0].arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.args.args}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            arg = node.args[0]
            if name in loaders and any(isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "import_module"
                                       and isinstance(c.args[0], ast.Name) and c.args[0].id == loaders[name]
                                       for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name
                                       for c in ast.walk(f) if isinstance(c, ast.Call) and c.args):
                found.append(arg.value if isinstance(arg, ast.Constant) else "<computed>")
                continue
            if name in ("import_module", "__import__"):
                if isinstance(arg, ast.Name) and any(arg.id == p for p in loaders.values()):
                    continue  # the loader's parameter: its callers were collected above
                if isinstance(arg, ast.Constant):
                    found.append(str(arg.value))
                elif isinstance(arg, ast.Name):
                    found.append(constants.get(arg.id, f"<{arg.id}>"))
                else:
                    found.append("<computed>")
    return found


def test_the_only_dynamic_import_of_the_verification_folder_is_the_emulations():
    """A user's run imports nothing under kernels/verify/, by statement or through importlib: the one importlib
    import of it, the gfx12 emulation's CUDA platform, is behind the developer setting SAGE_RDNA4_HIP_EMULATE=1
    (`test_a_users_run_works_without_the_verification_folder` runs that refusal with the folder blocked)."""
    found = {}
    for top in ("kernels", "sage_patch", "nodes"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "verify" not in path.relative_to(ROOT).parts:
                for name in _dynamic_imports(path):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    verify = {n: f for n, f in found.items() if "verify" in n or n.startswith("<")}
    assert verify == {"...verify.cuda_twin": ["kernels/backends/hip/runtime.py"]}, found
    source = (ROOT / "kernels" / "backends" / "hip" / "runtime.py").read_text(encoding="utf-8")
    gate = source.index("if not settings.hip_emulation_requested():")
    assert gate < source.index("importlib.import_module(EMULATION_MODULE") < gate + 400


# The CUDA driver and compiler by name: the CUDA twin (kernels/verify/cuda_twin.py) holds what uses them.
CUDA_NAMES = re.compile(r"libcuda|nvcuda|nvrtc|cudart|\bcu[A-Z][A-Za-z0-9_]*")


def test_the_hip_backend_holds_nothing_cuda_specific():
    """kernels/backends/hip/ is what an RDNA4 user's run loads: no CUDA driver or compiler in it, by name."""
    hits = []
    for path in sorted((ROOT / "kernels" / "backends" / "hip").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            data = path.read_bytes()
            if b"\0" in data:  # a shipped code object: machine code, whose bytes can spell anything
                continue
            for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                found = CUDA_NAMES.findall(line) + re.findall(r"(?i)libcuda|nvrtc", line)
                if found:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {sorted(set(found))}")
    assert hits == []
    assert CUDA_NAMES.search("bind(lib, 'cuModuleLoadData')") and CUDA_NAMES.search("libnvrtc.so.13")


def test_the_cuda_twin_lives_with_the_verification_tooling(graph):
    hip = f"{PACK}.kernels.backends.hip"
    assert f"{hip}.runtime" in graph[f"{VERIFY}.cuda_twin"] and f"{hip}.compiler" in graph[f"{VERIFY}.cuda_twin"]
    assert not [d for d in graph[f"{hip}.runtime"] if d.startswith(VERIFY)]  # imported dynamically, when asked for


USER_RUN = textwrap.dedent('''
    import copy, importlib, importlib.abc, importlib.util, os, sys
    ROOT, PACK, TESTS = sys.argv[1], sys.argv[2], sys.argv[3]
    BLOCKED = PACK + ".kernels.verify"

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == BLOCKED or name.startswith(BLOCKED + "."):
                raise ImportError(f"{name} is blocked: a user's run must not import it")
            return None

    sys.meta_path.insert(0, Block())
    spec = importlib.util.spec_from_file_location(PACK, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = pack
    spec.loader.exec_module(pack)

    # Every module a user's run may load, imported directly (the registry would turn an import error of a
    # backend module into an "unavailable" reason and hide it).
    for top in ("kernels", "sage_patch"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (rel == "kernels" and d == "verify")]
            for f in sorted(files):
                if f.endswith(".py"):
                    name = f"{PACK}.{rel}" + ("" if f == "__init__.py" else "." + f[:-3])
                    try:
                        importlib.import_module(name)
                    except ModuleNotFoundError as exc:  # a third-party package this machine lacks (triton)
                        if (exc.name or "").startswith(PACK):
                            raise
                        print("not importable here:", name, exc)

    import torch
    from comfyui_sage_rdna4.kernels import available_backends, sage_attention
    from comfyui_sage_rdna4.kernels.metrics import cosine
    from comfyui_sage_rdna4.sage_patch import PatchConfig, install

    reasons = available_backends("cpu")
    assert reasons["reference"] is None and reasons["sdpa"] is None, reasons
    assert not any("blocked" in (r or "") for r in reasons.values()), reasons

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    out = sage_attention(q, k, v, kernel="reference")
    assert cosine(out, torch.nn.functional.scaled_dot_product_attention(q, k, v)) > 0.99

    sys.path.insert(0, TESTS)  # the stand-ins the other tests use (never the repository root)
    from fakes import FakePatcher  # ComfyUI's ModelPatcher, as much as patch_model uses
    from fakes import comfy_attention  # ComfyUI's attention function, as wrap_attn hands it over

    class TinyModel(torch.nn.Module):  # one self-attention block that calls attention as ComfyUI's wrap_attn does
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)
        def forward(self, x, transformer_options):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            override = transformer_options.get("optimized_attention_override")
            if override is None:
                return comfy_attention(q, k, v, 2, _inside_attn_wrapper=True)
            return override(comfy_attention, q, k, v, 2, transformer_options=transformer_options,
                            _inside_attn_wrapper=True)

    install.override_hook_missing = lambda: None  # no ComfyUI here
    patched, override = install.patch_model(FakePatcher(), PatchConfig(kernel="reference"))
    model = TinyModel()
    x = torch.randn(1, 80, 64, generator=g)
    with torch.no_grad():
        got = model(x, patched.model_options["transformer_options"])
        want = model(x, {})
    assert cosine(got, want) > 0.99
    assert override.stats.snapshot()["calls"] == {"reference": 1}, override.stats.snapshot()

    # The one dynamic import of the folder, the emulation's platform, is refused with its reason when not asked for.
    os.environ.pop("SAGE_RDNA4_HIP_EMULATE", None)
    from comfyui_sage_rdna4.kernels.backends.hip import runtime
    try:
        runtime.get_platform(runtime.EMULATION_KIND)
    except runtime.RuntimeUnavailable as exc:
        assert "SAGE_RDNA4_HIP_EMULATE=1" in str(exc), exc
    else:
        raise AssertionError("the emulation's platform came without being asked for")

    assert not [m for m in sys.modules if m == BLOCKED or m.startswith(BLOCKED + ".")]
    try:  # the block itself works
        importlib.import_module(BLOCKED)
    except ImportError:
        pass
    else:
        raise AssertionError("the verification folder was importable")
    print("user run without kernels/verify: ok")
''')


def test_a_users_run_works_without_the_verification_folder(tmp_path):
    script = tmp_path / "user_run.py"
    script.write_text(USER_RUN)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, str(script), str(ROOT), PACK, str(ROOT / "tests")], capture_output=True,
                         text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "user run without kernels/verify: ok" in res.stdout
