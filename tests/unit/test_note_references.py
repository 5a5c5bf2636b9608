"""Every ``[Note: ...]`` reference resolves: the package, tests, benchmarks, examples, scripts,
design.md and README.md name each note the way its one definition does, and a reference that
says where the note is (``[Note: x] in ``file.py``) names the file that defines it."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [
    *sorted(ROOT.glob("megatron_fsdp_v2/**/*.py")),
    *sorted(p for p in ROOT.glob("tests/**/*.py") if p.name != "test_note_references.py"),
    *sorted(ROOT.glob("benchmarks/*.py")), *sorted(ROOT.glob("examples/*.py")),
    *sorted(ROOT.glob("scripts/**/*.py")), ROOT / "design.md", ROOT / "README.md",
]
# A definition is a block header: the note's name alone on its line (after an optional comment
# sign or docstring quotes). A note without one may be defined inline, by a comment that opens
# with its name and goes on with a sentence ("# [Note: x] A graph kept ..."); elsewhere a name
# followed by "(file)" or "in file", or inside a sentence, is a reference.
_BLOCK = re.compile(r'^\s*(?:#\s*)?(?:r?""")?\[Note: ([^\]]+)\]\s*$')
_INLINE = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\] [A-Z`]")
_REFERENCE = re.compile(r"\[Note: ([^\]]+)\]")
# "[Note: x] in ``path``", "[Note: x] (path)", "[Note: x] (in path)" (backticks optional),
# possibly across a line break.
_LOCATED = re.compile(
    r"\[Note: ([^\]]+)\]\)?,? (?:\((?:in )?|in )``?([\w./]+\.(?:py|md))``?")
_EXAMPLES = {"..."}  # design.md's "[Note: ...] blocks"


def _definitions() -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    inline: dict[str, list[str]] = {}
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, found in ((_BLOCK, blocks), (_INLINE, inline)):
                match = pattern.match(line)
                if match:
                    found.setdefault(match.group(1), []).append(
                        f"{path.relative_to(ROOT)}:{number}")
    return {**inline, **blocks}


def test_every_note_has_one_definition() -> None:
    definitions = _definitions()
    twice = {name: places for name, places in definitions.items() if len(places) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    unresolved = []
    for path in SOURCES:
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())  # names broken over lines
        for match in _REFERENCE.finditer(flat):
            if match.group(1) not in definitions and match.group(1) not in _EXAMPLES:
                unresolved.append(f"{path.relative_to(ROOT)}: [Note: {match.group(1)}]")
    assert not unresolved, "references to notes that are defined nowhere:\n" + "\n".join(
        unresolved)


def test_references_name_the_file_that_defines_the_note() -> None:
    definitions = _definitions()
    wrong = []
    for path in SOURCES:
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for match in _LOCATED.finditer(flat):
            name, named = match.group(1), match.group(2)
            homes = [place.rsplit(":", 1)[0] for place in definitions.get(name, [])]
            if not any(home.endswith("/" + named.split("/")[-1]) or home == named
                       for home in homes):
                wrong.append(f"{path.relative_to(ROOT)}: [Note: {name}] in {named}, "
                             f"defined in {homes}")
    assert not wrong, "\n".join(wrong)
