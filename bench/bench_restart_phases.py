"""A restart phase by phase, and the compile phase warm from the job's compile cache on the
same node and on a spare (issue 38), in one run.

    .venv/bin/python bench/bench_restart_phases.py [--cuda] [--plain-only] [--json PATH]

``--cuda``: the script's rank on the GPU, over NCCL (its ``init_process_group`` is then
NCCL's, and Inductor builds Triton kernels instead of C++ ones). ``--plain-only``: run 1
alone.

``tests/e2e/unchanged_train.py`` (one rank, Adam, a DataLoader, its own snapshot; no
line of steadfast) under ``steadfast launch``, its rank asleep in step 8 once (a hang:
detected, ended, restarted in-job). Three runs:

1. **Uncompiled**: the restart's phases (``steadfast report``'s).
2. **Compiled with Inductor** (``torch.compile`` on the model and the optimizer's step),
   on a node whose temporary folder is new: the first generation compiles cold; the
   restart on the same node compiles from the job's cache on that node.
3. **A spare**: the same job's next launcher on another node (a temporary folder of its
   own, so no node-local cache), in the same run directory: it compiles from the run
   directory's copy of the cache, which run 2 published.

Printed: each run's restart (or start) phases, the cold compile, the warm compiles and
their ratios to the cold one (target: <= 25 % on the same node and on a spare), and the
uncompiled restart beside the compiled one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "unchanged_train.py"


CUDA = ["--cuda"] if "--cuda" in sys.argv[1:] else []
#: ``--json PATH``: the figures written there too
JSON = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv[1:-1] else None


def write(figures: dict[str, Any]) -> None:
    if JSON is not None:
        Path(JSON).write_text(json.dumps(figures, indent=1) + "\n")


def run(run_dir: Path, tmp: Path, *extra: str) -> list[dict[str, Any]]:
    """One ``steadfast launch`` of the script with the run directory and the node's own
    temporary folder; its events."""
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--events",
        str(run_dir / "events.jsonl"), "--nproc-per-node=1", "--max-restarts=2",
        str(SCRIPT), "--out", str(run_dir / "out.pt"), "--snapshot", str(run_dir / "snap.pt"),
        "--trace", str(run_dir / "trace"), "--steps", "14", "--pace", "0", *CUDA, *extra,
    ]  # fmt: skip
    env = {**__import__("os").environ, "TMPDIR": str(tmp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def report(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", "--json", "--no-timeline", str(run_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def firsts(evs: list[dict[str, Any]], since: float = 0.0) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == "first_step" and e["time"] > since]


def show(title: str, phases: dict[str, float]) -> None:
    total = sum(phases.values())
    parts = ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if v >= 0.0005)
    print(f"  {title}: {total:.2f} s\n      {parts}")


def main() -> None:
    import torch

    where = f"cuda ({torch.cuda.get_device_name()})" if CUDA else "cpu"
    print(f"torch {torch.__version__}, the rank on {where}, {__import__('os').cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as root_name:
        root = Path(root_name)
        plain = root / "plain"
        plain.mkdir()
        run(plain, root / "tmp-plain", "--hang", "sleep:0:8")
        (plain_restart,) = report(plain)["restarts_phases"]
        figures = {"device": where, "torch": torch.__version__,
                   "uncompiled_restart": plain_restart["phases"]}  # fmt: skip
        if "--plain-only" in sys.argv[1:]:
            show("uncompiled restart", plain_restart["phases"])
            write(figures)
            return

        job = root / "compiled"
        job.mkdir()
        evs = run(job, root / "tmp-node1", "--compile", "--compile-backend", "inductor",
                  "--hang", "sleep:0:8")  # fmt: skip
        cold, warm_same = (e["compile"] for e in firsts(evs))
        (compiled_restart,) = report(job)["restarts_phases"]
        ended = max(e["time"] for e in evs)
        shared = sum(1 for p in (job / "compile-cache").rglob("*") if p.is_file())
        (job / "snap.pt").unlink()  # the spare's job starts from step 0: it compiles first
        evs = run(job, root / "tmp-spare", "--compile", "--compile-backend", "inductor")
        (spare,) = firsts(evs, ended)
        warm_spare = spare["compile"]

    print("restart phases (steadfast report), fault -> first step:")
    show("uncompiled restart", plain_restart["phases"])
    show("compiled restart (same node, warm)", compiled_restart["phases"])
    print("compile phase (torch.compile with Inductor, model and optimizer step):")
    print(f"  cold (a new node's first start)        {cold:7.2f} s")
    print(f"  warm restart on the same node          {warm_same:7.2f} s   "
          f"{100 * warm_same / cold:5.1f} % of cold (target <= 25 %)")  # fmt: skip
    print(f"  warm start on a spare (run dir's copy) {warm_spare:7.2f} s   "
          f"{100 * warm_spare / cold:5.1f} % of cold (target <= 25 %; "
          f"{shared} files shared)")  # fmt: skip
    plain_total = sum(plain_restart["phases"].values())
    compiled_total = sum(compiled_restart["phases"].values())
    print(f"  uncompiled restart, total              {plain_total:7.2f} s")
    print(f"  compiled restart, total                {compiled_total:7.2f} s")
    write({**figures, "compiled_restart": compiled_restart["phases"], "compile_cold": cold,
           "compile_warm_same_node": warm_same, "compile_warm_spare": warm_spare})  # fmt: skip


if __name__ == "__main__":
    main()
