#!/usr/bin/env bash
# Check MoC's CUDA paths on one GPU (10 minutes without in_job_restart): install the project's dependencies
# offline from .gpu_wheels/ (made by scripts/gpu_wheels.sh on a machine that reaches PyPI
# and copied over with the repository), then run scripts/gpu_check.py's eight checks, each under a time cap: the
# CUDA unit tests, what 2 ranks sharing the GPU can use, snapshot bandwidth against a
# pinned copy, a crash recovered from memory with bitwise losses, an exact-mode replay,
# an in-job restart's NCCL group cycle and a hot spare's takeover, the checkpoint stall against DeepSpeed's save_checkpoint with MoC's snapshot stages, and
# the stall and copy bandwidth of a 9 GB state (checkpoint_stall_large). Prints one PASS/FAIL/SKIP
# line per check and writes a JSON summary to benchmarks/gpu/<date>-<device>.json and to
# $OUT when set. Exit 0 unless a check failed.
#
#   bash scripts/gpu_check.sh [--dry-run | --mode cpu] [--only CHECK,...] [--reinstall]
#                             [--install-only] [--summary-dir DIR]
#
# --dry-run: no install, no check run (the summary's shape); --mode cpu: the checks that
# can run on CPU do, at CPU sizes (exercises the script where there is no GPU). Without a
# GPU and without either flag every check is SKIP with the reason.
# Environment: PYTHON (default python3: the machine's Python with its CUDA torch, never
# reinstalled), GPU_WHEELS (default .gpu_wheels), GPU_CHECK_SITE (where the packages go,
# default /tmp/moc-gpu-site, put first on PYTHONPATH), GPU_CHECK_WORK (scratch).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-$REPO/.gpu_wheels}"
SITE="${GPU_CHECK_SITE:-/tmp/moc-gpu-site}"
WORK="${GPU_CHECK_WORK:-/tmp/moc-gpu-check}"
DRY=0 REINSTALL=0 INSTALL_ONLY=0 ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; ARGS+=("$1") ;;
        --reinstall) REINSTALL=1 ;;
        --install-only) INSTALL_ONLY=1 ;;
        --mode|--only|--summary-dir|--budget-s) ARGS+=("$1" "${2:?$1 needs a value}"); shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore \
    PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
mkdir -p "$WORK"
LOG="$WORK/install.log"

# The commit: from git where the checkout has it, else the one gpu_wheels.sh recorded
# (a copy of the repository made without its .git directory has no commit of its own).
COMMIT="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || true)"
if [ -n "$COMMIT" ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="$COMMIT (+ uncommitted changes)"
fi
[ -z "$COMMIT" ] && [ -f "$WHEELS/commit.txt" ] && COMMIT="$(cat "$WHEELS/commit.txt") (from $(basename "$WHEELS")/commit.txt)"
COMMIT="${COMMIT:-unknown}"

# What the project imports. Found (without importing: DeepSpeed takes seconds to import)
# is what makes the install unnecessary; imported is what proves an install worked.
MODULES="deepspeed megatron.core hjson pydantic yaml safetensors xxhash pytest deepspeed_ext megatron.training"
IMPORTS="import ${MODULES// /, }"
FOUND="import importlib.util, sys; missing = [m for m in '$MODULES'.split() if importlib.util.find_spec(m) is None]; print('missing:', *missing); sys.exit(1 if missing else 0)"
torch_id() { "$PY" -c "import torch; print(torch.__version__, torch.__file__)" 2>&1; }

install_offline() {
    # Everything into $SITE with --no-deps (the list in requirements.txt is complete), so
    # pip never resolves, upgrades or downloads anything, and torch is never touched.
    local wheels sdists
    wheels=("$WHEELS"/*.whl) sdists=("$WHEELS"/*.tar.gz)
    rm -rf "$SITE" && mkdir -p "$SITE" || return 1
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 || return 1
    # Sdists (DeepSpeed): built here against this machine's torch with the setuptools just
    # installed (--no-build-isolation: no index to fetch a build environment from), and
    # no op compiled (DS_BUILD_OPS=0: MoC uses none of DeepSpeed's CUDA ops).
    [ -e "${sdists[0]}" ] || return 0
    DS_BUILD_OPS=0 timeout 240 "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --no-build-isolation --target "$SITE" "${sdists[@]}" >>"$LOG" 2>&1
}

install_status=SKIP install_reason="dry run" install_s=0
if [ "$DRY" = 0 ]; then
    start=$(date +%s)
    if [ "$REINSTALL" = 0 ] && "$PY" -c "$FOUND" >>"$LOG" 2>&1; then
        install_status=PASS install_reason="already importable, nothing installed"
    elif [ ! -f "$WHEELS/requirements.txt" ]; then
        install_status=FAIL
        install_reason="no $WHEELS/requirements.txt: run scripts/gpu_wheels.sh where pip reaches PyPI and copy .gpu_wheels/ here with the repository"
    else
        before="$(torch_id)"
        if ! install_offline; then
            install_status=FAIL install_reason="pip install failed: $(tail -n 3 "$LOG" | tr '\n' ' ')"
        elif ! "$PY" -c "$IMPORTS" >>"$LOG" 2>&1; then
            install_status=FAIL install_reason="installed, but: $(tail -n 1 "$LOG")"
        elif [ "$(torch_id)" != "$before" ] || [ -e "$SITE/torch" ]; then
            install_status=FAIL install_reason="torch changed: $before -> $(torch_id)"
        else
            install_status=PASS
            install_reason="$(ls "$WHEELS" | grep -c -E '\.(whl|tar\.gz)$') packages from $(basename "$WHEELS") into $SITE, offline; torch untouched ($(echo "$before" | cut -d' ' -f1))"
        fi
    fi
    install_s=$(( $(date +%s) - start ))
    [ -n "${OUT:-}" ] && cp "$LOG" "$OUT/install.log" 2>/dev/null
fi
if [ "$INSTALL_ONLY" = 1 ]; then
    echo "$install_status install (${install_s} s): $install_reason"
    [ "$install_status" != FAIL ] && "$PY" -c "$IMPORTS
import deepspeed, megatron.core, torch
print('imported deepspeed', deepspeed.__version__, 'megatron.core', megatron.core.__version__, 'torch', torch.__version__, 'from', deepspeed.__file__)"
    exit $?
fi
# A 'python' first on PATH that is this Python: scripts/run_elastic.sh calls 'python'.
mkdir -p "$WORK/bin"
printf '#!/bin/sh\nexec %q "$@"\n' "$(command -v "$PY")" > "$WORK/bin/python"
chmod +x "$WORK/bin/python"
export PATH="$WORK/bin:$SITE/bin:$PATH"
exec "$PY" scripts/gpu_check.py "${ARGS[@]}" --work "$WORK/checks" --commit "$COMMIT" \
    --install-status "$install_status" --install-reason "$install_reason" \
    --install-seconds "$install_s"
