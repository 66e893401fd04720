"""The hand-written pages keep up with the code: the troubleshooting page speaks of every
exit code and every event kind, and the README's links into the site resolve."""

from __future__ import annotations

import re
from pathlib import Path

from steadfast.events.schema import EVENT_KINDS
from steadfast.launcher import exit_codes

REPO = Path(__file__).resolve().parents[2]
TROUBLE = (REPO / "docs" / "troubleshooting.md").read_text()


def test_troubleshooting_names_every_exit_code() -> None:
    headings = set(re.findall(r"^### (\d+)\b", TROUBLE, re.M))
    codes = {str(c) for c in exit_codes.EXIT_REASONS} | {str(exit_codes.EXIT_LAUNCHER_ERROR)}
    assert codes - headings == set(), "exit codes with no heading in docs/troubleshooting.md"


def test_troubleshooting_names_every_event_kind() -> None:
    linked = set(re.findall(r"<event-([a-z-]+)>", TROUBLE))
    kinds = {k.replace("_", "-") for k in EVENT_KINDS}
    assert kinds - linked == set(), "event kinds docs/troubleshooting.md does not link"


def test_readme_links_resolve() -> None:
    """Relative links of the README name files that exist, and their anchors headings of
    those files (GitHub's slugs)."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(#[^)\s]+)?\)", readme)
    assert links
    for target, anchor in links:
        if re.match(r"[a-z]+://", target):
            continue
        path = REPO / target
        assert path.exists(), f"README links {target}, which does not exist"
        if anchor:
            slugs = {
                re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#{1,6} (.+)$", path.read_text(), re.M)
            }
            assert anchor[1:] in slugs, f"README links {target}{anchor}: no such heading"
