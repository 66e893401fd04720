#!/usr/bin/env bash
# Run tests while a neighbour keeps every core busy, as on a real cluster's node.
#
#   scripts/soak.sh PYTHON [PYTEST ARGS...]
#
# The neighbour is one busy loop per core (nproc), at normal priority: a `nice`d
# neighbour gets almost no CPU while the tests want it and proves nothing. It is
# stopped when the tests end, however they end (an interrupt included), and the
# script exits with pytest's status. SOAK_REPEAT=N runs the tests N times in a row
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
# shellcheck disable=SC2317  # called by the EXIT trap
stop_neighbours() {
    [ ${#neighbours[@]} -gt 0 ] || return 0
    kill "${neighbours[@]}" 2>/dev/null || true
    wait "${neighbours[@]}" 2>/dev/null || true
    neighbours=()
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

status=0
for run in $(seq "$repeat"); do
    [ "$repeat" -eq 1 ] || echo "soak: run $run of $repeat"
    "$python" -m pytest "$@" || status=$?
done
exit "$status"
