#!/usr/bin/env bash
# Fill .gpu_wheels/ (ignored by git) with everything scripts/gpu_check.sh installs on a GPU
# machine that has CPython 3.12 and a CUDA torch but no network: DeepSpeed (an sdist, built
# there with DS_BUILD_OPS=0), megatron-core and the rest of the project's runtime and test
# dependencies, at the versions of this checkout's .venv (`.venv/bin/pip freeze`), as
# CPython 3.12 manylinux x86_64 wheels (sdists where PyPI has no wheel). Never torch nor
# torch's own dependencies: the GPU machine's torch is the one to test.
#
#   bash scripts/gpu_wheels.sh [DIR]        # DIR defaults to .gpu_wheels
#
# Then copy the repository with .gpu_wheels/ to the GPU machine and run
# `bash scripts/gpu_check.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu_wheels}"
PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"

# name=fallback version. The version used is .venv's (pip freeze) when it has the package,
# so the GPU run tests what the CPU suite tests; the fallback is for a checkout without
# .venv. build-only: setuptools (DeepSpeed's sdist is built with --no-build-isolation).
PACKAGES=(
    deepspeed=0.19.8 megatron-core=0.16.1
    einops=0.8.2 hjson=3.1.0 msgpack=1.2.4 ninja=1.13.2 numpy=2.4.6 packaging=26.4
    psutil=7.2.2 py-cpuinfo=9.0.0 pydantic=2.14.4 pydantic-core=2.50.5
    annotated-types=0.8.0 typing-extensions=4.16.0 typing-inspection=0.4.5 tqdm=4.70.1
    pyyaml=6.0.4 safetensors=0.8.0 xxhash=4.1.0
    pytest=9.2.0 iniconfig=2.3.1 pluggy=1.7.0 pygments=2.21.0
    setuptools=84.2.1
)
# PyPI ships these as sdists only.
SDIST_ONLY=" deepspeed "

normalize() { echo "$1" | tr 'A-Z_.' 'a-z--'; }

declare -A FROZEN=()
if [ -x .venv/bin/pip ]; then
    while IFS='=' read -r name _ version; do
        [ -n "$version" ] && FROZEN["$(normalize "$name")"]="${version%%+*}"
    done < <(.venv/bin/pip freeze --all 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==')
else
    echo "[gpu_wheels] no .venv: using the fallback versions written in this script" >&2
fi

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
wheels=() sdists=()
for entry in "${PACKAGES[@]}"; do
    name="${entry%%=*}"
    version="${FROZEN[$(normalize "$name")]:-${entry#*=}}"
    if [[ "$SDIST_ONLY" == *" $name "* ]]; then
        sdists+=("$name==$version")
    else
        wheels+=("$name==$version")
    fi
done
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# Several manylinux tags: pip matches each exactly, and megatron-core's wheel is 2_24.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$DEST.tmp" "${wheels[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$DEST.tmp" "${sdists[@]}"
# One version of each: a stale file from an earlier run would stop the offline install.
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
printf '%s\n' "${wheels[@]}" "${sdists[@]}" > "$DEST/requirements.txt"
# The commit the wheels were made for: gpu_check.sh's summary names it where the copy of
# the working tree it runs in has no .git.
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit (+ uncommitted changes)"
fi
echo "$commit" > "$DEST/commit.txt"
echo "[gpu_wheels] $(ls "$DEST" | grep -c -E '\.(whl|tar\.gz|zip)$') files, $(du -sh "$DEST" | cut -f1) in $DEST:"
cat "$DEST/requirements.txt"
