# Sourced by quickstart.sh and test.sh: create or reuse .venv at the repository root
# and install the project into it. Idempotent; a second run installs nothing new.
#
# torch is installed first and pinned (2.13.0, a CPU build on these machines) unless
# torch is already importable: a GPU user's own torch build is left alone (the venv
# then sees the system site-packages).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="${MOC_TORCH_PIN:-torch==2.13.0}"

if [ ! -x "$REPO_ROOT/.venv/bin/python" ]; then
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "[setup] torch found in $PYTHON: creating .venv with system site-packages"
        "$PYTHON" -m venv --system-site-packages "$REPO_ROOT/.venv"
    else
        echo "[setup] creating .venv"
        "$PYTHON" -m venv "$REPO_ROOT/.venv"
    fi
fi
# shellcheck disable=SC1091
source "$REPO_ROOT/.venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if ! python -c "import torch" 2>/dev/null; then
    echo "[setup] installing $TORCH_PIN"
    python -m pip install -q "$TORCH_PIN"
fi
stamp="$REPO_ROOT/.venv/.moc-installed"
if [ ! -f "$stamp" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "[setup] installing the project and its dependencies"
    python -m pip install -q -e "$REPO_ROOT[test]"
    touch "$stamp"
fi
