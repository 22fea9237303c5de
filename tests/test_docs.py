"""The documents a user and a contributor read: the README stays short, and every relative link resolves
(to a file of the repository, and to a heading of it where the link names one)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_CHARS = 18_000  # raised from 16,000 for the torch.compile and model-table sections; a user's page
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    found = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            found.add(text.replace(" ", "-"))
    return found


def relative_links(path: Path):
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
            yield target


def test_the_anchor_rule_on_known_headings():
    assert anchors("## How `auto` chooses\n### Why smooth_v is off\n# A/B node, in short") == {
        "how-auto-chooses", "why-smooth_v-is-off", "ab-node-in-short"}


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= README_MAX_CHARS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.is_file()
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_the_readme_names_no_tracker_issue_and_no_ignored_file():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not re.search(r"\bissue \d+", text, re.IGNORECASE)
    assert ".exp/" not in text


def _call_path() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("## The path of one attention call")
    return text[start:text.index("\n## ", start + 1)]


def _defined(path: Path) -> set:
    """Every function, class, Class.method and Class.field defined in a Python file."""
    import ast
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef))
            names.update(f"{node.name}.{f.target.id}" for f in node.body  # dataclass fields
                         if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name))
    return names


def test_the_call_path_in_contributing_names_only_what_exists():
    """Each `file.py:name` the path of one call names is defined in that file, and each `Class.method` somewhere in
    kernels/ or sage_patch/."""
    import re
    section = _call_path()
    anywhere = set()
    for top in ("kernels", "sage_patch"):
        for path in (ROOT / top).rglob("*.py"):
            anywhere |= _defined(path)
    located = re.findall(r"`([\w/]+\.py):([\w.]+)", section)
    methods = set(re.findall(r"`([A-Z]\w+\.[a-z_]\w*)", section))
    assert len(located) >= 8 and len(methods) >= 8, (located, methods)
    missing = [f"{f}:{n}" for f, n in located if n not in _defined(ROOT / f)]
    missing += sorted(m for m in methods if m not in anywhere)
    assert missing == []
