"""The repository stands alone: no tracked file points at documents that live outside it.

Two checks over the files `git ls-files` lists (the repo is always a git checkout, in CI too):
  * no line names the out-of-tree fact sheets (their folder, their file name, a `../` path to the
    sibling folder that held them, or a "contract" + section-sign citation of them); the facts the
    code relies on are in docs/eagle3-format.md;
  * every `docs/<name>.md` path cited in a tracked .py file exists in this repo. A path that belongs
    to another project is written with that project's name in front (`ggml-org/ggml/docs/gguf.md`),
    which this check does not read as one of ours.
The patterns are assembled from pieces so that this file does not match itself.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SECTION = "\u00a7"
FORBIDDEN = re.compile("|".join([
    re.escape("shared" + "/reference"),
    re.escape("eagle3" + "-contract"),
    re.escape(".." + "/shared"),
    "contract" + r" \(?" + _SECTION,
]))
# docs/<name>.md not preceded by a path or word character (so other repos' `x/docs/y.md` are skipped)
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md\b")


def tracked_files() -> list[str]:
    assert shutil.which("git"), "git is needed: this test reads the tracked files with `git ls-files`"
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    assert res.returncode == 0, f"`git ls-files` failed in {ROOT}: {res.stderr.decode(errors='replace')}"
    names = [n for n in res.stdout.decode().split("\0") if n]
    assert names, f"`git ls-files` listed no files in {ROOT}"
    return names


def _text(root: Path, rel: str):
    path = root / rel
    if not path.is_file():  # deleted in the working tree, or a submodule entry
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def forbidden_hits(files, root: Path = ROOT) -> list[str]:
    hits = []
    for rel in files:
        text = _text(root, rel)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            m = FORBIDDEN.search(line)
            if m:
                hits.append(f"{rel}:{lineno}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return hits


def missing_doc_citations(files, root: Path = ROOT) -> list[str]:
    missing = []
    for rel in files:
        if not rel.endswith(".py"):
            continue
        text = _text(root, rel)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in DOCS_PATH.finditer(line):
                if not (root / m.group(0)).is_file():
                    missing.append(f"{rel}:{lineno}: {m.group(0)} does not exist")
    return missing


# a docs path followed on the same line by quoted section names: `<path>, "A"`, `<path> ("A", "B")`,
# `<path> "A"`, `"A" and "B"`; quotes may be escaped (inside a Python string)
_Q = r'\\?"[^"\\\n]+\\?"'
SECTION_CITE = re.compile(r"(?<![\w/.-])(docs/[\w./-]*?\.md)(?:,\s*|\s+\(|\s+)(" + _Q + r"(?:(?:,\s*|\s+and\s+)" + _Q + ")*)")
_QUOTED = re.compile(r'\\?"([^"\\\n]+)\\?"')


def headings(doc: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", doc.read_text(encoding="utf-8"), re.M)}


def unknown_section_citations(files, root: Path = ROOT) -> list[str]:
    """Citations of a section by its heading (`docs/eagle3-format.md, "Aux layer ids"`) whose doc has
    no such heading (citations wrapped over two lines are not read)."""
    bad, cache = [], {}
    for rel in files:
        text = _text(root, rel)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in SECTION_CITE.finditer(line):
                doc = root / m.group(1)
                if not doc.is_file():
                    continue  # reported by missing_doc_citations for .py files
                if doc not in cache:
                    cache[doc] = headings(doc)
                for name in _QUOTED.findall(m.group(2)):
                    if name not in cache[doc]:
                        bad.append(f"{rel}:{lineno}: {m.group(1)} has no heading {name!r}")
    return bad


def test_no_references_outside_the_repo():
    hits = forbidden_hits(tracked_files())
    assert not hits, ("tracked files cite documents outside the repository; point them at "
                      "docs/eagle3-format.md instead:\n" + "\n".join(hits))


def test_cited_docs_exist():
    missing = missing_doc_citations(tracked_files())
    assert not missing, "docs cited in the code are missing from docs/:\n" + "\n".join(missing)


def test_cited_sections_exist():
    bad = unknown_section_citations(tracked_files())
    assert not bad, "code cites doc sections by headings that do not exist:\n" + "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    """Each check reports file:line on planted lines (so a pass above means something). The planted
    paths are assembled here so that this file itself cites nothing."""
    d = "docs" + "/"
    (tmp_path / "bad.py").write_text(
        "ok\n# see " + "shared" + "/reference/x.md\n# (contract " + _SECTION + "2.3)\n"
        f"# {d}no_such_file.md and {d}architecture.md\n# ggml-org/ggml/{d}gguf.md\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text("# Title\n## Reliability\n")
    hits = forbidden_hits(["bad.py"], tmp_path)
    missing = missing_doc_citations(["bad.py"], tmp_path)
    assert [h.split(":")[1] for h in hits] == ["2", "3"], hits
    assert missing == [f"bad.py:4: {d}no_such_file.md does not exist"], missing
    (tmp_path / "cite.py").write_text(
        f'x = "see {d}architecture.md, \\"Reliability\\""  # {d}architecture.md ("Reliability", "Nope")\n'
        f'# {d}architecture.md "Gone" and "Reliability"; {d}architecture.md, "wrapped\n')
    assert unknown_section_citations(["cite.py"], tmp_path) == [
        f"cite.py:1: {d}architecture.md has no heading 'Nope'",
        f"cite.py:2: {d}architecture.md has no heading 'Gone'"]
