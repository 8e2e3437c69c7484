import re
from collections.abc import Iterator
from pathlib import Path

from nlq_scale.config.reference import render_markdown
from tests.conftest import REPO


def test_configuration_reference_is_generated_from_the_schemas():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == render_markdown(), "run: python -m nlq_scale.config.reference > docs/configuration.md"


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> Iterator[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -, repeats -1, -2."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def test_links_between_pages_resolve():
    """Every relative link of the README and docs/ names a file that exists, and its #anchor a heading
    of that page."""
    checked = anchored = 0
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http(s), mailto
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in set(anchors(dest)), f"{page.name}: {target}"
                anchored += 1
            checked += 1
    assert checked > 40 and anchored > 5, (checked, anchored)  # the pattern finds the links
