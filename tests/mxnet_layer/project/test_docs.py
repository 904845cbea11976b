"""Every relative link in the README and docs/ resolves: the file exists, and so does the anchor."""
import os
import re

import pytest

from helpers import ROOT
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))


def _anchors(path):
    """GitHub's anchors for the headings of a Markdown file."""
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def _links(page):
    with open(os.path.join(ROOT, page)) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
            os.path.join(ROOT, page)
        if not os.path.exists(full):
            broken.append(target)
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def test_the_readme_is_an_entry_point():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200
    assert any("make bench" in line for line in lines[:15]) and any("make test" in line for line in lines[:15])
    linked = {os.path.normpath(t.partition("#")[0]) for t in _links("README.md")}
    assert {os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")} <= linked
