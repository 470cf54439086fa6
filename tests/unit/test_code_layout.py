"""The code's layout rules, read from the source (AST), for specjax/, kernels/ and converters/:

- no import circles between modules (every import counts: module level, inside functions, and under
  TYPE_CHECKING; `from pkg import mod` is an edge to the module, `from pkg import name` to the package);
- no underscore name imported from another file (a name another file needs is public);
- no draft-family branch outside specjax/drafts/ and the converters of each family's head format
  (eagle3_*, dflash_*): code elsewhere asks the family object (specjax.drafts.family), never which
  family it holds.

`python tests/unit/test_code_layout.py` prints every finding and the counts.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (folder on disk, the folder that holds the top-level package)
ROOTS = (("specjax", "."), ("kernels/specjax_kernels", "kernels"), ("converters/specjax_converters", "converters"))

# a draft family named in a test of which family a config, folder or object is
FAMILY_BRANCH = re.compile(
    r"\bis_dflash\w*\(|\bdraft_types\.family\(|isinstance\([^)]*(DFlash|Eagle3)\w*Config"
    r"|\.type\s*[!=]=\s*[\"'](dflash|eagle3|p_eagle|jetspec)[\"']"
    r"|[\"'](dflash|eagle3|p_eagle|jetspec)[\"']\s*[!=]=|\bblock_drafter\b"
    r"|\bif\b[^\n]*\bparallel_drafting\b")
# where a family's own code lives: its draft modules and its head format's converters
FAMILY_HOMES = ("specjax/drafts/", "converters/specjax_converters/eagle3_", "converters/specjax_converters/dflash_",
                "converters/specjax_converters/dflash2_")


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file under the three roots."""
    out = {}
    for folder, base in ROOTS:
        for dirpath, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.join(REPO, base))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def _imports(path: str, name: str, is_pkg: bool):
    """(imported module, [names imported from it] or None, line) for every import in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names], node.lineno


def import_graph():
    """(edges: module -> {module}, underscore imports: [(file, line, module, name)])."""
    mods = modules()
    edges, underscored = defaultdict(set), []
    for name, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        for mod, names, line in _imports(path, name, is_pkg):
            if names is None:
                if mod in mods:
                    edges[name].add(mod)
                continue
            for n in names:
                sub = f"{mod}.{n}"
                if sub in mods:
                    edges[name].add(sub)
                elif mod in mods:
                    edges[name].add(mod)
                    if n.startswith("_") and not n.startswith("__"):
                        underscored.append((os.path.relpath(path, REPO), line, mod, n))
    for name in list(edges):
        edges[name].discard(name)
    return edges, underscored


def import_circles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(out)


def family_branches() -> list[tuple[str, int, str]]:
    out = []
    for name, path in sorted(modules().items()):
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        if rel.startswith(FAMILY_HOMES):
            continue
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            code = line.split("#", 1)[0]
            if FAMILY_BRANCH.search(code):
                out.append((rel, i, line.strip()))
    return out


def test_no_import_circles():
    circles = import_circles(import_graph()[0])
    assert not circles, "import circles (break each by moving the shared name to a module both can import):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


def test_no_underscore_names_imported_across_files():
    found = import_graph()[1]
    assert not found, "underscore names imported from another file (make them public where they live):\n" + \
        "\n".join(f"{f}:{line}: from {m} import {n}" for f, line, m, n in found)


def test_no_draft_family_branches_outside_the_families():
    found = family_branches()
    assert not found, "code that asks which draft family it holds (ask the family object instead):\n" + \
        "\n".join(f"{f}:{line}: {text}" for f, line, text in found)


def test_the_checks_see_what_they_look_for(tmp_path):
    # the detectors on known input, so a broken pattern cannot pass silently
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(edges) == [["a", "b", "c"]]
    for line in ("if is_dflash(cfg):", "if cfg.draft.type == 'dflash':", 'x = "p_eagle" != t',
                 "isinstance(cfg, dflash.DFlashConfig)", "if draft_cfg.parallel_drafting:"):
        assert FAMILY_BRANCH.search(line), line
    assert not FAMILY_BRANCH.search("family = registry.family_of(cfg.draft)")
    assert "specjax.train.step" in modules() and "specjax_converters.head_files" in modules()


if __name__ == "__main__":
    edges, underscored = import_graph()
    circles = import_circles(edges)
    branches = family_branches()
    for c in circles:
        print("circle:", " <-> ".join(c))
    for f, line, m, n in underscored:
        print(f"underscore import: {f}:{line}: from {m} import {n}")
    for f, line, text in branches:
        print(f"family branch: {f}:{line}: {text}")
    print(f"import circles: {len(circles)}; underscore imports across files: {len(underscored)}; "
          f"draft-family branches outside the family modules: {len(branches)}")


def redefined_top_level_names(source: str) -> list[str]:
    """Functions and classes a module defines twice at its top level (the later one silently wins)."""
    seen, twice = set(), []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(node.name)
            seen.add(node.name)
    return twice


def test_no_module_defines_a_name_twice():
    found = []
    for top in ("specjax", "kernels", "converters", "tests", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    found += [f"{os.path.relpath(path, REPO)}: {n}" for n in redefined_top_level_names(open(path).read())]
    assert not found, found
    assert redefined_top_level_names("def f():\n    pass\n\n\ndef f(x):\n    pass\n") == ["f"]
