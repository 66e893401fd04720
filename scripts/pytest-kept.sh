#!/usr/bin/env bash
# `make pytest`: the suite, with what a failed run leaves where its user finds it:
#   RESULTS/failed.txt  each failed test's id and its first line, written as it fails
#                       (tests/conftest.py), so a run cut short keeps them
#   RESULTS/failures.log  the whole of each failure, written as it fails
#   RESULTS/pytest.log  the whole output;   RESULTS/junit.xml  every test's result
# and the failures' names printed again at the end. Usage: pytest-kept.sh PYTHON RESULTS ARGS...
set -uo pipefail
python=$1
results=$(realpath -m "$2")
shift 2
mkdir -p "$results"
rm -f "$results/failed.txt" "$results/failures.log" "$results/junit.xml" "$results/pytest.log"
export STEADFAST_TEST_RESULTS="$results"
"$python" -m pytest --junitxml="$results/junit.xml" "$@" 2>&1 | tee "$results/pytest.log"
status=${PIPESTATUS[0]}
if [ -s "$results/failed.txt" ]; then
  echo "== $(wc -l <"$results/failed.txt") failed, kept in $results/failed.txt (each in full:" \
    "$results/failures.log; the whole output: $results/pytest.log):"
  cat "$results/failed.txt"
fi
exit "$status"
