"""Every config key has a one-line description in the schema, `--help` shows it, and docs/config.md is
what `python -m specjax.config_doc` writes from the schema now (a key added or changed without
regenerating the page fails here)."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest

from specjax import config_doc
from specjax.config import SECTIONS, description_problems, describe_sections, schema_sections
from specjax.config_fields import (DOC_MAX_CHARS, CheckedSection, DraftSection, described, doc_problems, key_doc,
                                   ranged)
from specjax.drafts import families as registry


def _all_section_classes():
    """(section name, class) of every section, every registered draft type's section included."""
    out = [(name, cls) for name, cls in SECTIONS.items()]
    out += [("draft", family.section_class) for family in registry.FAMILIES.values()]
    return out


def _squash(text: str) -> str:
    return " ".join(text.split())


def test_every_key_has_a_one_line_description():
    assert description_problems() == []
    seen = 0
    for name, cls in _all_section_classes():
        assert cls.DOC.strip(), f"section {name} ({cls.__name__}) has no DOC line"
        for f in dataclasses.fields(cls):
            doc = key_doc(cls, f.name)
            assert doc and doc.strip(), f"{name}.{f.name} ({cls.__name__}) has no description"
            assert "\n" not in doc and len(doc) <= DOC_MAX_CHARS, f"{name}.{f.name}: {doc!r}"
            seen += 1
    assert seen >= 100  # the sections really were walked (12 sections and 4 draft types)
    # the documented groups cover every key of every section and draft type exactly
    groups = schema_sections()
    for name, cls in SECTIONS.items():
        if cls is DraftSection:
            continue
        (group,) = [g for g in groups if g.name == name]
        assert [k.name for k in group.keys] == [f.name for f in dataclasses.fields(cls)]
        assert all(k.doc for k in group.keys)
    common = {f.name for f in dataclasses.fields(DraftSection)}
    for family in registry.FAMILIES.values():
        (group,) = [g for g in groups if g.draft_type == family.draft_type]
        own = [f.name for f in dataclasses.fields(family.section_class) if f.name not in common]
        assert [k.name for k in group.keys] == own


def test_help_shows_every_key_with_its_description(capsys):
    from specjax.launch import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    flat = _squash(out)
    for name, cls in _all_section_classes():
        for f in dataclasses.fields(cls):
            assert f"{f.name}:" in out, f"{name}.{f.name} is not in --help"
            assert _squash(key_doc(cls, f.name)) in flat, f"the description of {name}.{f.name} is not in --help"
    # the description sits under its key line, indented deeper
    lines = describe_sections(width=100).splitlines()
    i = lines.index("    max_rows: int | null = null")
    assert lines[i + 1].startswith("        Read only the first N rows")
    assert "  draft, type dflash (DFlash):" in lines
    assert ("type: 'eagle3' | 'p_eagle' | 'dflash' | 'jetspec' | 'dspark' | 'eagle' | 'dflash2' | 'xpress' | 'mtp' "
            "= 'eagle3'") in _squash("\n".join(lines))  # the choices wrap at width 100


@pytest.mark.parametrize("width", [78, 98])
def test_help_epilog_fits_the_terminal(width):
    text = describe_sections(width=width)
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert too_long == []
    assert _squash(key_doc(DraftSection, "init_from")) in _squash(text)


def test_docs_config_md_is_current():
    with open(config_doc.DOC_PATH, encoding="utf-8") as f:
        on_disk = f.read()
    assert on_disk == config_doc.render(), "docs/config.md is stale: run python -m specjax.config_doc"
    assert config_doc.main(["--check"]) == 0
    # each key's row: name, type, default and description
    assert "| `max_rows` | `int \\| null` | `null` | Read only the first N rows of train\\_files" not in on_disk
    assert "| `max_rows` | `int \\| null` | `null` | Read only the first N rows of train_files" in on_disk
    assert "### draft.type: jetspec" in on_disk and "resolved next to the file" in on_disk
    assert "&lt;" not in on_disk and "\\<think\\>" in on_disk  # escaped, not swallowed as an HTML tag


def test_check_names_the_command_when_the_page_is_stale(tmp_path, capsys):
    path = tmp_path / "config.md"
    assert config_doc.main(["--check", "--output", str(path)]) == 1  # missing
    assert "does not exist" in capsys.readouterr().err
    assert config_doc.main(["--output", str(path)]) == 0
    assert config_doc.main(["--check", "--output", str(path)]) == 0
    path.write_text(path.read_text().replace("Peak learning rate", "Peak learning rate (old)"))
    assert config_doc.main(["--check", "--output", str(path)]) == 1
    err = capsys.readouterr().err
    assert "out of date" in err and "python -m specjax.config_doc" in err


# ---------------------------------------------------------------------------------------------
# a key without a description fails the check
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeSection(CheckedSection):
    SECTION: ClassVar[str] = "probe"
    DOC: ClassVar[str] = "A section of this test's own."
    good: int = ranged(1, ge=0, doc="A key with a description")
    plain: bool = described(False, "Another key with a description")
    bare: int = ranged(3, ge=1)  # no description
    unset: Optional[str] = None  # a plain default: no description either


@dataclass(frozen=True)
class LongDocSection(CheckedSection):
    SECTION: ClassVar[str] = "long"
    DOC: ClassVar[str] = "Descriptions that are not one short line."
    wordy: int = described(0, "x" * (DOC_MAX_CHARS + 1))
    multi: int = described(0, "first line\nsecond line")


def test_a_key_without_a_description_fails_the_check():
    problems = doc_problems(ProbeSection, "probe")
    assert len(problems) == 2
    assert "`probe.bare`" in problems[0] and "`probe.unset`" in problems[1]
    assert all("no description" in p for p in problems)
    assert description_problems({"probe": ProbeSection}) == problems
    long = description_problems({"long": LongDocSection})
    assert [re.search(r"`long\.(\w+)`", p).group(1) for p in long] == ["wordy", "multi"]
    assert all("one line of at most" in p for p in long)

    @dataclass(frozen=True)
    class NoDocSection(CheckedSection):
        ok: int = described(0, "fine")

    assert description_problems({"nodoc": NoDocSection}) == [
        "section `nodoc` (NoDocSection) has no DOC line: give it DOC: ClassVar[str] = '...'."]


@dataclass(frozen=True)
class UndocumentedDraftSection(DraftSection):
    type: str = "undocumented_probe"  # redeclared for its default: keeps DraftSection's description
    probe_scale: float = ranged(1.0, gt=0.0)


@dataclass(frozen=True)
class DocumentedDraftSection(DraftSection):
    DOC: ClassVar[str] = "A documented draft type of this test's own."
    type: str = "documented_probe"
    probe_scale: float = ranged(1.0, gt=0.0, doc="Scale of the probe")


def _family(section):
    class ProbeFamily(registry.DraftFamily):
        draft_type: ClassVar[str] = section.type
        display_name: ClassVar[str] = "Probe"
        section_class: ClassVar[type] = section

    return ProbeFamily()


@pytest.fixture
def register_probe():
    added = []

    def add(section):
        added.append(registry.register(_family(section)).draft_type)

    yield add
    for draft_type in added:
        registry.unregister(draft_type)


def test_a_draft_type_key_without_a_description_fails_config_doc(register_probe, capsys, tmp_path):
    assert key_doc(UndocumentedDraftSection, "type") == key_doc(DraftSection, "type")  # inherited
    register_probe(UndocumentedDraftSection)
    problems = description_problems()
    assert len(problems) == 1 and "`draft.probe_scale` (UndocumentedDraftSection) has no description" in problems[0]
    assert config_doc.main(["--check"]) == 1
    assert "draft.probe_scale" in capsys.readouterr().err
    assert config_doc.main(["--output", str(tmp_path / "config.md")]) == 1  # nor is the page written
    assert not os.path.exists(tmp_path / "config.md")


def test_a_new_documented_key_makes_the_committed_page_stale(register_probe, capsys):
    register_probe(DocumentedDraftSection)
    assert description_problems() == []
    assert "| `probe_scale` | `float` | `1.0` | Scale of the probe |" in config_doc.render()
    assert config_doc.main(["--check"]) == 1  # docs/config.md does not have it yet
    assert "python -m specjax.config_doc" in capsys.readouterr().err
    assert "Scale of the probe" in _squash(describe_sections(width=90))
