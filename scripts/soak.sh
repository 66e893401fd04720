#!/usr/bin/env bash
# Run tests while a neighbour keeps every core busy, as on a real cluster's node.
#
#   scripts/soak.sh PYTHON [PYTEST ARGS...]
#
# The neighbour is one busy loop per core (nproc), at normal priority (a `nice`d
# neighbour gets almost no CPU while the tests want it and proves nothing), and a
# steadfast job of someone else's (scripts/soak_neighbour.py). They are stopped when the
# tests end, however they end (an interrupt included), and the script exits with
# pytest's status. SOAK_REPEAT=N runs the tests N times in a row
# (each run under the same load) and fails when any run fails.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 PYTHON [PYTEST ARGS...]" >&2; exit 2; }
python=$1
shift
repeat=${SOAK_REPEAT:-1}
case $repeat in
    '' | *[!0-9]* | 0) echo "soak: SOAK_REPEAT must be a positive whole number, not '$repeat'" >&2; exit 2 ;;
esac

cores=$(nproc)
neighbours=()
job=""
job_dir=$(mktemp -d "${TMPDIR:-/tmp}/soak-job.XXXXXX")
# shellcheck disable=SC2317  # called by the EXIT trap
stop_neighbours() {
    if [ ${#neighbours[@]} -gt 0 ]; then
        kill "${neighbours[@]}" 2>/dev/null || true
        wait "${neighbours[@]}" 2>/dev/null || true
        neighbours=()
    fi
    if [ -n "$job" ]; then
        # it stops by itself once this script is gone; here it is told at once
        kill -TERM -- "-$job" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$job" 2>/dev/null || true
        wait "$job" 2>/dev/null || true
        job=""
    fi
    rm -rf "$job_dir"
}
trap stop_neighbours EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$cores"); do
    # a plain busy loop: all CPU, no memory, no files; it ends by itself when this
    # script is gone, even if it was killed with no chance to stop them
    bash -c 'while kill -0 "$1" 2>/dev/null; do :; done' soak-neighbour "$$" &
    neighbours+=("$!")
done
echo "soak: $cores busy neighbours at normal priority (pids ${neighbours[*]})"
# and someone else's steadfast job (scripts/soak_neighbour.py): 2 DDP ranks, its heartbeat
# table and memory tier in /dev/shm, in a session of its own, for as long as this script
# runs; the suite's leak check must not count any of it
here=$(cd "$(dirname "$0")" && pwd)
env -u STEADFAST_SHM_TAG -u STEADFAST_EVENTS setsid "$python" -m steadfast.cli launch \
    --standalone --nproc-per-node 2 --max-restarts 100 --run-dir "$job_dir/run" \
    "$here/soak_neighbour.py" --watch "$$" > "$job_dir/launcher.log" 2>&1 &
job=$!
echo "soak: a steadfast job beside the tests (pid $job, log $job_dir/launcher.log)"

status=0
for run in $(seq "$repeat"); do
    [ "$repeat" -eq 1 ] || echo "soak: run $run of $repeat"
    "$python" -m pytest "$@" || status=$?
done
exit "$status"
