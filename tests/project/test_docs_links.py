"""Every relative link of the project's Markdown files reaches a file, and every ``#anchor`` a
heading of that file (GitHub's anchors: the heading lower-cased, punctuation dropped, spaces as
hyphens, a repeated heading numbered ``-1``, ``-2``, ...)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files(root: Path) -> list[Path]:
    """The Markdown files a reader of the repository meets (README and docs/)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before numbering repeats)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)             # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)     # links keep their text
    text = text.strip().lower()
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_" or ch.isalnum() or cat.startswith("M"):
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file's headings (code blocks skipped)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """The links of ``path`` that lead nowhere: ``'target: why'`` each."""
    bad = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)                  # links inside code spans are text
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):   # http:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                bad.append(f"{target}: no file {dest}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("path", markdown_files(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == []


def test_a_broken_anchor_or_file_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Which time number\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n## Set-up: two commands\n\n## Set-up: two commands\n\n"
                   "[ok](#set-up-two-commands) [ok2](#set-up-two-commands-1) "
                   "[ok3](other.md#which-time-number) [web](https://example.org/x#y)\n"
                   "`[in code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
                   "[bad anchor](#set-up) [bad file](gone.md) [bad other](other.md#nope)\n")
    bad = broken_links(doc)
    assert [b.split(":")[0] for b in bad] == ["#set-up", "gone.md", "other.md#nope"], bad
