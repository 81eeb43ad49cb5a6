#!/usr/bin/env bash
# Set up .venv (see setup_env.sh) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh --fast          # only the tests that start no process, < 1 min
#   bash scripts/test.sh tests/data -x   # a subset
#   MOC_TEST_WORKERS=0 bash scripts/test.sh ...   # in one process (pdb, -s)
set -euo pipefail
cd "$(dirname "$0")/.."
# Two workers (MOC_TEST_WORKERS; 0 runs in this process): the suite's ranks and
# launchers wait on sockets, timeouts and restarts for much of their time, so two test
# files at a time fill 2 cores (docs/testing.md has the measurements). Each file runs
# whole on one worker, so its module-scoped reference runs are made once.
dist=loadfile
# --fast (anywhere among the arguments): leave out the tests marked e2e, those that start
# processes (the rule is in tests/conftest.py). What is left shares no reference runs, so
# an idle worker takes single tests from the other's files (worksteal): 45-50 s instead of
# loadfile's 53-55 s (docs/testing.md).
args=()
for arg in "$@"; do
    if [ "$arg" = --fast ]; then
        args+=(-m "not e2e")
        dist=worksteal
    else
        args+=("$arg")
    fi
done
source scripts/setup_env.sh
workers="${MOC_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
    exec python -m pytest ${args[@]+"${args[@]}"}
fi
exec python -m pytest -n "$workers" --dist "$dist" ${args[@]+"${args[@]}"}
