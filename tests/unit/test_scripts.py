"""The shell scripts' side-effect-free subcommands end with a clean answer (0 or 1), never
a crash: a script that recursed into itself until bash segfaulted (exit 139) once made
`make test` skip the Slurm install on every new machine while CI stayed green."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("slurm-localhost.sh", ("check",)),
        ("slurm-localhost.sh", ("can-install",)),
        ("debian-packages.sh", ("can-install",)),
        ("debian-packages.sh", ("missing", "bash", "no-such-package-steadfast")),
    ],
)
def test_query_subcommands_answer_cleanly(script: str, args: tuple[str, ...]) -> None:
    proc = _run(script, *args)
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr)
    assert "Segmentation" not in proc.stderr and "recursion" not in proc.stderr.lower()


debian = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")


@debian
def test_missing_names_only_the_missing_package() -> None:
    proc = _run("debian-packages.sh", "missing", "bash", "no-such-package-steadfast")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["no-such-package-steadfast"]


def test_can_install_says_whether_root_and_apt_get_are_here() -> None:
    here = os.geteuid() == 0 and shutil.which("apt-get") and shutil.which("dpkg-query")
    assert _run("debian-packages.sh", "can-install").returncode == (0 if here else 1)
    assert _run("slurm-localhost.sh", "can-install").returncode == (0 if here else 1)


@pytest.mark.parametrize("script", ["slurm-localhost.sh", "debian-packages.sh"])
def test_unknown_subcommand_is_one_usage_line(script: str) -> None:
    proc = _run(script, "no-such-subcommand")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "usage:" in proc.stderr


@debian
def test_ensure_of_present_packages_is_a_no_op() -> None:
    """The path `make test` runs every time: with everything present it installs
    nothing and succeeds, whether or not this machine could install."""
    proc = _run("debian-packages.sh", "ensure", "bash", "coreutils")
    assert proc.returncode == 0, proc.stderr
    assert "installing" not in proc.stderr
