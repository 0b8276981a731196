"""Every pointer to a document that a user reads in a message leads to a section that exists.

The messages are the code's error texts (what a `raise`, `sys.exit` or `pytest.fail` call carries), the params
schema's descriptions (what a user reads beside each key) and the install scripts; a pointer is
`README, Section`, `docs/x.md, Section` (or `: Section`) in parentheses, or a link `docs/x.md#anchor`. The
README's and the docs' own links to anchors are checked the same way."""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

POINTER = re.compile(r"(README(?:\.md)?|docs/(?:[\w-]+/)?[\w.-]+\.md)(?:#([\w-]+)|[,:] ?\"?([^)\"]+?)\"?\))")
LINK = re.compile(r"\]\(((?:\.\./|docs/)?(?:[\w-]+/)?[\w.-]+\.md|README\.md)?#([\w-]+)\)")
SOURCES = ("pipeline/**/*.py", "stages/*.py", "bench/*.py")


def _strings(node):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def messages(tree) -> list[str]:
    """The texts of error calls and of `description=` arguments in a module."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Raise) and n.exc is not None:
            out += _strings(n.exc)
        elif isinstance(n, ast.Call):
            f = n.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in ("exit", "SystemExit", "fail"):
                out += _strings(n)
            out += [s for kw in n.keywords if kw.arg == "description" for s in _strings(kw.value)]
    return out


def _doc(name: str) -> Path:
    return ROOT / ("README.md" if name.startswith("README") else name)


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)       # a '#' comment in a code block is no heading
    return [h.strip() for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def section_exists(path: Path, section: str) -> bool:
    """A heading that is the section's name, or starts with it followed by a space or '(' (the name without the
    heading's qualifier); backticks ignored."""
    name = section.strip().replace("`", "").lower()
    for h in headings(path):
        h = h.replace("`", "").lower()
        if h == name or h.startswith(name + " ") or h.startswith(name + "("):
            return True
    return False


def pointers() -> list[tuple[str, str, str | None, str | None]]:
    found = []
    for pattern in SOURCES:
        for p in sorted(ROOT.glob(pattern)):
            text = " ".join(messages(ast.parse(p.read_text()))).replace("\n", " ")
            found += [(str(p.relative_to(ROOT)), *m.groups()) for m in POINTER.finditer(text)]
    for p in sorted((ROOT / "scripts").iterdir()):
        found += [(str(p.relative_to(ROOT)), *m.groups()) for m in POINTER.finditer(p.read_text())]
    return found


def test_the_collector_finds_the_pointers_it_must_check():
    found = {(src, doc, section) for src, doc, _, section in pointers()}
    # pointers known to be in messages: the engine's import error, the missing GGUF file, a schema description
    assert ("pipeline/model/engines.py", "docs/models.md", "Rollout engines") in found
    assert ("pipeline/model/gguf_import.py", "README", "Train a real model") in found
    assert ("pipeline/config/params.py", "docs/credit-assignment.md", "Invalid actions") in found
    assert len(found) >= 8
    # and the check refuses a section that is not there
    assert not section_exists(ROOT / "README.md", "Rollout engines")
    assert section_exists(ROOT / "docs/credit-assignment.md", "One step off-policy")


@pytest.mark.parametrize("src, doc, anchor, section", pointers())
def test_a_message_points_to_a_section_that_exists(src, doc, anchor, section):
    path = _doc(doc)
    assert path.is_file(), f"{src}: points to {doc}, which does not exist"
    if anchor:
        assert anchor in {slug(h) for h in headings(path)}, f"{src}: {doc}#{anchor} is no heading's anchor"
    else:
        for part in section.split(";"):
            assert section_exists(path, part), f"{src}: points to {doc}, section {part.strip()!r}, not a heading there"


def test_links_to_anchors_in_the_readme_and_docs_lead_to_headings():
    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        for target, anchor in LINK.findall(page.read_text()):
            path = page if not target else (ROOT / target if page.parent == ROOT else page.parent / target)
            if not path.is_file() or anchor not in {slug(h) for h in headings(path)}:
                bad.append(f"{page.relative_to(ROOT)}: ({target}#{anchor})")
    assert not bad, "links to no heading:\n" + "\n".join(bad)
