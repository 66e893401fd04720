"""Every fenced code block in the README and the documentation site is either run here or
marked as not runnable, with the reason.

The marker is an HTML comment on the line right above the fence (GitHub and Sphinx show
nothing of it):

- ``<!-- doctest: file NAME -->``: the block is written to NAME in the page's scratch
  folder, for the blocks after it;
- ``<!-- doctest: run -->``: the block runs there (``python`` with this interpreter,
  ``sh``/``bash`` with ``bash -e``, the interpreter's ``bin`` first on ``PATH``) and must
  exit 0;
- ``<!-- not run: REASON -->``: not runnable on this machine (a GPU, a cluster, a
  fragment), and why.

A page's blocks run in its order in one folder that holds a link to the repository's
``examples`` and sees the repository in ``$REPO``; each page is one test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import sffigures as figures

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# Markdown pages: the README and every page of the site (the build's own output left out)
PAGES = [
    REPO / "README.md",
    *sorted(p for p in DOCS.rglob("*.md") if not {"_build", "_generated"} & set(p.parts)),
]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(
    r"^\s*<!--\s*(?:doctest:\s*(?P<action>run|file)\s*(?P<name>\S*)"
    r"|not run:\s*(?P<reason>.*?))\s*-->\s*$"
)
RUNNERS = {"python": "python", "py": "python", "sh": "bash", "bash": "bash", "shell": "bash"}
TIMEOUT = 300.0
CLEAN_END = Path(__file__).resolve().parent / "clean_end"  # its sitecustomize.py


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    action: str  # "run", "file" or "skip"
    arg: str  # the file name, or the reason it is not run

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with their markers; a block without one, or with a
    marker that names no file or reason, raises naming its line."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{i + 1}: a code block is not closed")
        lang = info.split()[0] if info else ""
        text = "\n".join(lines[i + 1 : end]) + "\n"
        if lang.startswith("{"):  # a MyST directive (toctree, automodule): not code
            i = end + 1
            continue
        marker = MARKER.match(lines[i - 1]) if i else None
        where = f"{page.relative_to(REPO)}:{i + 1}"
        if marker is None:
            raise AssertionError(
                f"{where}: a code block without a marker: put `<!-- doctest: run -->`, "
                "`<!-- doctest: file NAME -->` or `<!-- not run: REASON -->` on the line above"
            )
        if marker.group("reason") is not None:
            if not marker.group("reason").strip():
                raise AssertionError(f"{where}: `not run` needs its reason")
            found.append(Block(page, i + 1, lang, text, "skip", marker.group("reason")))
        elif marker.group("action") == "file":
            if not marker.group("name"):
                raise AssertionError(f"{where}: `doctest: file` needs the file's name")
            found.append(Block(page, i + 1, lang, text, "file", marker.group("name")))
        else:
            if lang not in RUNNERS:
                raise AssertionError(f"{where}: cannot run a block of language {lang!r}")
            found.append(Block(page, i + 1, lang, text, "run", ""))
        i = end + 1
    return found


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO).with_suffix("")).replace(os.sep, "/")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_block_is_marked(page: Path) -> None:
    blocks(page)  # raises, naming the line, at the first block without a marker


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    if not any(b.action == "run" for b in blocks(page)):
        return  # nothing to run on this page (its markers are checked above)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["REPO"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("STEADFAST_EVENTS", None)  # each block's runs write where the page says
    # every Python process of the page reports a process group that outlived its script
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLEAN_END), env.get("PYTHONPATH")]))
    unclean = tmp_path / "unclean-ends.log"
    env["STEADFAST_DOCS_END_LOG"] = str(unclean)
    measure = tmp_path / ".measured"  # each process's life, rank 0's steps (sffigures.py)
    measure.mkdir()
    env["STEADFAST_DOCS_MEASURE"] = str(measure)
    wrong: dict[Path, list[str]] = {}  # each run's report against the measures, as last run
    for block in blocks(page):
        if block.action == "file":
            target = tmp_path / block.arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
        elif block.action == "run":
            began = time.time()
            runner = RUNNERS[block.lang]
            argv = [sys.executable, "-"] if runner == "python" else ["bash", "-e", "-s"]
            # its own session, so that a block that overruns is ended with every
            # process it started (a launcher and its workers)
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmp_path,
                env=env,
                text=True,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(block.text, timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                pytest.fail(f"{block.where()}: still running after {TIMEOUT:.0f} s\n{err[-4000:]}")
            assert proc.returncode == 0, (
                f"{block.where()}: exit {proc.returncode}\n--- stdout\n{out[-4000:]}"
                f"\n--- stderr\n{err[-4000:]}"
            )
            procs = figures.measured(measure)
            for log in figures.logs_written(tmp_path, began):
                found, checked = figures.check_run(log, procs)
                if checked:
                    wrong[log] = [f"{block.where()}: {w}" for w in found]
    assert not any(wrong.values()), (
        f"{page.relative_to(REPO)}: a report's figures are not what the test measured:\n"
        + "\n".join(w for found in wrong.values() for w in found)
    )
    if page.name == "README.md":  # the front door's runs are measured, not skipped
        assert len(wrong) >= 2, f"README.md: {len(wrong)} run(s) measured"
    ended = unclean.read_text() if unclean.exists() else ""
    assert not ended, (
        f"{page.relative_to(REPO)}: a script's process group outlived it (torch destroys it "
        "while the interpreter finalizes, where gloo's threads may hang or abort); end it as "
        "docs/troubleshooting.md's 'Ending a DDP script cleanly' says:\n" + ended
    )
