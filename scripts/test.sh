#!/usr/bin/env bash
# Set up .venv (see setup_env.sh) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/data -x   # a subset
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec python -m pytest "$@"
