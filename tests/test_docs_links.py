"""The README and docs/: every relative link resolves to a file of the repository (a moved or renamed page breaks
a link silently otherwise), and the README stays short enough to read in five minutes."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target): the target of a Markdown link
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # code blocks and spans hold text, not links


def local_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    missing = [target for target in local_links(page) if not (page.parent / target.partition("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to what does not exist: {missing}"


def test_the_readme_is_short_and_its_links_are_found():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 200
    assert "docs/troubleshooting.md" in local_links(readme)  # the checker sees the links it must check
