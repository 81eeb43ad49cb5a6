# Create or reuse .venv at the repository root, install the project into it, and
# activate it in the calling shell. Sourced by quickstart.sh and test.sh, and by users:
#   source scripts/setup_env.sh
# Idempotent: once the project is installed (the stamp .venv/.moc-installed, newer than
# pyproject.toml), a second run installs nothing and costs about one `import torch`.
#
# torch is installed first and pinned (2.13.0, a CPU build on these machines) unless
# torch is already importable: a GPU user's own torch build is left alone (the venv
# then sees the system site-packages).
#
# Safe to source from an interactive shell: the steps run strictly (set -euo pipefail)
# in a bash process of their own, so the caller's shell options are never changed and a failed step
# returns its status instead of closing the caller's shell; only the venv's activation
# happens in the caller. A strict caller (test.sh, quickstart.sh) stops on that status.
_moc_setup_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The steps run in a bash of their own: a subshell would not do, since bash ignores
# set -e inside anything run on the left of || or && (`source setup_env.sh || ...`),
# and a failed pip install would then be stamped as installed.
# PYTHON and MOC_TORCH_PIN are passed on even when the caller set them without export.
MOC_SETUP_ROOT="$_moc_setup_root" PYTHON="${PYTHON:-python3}" \
    MOC_TORCH_PIN="${MOC_TORCH_PIN:-torch==2.13.0}" bash -c '
    set -euo pipefail
    REPO_ROOT="$MOC_SETUP_ROOT"
    TORCH_PIN="$MOC_TORCH_PIN"
    if [ ! -x "$REPO_ROOT/.venv/bin/python" ]; then
        if "$PYTHON" -c "import torch" 2>/dev/null; then
            echo "[setup] torch found in $PYTHON: creating .venv with system site-packages"
            "$PYTHON" -m venv --system-site-packages "$REPO_ROOT/.venv"
        else
            echo "[setup] creating .venv"
            "$PYTHON" -m venv "$REPO_ROOT/.venv"
        fi
    fi
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
'
_moc_setup_status=$?
if [ "$_moc_setup_status" = 0 ]; then
    # shellcheck disable=SC1091
    source "$_moc_setup_root/.venv/bin/activate"
else
    echo "[setup] failed (status $_moc_setup_status): .venv not activated" >&2
fi
unset _moc_setup_root
if (return 0 2>/dev/null); then  # sourced: return, leaving no variable of ours behind
    eval "unset _moc_setup_status; return $_moc_setup_status"
fi
exit "$_moc_setup_status"  # run as `bash scripts/setup_env.sh`
