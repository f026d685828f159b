"""The README's code map and the documentation's links name what exists.

README.md's "Code map" answers "where is X" with a package list and a table of decisions, each
naming a file and the function or class that makes the decision. A module that moves or a
function that is renamed leaves that map wrong without any other test noticing, so this one
reads the map and checks it against the repository:
- every path in backticks (a file, or a folder ending in `/`) exists;
- every name in backticks after a path, up to the next path, is defined in that file (with
  `ast`: a top-level function, class or constant; `Class.method` a method of that class;
  `()` and arguments stripped); after a folder, in one of the folder's modules;
- every relative link in README.md and docs/*.md points at an existing file and carries no
  `#anchor` (headings change; a file either exists or not), and every docs page links back
  to the README.
Pure text and `ast`: nothing is imported, so it runs in well under a second.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_TICKED = re.compile(r"`([^`]+)`")
_NAME = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(?:\(.*\))?$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SUFFIXES = (".py", ".html", ".toml", ".md", ".sh", ".txt", ".json", ".yml", ".yaml", ".png")


def _section(text: str, heading: str) -> list[str]:
    """The lines under `heading` (a markdown heading line) up to the next heading of its level
    or above; empty when the heading is missing."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading) + 1
    except ValueError:
        return []
    out = []
    for line in lines[start:]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return out


def _is_path(token: str) -> bool:
    return (
        " " not in token
        and not token.startswith(("/", "-", "$", "~"))
        and ("/" in token or token.endswith(_SUFFIXES))
    )


def code_map_lines(text: str) -> tuple[list[str], list[str]]:
    """(package list bullets, decision table rows) of README.md's code map."""
    code_map = "\n".join(_section(text, "## Code map"))
    packages = [ln for ln in _section(code_map, "### Packages") if ln.lstrip().startswith("- ")]
    table = [ln for ln in _section(code_map, "### Where each decision is made") if ln.startswith("|")]
    rows = table[2:]  # past the header and its `| --- |` line
    return packages, rows


@cache
def _defined(path: Path) -> frozenset[str]:
    """Top-level functions, classes and assigned names of one module, and `Class.method` for
    each method (and nested class) of a top-level class."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(f"{node.name}.{member.name}")
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _defined_under(path: Path) -> frozenset[str]:
    if path.is_dir():
        return frozenset().union(*(_defined(p) for p in sorted(path.rglob("*.py"))))
    return _defined(path)


def check_line(line: str, root: Path = ROOT) -> list[str]:
    """What is wrong with one code map line: each path that does not exist and each name that
    the path before it does not define."""
    problems: list[str] = []
    current: Path | None = None
    for token in _TICKED.findall(line):
        if _is_path(token):
            current = root / token
            exists = current.is_dir() if token.endswith("/") else current.is_file()
            if not exists:
                problems.append(f"`{token}` does not exist")
                current = None
            continue
        m = _NAME.match(token)
        if current is None or m is None:
            continue  # prose before the first path (the decision's name), a flag, a command
        if current.suffix != ".py" and not current.is_dir():
            problems.append(f"`{token}` follows `{current.relative_to(root)}`, which is no Python module")
            continue
        name = m.group("name")
        if name not in _defined_under(current):
            problems.append(f"`{token}` is not defined in `{current.relative_to(root)}`")
    return problems


def relative_links(page: Path) -> list[str]:
    """The link targets of one markdown page that are neither web addresses nor mail."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_code_map_names_every_package_and_many_decisions():
    """Guards README.md's "## Code map" section: its "### Packages" list and its "### Where each
    decision is made" table are there (a renamed heading would let every other check pass on
    nothing)."""
    packages, rows = code_map_lines(README.read_text(encoding="utf-8"))
    listed = {t for ln in packages for t in _TICKED.findall(ln) if _is_path(t)}
    for top in (
        "workers/",
        "server/",
        "kernels_local/",
        "tests/",
        "benchmarks/",
        "scripts/",
        "deploy/",
        "docs/",
    ):
        assert top in listed, f"the code map's package list does not name `{top}`"
    for pkg in sorted(p for p in (ROOT / "workers").iterdir() if (p / "__init__.py").is_file()):
        if pkg.name != "default_model":
            assert f"workers/{pkg.name}/" in listed, (
                f"the code map's package list does not name `workers/{pkg.name}/`"
            )
    for pkg in sorted(p for p in (ROOT / "server").iterdir() if (p / "__init__.py").is_file()):
        assert f"server/{pkg.name}/" in listed, (
            f"the code map's package list does not name `server/{pkg.name}/`"
        )
    assert len(rows) >= 20, f"the decision table has {len(rows)} rows"


def test_every_path_and_name_in_the_package_list_exists():
    """Guards each bullet of README.md's "### Packages" list: its folders and files exist, and a
    function named beside a file (`workers/main.py` `run_worker()`) is defined there."""
    packages, _ = code_map_lines(README.read_text(encoding="utf-8"))
    problems = [f"{ln.strip()}\n    {p}" for ln in packages for p in check_line(ln)]
    assert not problems, "the code map's package list is stale:\n" + "\n".join(problems)


def test_every_decision_names_an_existing_file_and_definition():
    """Guards each row of README.md's "### Where each decision is made" table: every file it
    names exists and defines the functions, classes and `Class.method`s named beside it."""
    _, rows = code_map_lines(README.read_text(encoding="utf-8"))
    problems = []
    for row in rows:
        found = check_line(row)
        assert any(_is_path(t) for t in _TICKED.findall(row)), f"a decision names no file: {row}"
        problems += [f"{row.split('|')[1].strip()}: {p}" for p in found]
    assert not problems, "the code map's decision table is stale:\n" + "\n".join(problems)


def test_the_checker_catches_a_wrong_path_or_name():
    """Guards the checks above themselves: a missing file, a renamed function and a missing
    method are each reported, and a correct line is not."""
    good = "| filter | `server/routing/filter.py` `eligible()`; `server/routing/router.py` `Router.pick()` |"
    assert check_line(good) == []
    assert check_line("| x | `server/routing/nowhere.py` `eligible()` |") == [
        "`server/routing/nowhere.py` does not exist"
    ]
    assert check_line("| x | `server/routing/filter.py` `choose()` |") == [
        "`choose()` is not defined in `server/routing/filter.py`"
    ]
    assert check_line("| x | `server/routing/router.py` `Router.choose(req)` |") == [
        "`Router.choose(req)` is not defined in `server/routing/router.py`"
    ]
    assert check_line("| x | `workers/contract/` `Capability`, `NoSuchThing` |") == [
        "`NoSuchThing` is not defined in `workers/contract`"
    ]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_without_anchors(page: Path):
    """Guards every `[text](target)` of README.md and docs/*.md that is not a web address: the
    file exists, and the link has no `#anchor` (which no file check can prove)."""
    problems = []
    for target in relative_links(page):
        if "#" in target:
            problems.append(f"`{target}` carries an anchor")
        elif not (page.parent / target).exists():
            problems.append(f"`{target}` does not exist")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_opens_with_a_link_back_to_the_readme(page: Path):
    """Guards the opening paragraph of each docs/*.md: a title, then what the page covers with a
    link back to README.md, before any section."""
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines and lines[0].startswith("# "), f"{page.name} does not open with a title"
    opening = "\n".join(_section("\n".join(lines), lines[0])).split("\n## ", 1)[0]
    assert "](../README.md)" in opening, f"{page.name}'s opening does not link back to the README"


def test_every_docs_page_is_linked_from_the_readme():
    """Guards README.md's sections: each docs page is reachable from the README."""
    linked = {(README.parent / t).resolve() for t in relative_links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links to none of: {', '.join(missing)}"
