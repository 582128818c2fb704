"""Every relative link in the README and the docs points at a file that exists, and a `#heading` in a link at a
heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("docs", "images", "charts", "bench"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return files


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchor of every heading of a markdown file (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    for line in outside_fences(path.read_text()) if path.suffix == ".md" else []:
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in outside_fences(path.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and linked.is_file() and anchor not in anchors(linked):
                broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    return broken


def test_every_relative_link_of_the_readme_and_the_docs_points_at_a_file_and_heading_that_exist():
    broken = {str(p.relative_to(ROOT)): found for p in markdown_files() if (found := broken_links(p))}
    assert not broken, f"broken links: {broken}"


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its part, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#its-part-with-code) [ok](#page) [web](https://example.com)\n"
                    "[gone](missing.md) [no heading](other.md#nothing)\n\n```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nothing (no heading #nothing in other.md)"]
