#!/usr/bin/env bash
# Mutation testing of one package of ours (not part of CI: minutes to an hour on 2 cores).
# A copy of the working tree is made in a temporary folder; cosmic-ray changes one thing
# in the copy's package at a time (an operator, a comparison, a number, a break, ...) and
# the package's own tests run on it, in a new process; a mutant no test notices survived.
# Prints the kill rate and each survivor (file:line, the line before and after) and writes
# them to a JSON file (default runs/mutation/PACKAGE[-sampleN-seedS].json).
#
#   bash scripts/mutation.sh deepspeed_ext/policy                          # every mutant
#   bash scripts/mutation.sh deepspeed_ext/policy --sample 200 --seed 1    # a seeded sample
#   bash scripts/mutation.sh deepspeed_ext/format --tests tests/deepspeed_ext/format/test_manifest.py
#   bash scripts/mutation.sh deepspeed_ext/store --sample 200 --seed 1 --pytest-args='-m "not e2e"'
#
# The tests default to the package's mirror under tests/; scripts/mutation.py --help lists
# every flag (--tests, --pytest-args, --sample, --seed, --timeout, --json, --fail-under,
# --survivors-of, --count-only). --pytest-args='-m "not e2e"' leaves out the tests that
# start processes (ranks, keepers, launchers): seconds a mutant instead of minutes.
# Sets up .venv as scripts/test.sh does, then installs the cosmic-ray that pyproject.toml's
# [mutation] extra pins when .venv has another version or none.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
want="$(python -c 'import tomllib
with open("pyproject.toml", "rb") as f:
    print(tomllib.load(f)["project"]["optional-dependencies"]["mutation"][0])')"
have="$(python -c 'from importlib.metadata import version
print("cosmic-ray==" + version("cosmic-ray"))' 2>/dev/null || true)"
if [ "$have" != "$want" ]; then
    echo "[mutation] installing $want into .venv"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 python -m pip install -q "$want"
fi
exec python scripts/mutation.py "$@"
