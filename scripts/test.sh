#!/usr/bin/env bash
# Set up .venv (see setup_env.sh) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/data -x   # a subset
#   MOC_TEST_WORKERS=0 bash scripts/test.sh ...   # in one process (pdb, -s)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# Two workers (MOC_TEST_WORKERS; 0 runs in this process): the suite's ranks and
# launchers wait on sockets, timeouts and restarts for much of their time, so two test
# files at a time fill 2 cores (docs/testing.md has the measurements). Each file runs
# whole on one worker, so its module-scoped reference runs are made once.
workers="${MOC_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
    exec python -m pytest "$@"
fi
exec python -m pytest -n "$workers" --dist loadfile "$@"
