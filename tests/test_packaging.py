"""The package installs the modern way: ``pip install -e .`` is a PEP 660 editable
install through pyproject.toml's build backend, and it keeps our ``megatron.*``
subpackages beside the installed ``megatron.core`` (one namespace, two places)."""

import os
import site
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_declares_a_build_system_and_a_free_name():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["build-system"]["build-backend"] == "setuptools.build_meta"
    # `moc` on the package index is an unrelated project.
    assert meta["project"]["name"] == "moc-checkpoint"
    assert set(meta["project"]["scripts"]) == {"moc-pretrain", "moc-preprocess-data",
                                               "moc-ckpt", "moc-plan"}
    assert not os.path.exists(os.path.join(REPO, "setup.py"))  # one source of metadata
    # a megatron/__init__.py would shadow the installed megatron.core
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))


def test_editable_install_keeps_megatron_core_and_our_megatron_packages(tmp_path):
    """A fresh venv, our project installed editable into it (no dependencies: the test's
    own site-packages, with torch, DeepSpeed and megatron-core, is put on its path
    without running its .pth files, so this checkout's existing install does not count)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    target_site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(target_site, "zz_test_deps.pth"), "w") as f:
        f.write(site.getsitepackages()[0] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-build-isolation", "--no-index", "-e", REPO],
        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = ("import megatron.core, megatron.training, megatron.data, megatron.model, "
             "deepspeed_ext, pretrain_gpt_moe\n"
             "for m in (megatron.core, megatron.training, deepspeed_ext, pretrain_gpt_moe):\n"
             "    print(m.__file__)")
    found = subprocess.run([python, "-W", "ignore", "-c", probe], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr[-3000:]
    core, training, ext, entry = found.stdout.split()
    assert not core.startswith(os.path.join(REPO, "megatron") + os.sep)  # the installed one
    assert core.endswith(os.path.join("megatron", "core", "__init__.py"))
    assert training == os.path.join(REPO, "megatron", "training", "__init__.py")
    assert ext == os.path.join(REPO, "deepspeed_ext", "__init__.py")
    assert entry == os.path.join(REPO, "pretrain_gpt_moe.py")
    script = subprocess.run([str(venv / "bin" / "moc-ckpt"), "--help"], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert script.returncode == 0 and "consolidate" in script.stdout, script.stderr[-2000:]


FAKE_VENV_PYTHON = """#!/bin/sh
# a stand-in for .venv/bin/python: "import torch" works; pip fails when FAIL_PIP is set
echo "$*" >> "$CALLS"
case "$*" in *"-m pip"*) [ -z "${FAIL_PIP:-}" ] ;; esac
"""


def _sandbox(tmp_path, installed: bool):
    """A copy of scripts/setup_env.sh beside a venv that has its stand-in python (so
    nothing is really installed) and, with ``installed``, a stamp newer than
    pyproject.toml."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    with open(os.path.join(REPO, "scripts", "setup_env.sh")) as f:
        (repo / "scripts" / "setup_env.sh").write_text(f.read())
    (repo / "pyproject.toml").write_text("")
    python = repo / ".venv" / "bin" / "python"
    python.write_text(FAKE_VENV_PYTHON)
    python.chmod(0o755)
    (repo / ".venv" / "bin" / "activate").write_text(
        f'VIRTUAL_ENV="{repo}/.venv"; PATH="$VIRTUAL_ENV/bin:$PATH"\n')
    if installed:
        os.utime(repo / "pyproject.toml", (1, 1))
        (repo / ".venv" / ".moc-installed").write_text("")
    return repo


def _bash(repo, script: str, *flags: str, **env) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(repo), "CALLS": str(repo / "calls"), **env}
    return subprocess.run(["bash", "--norc", "--noprofile", *flags, "-c", script], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=60)


OPTIONS = 'echo "$(set +o; shopt -p)" > {out}; echo "$-" >> {out}'


@pytest.mark.parametrize("fail", [False, True])
def test_setup_env_leaves_an_interactive_shell_as_it_was(tmp_path, fail):
    """Sourced from an interactive shell, setup_env.sh changes none of its options
    (it used to leave set -euo pipefail behind) and a failed install returns a status
    instead of closing the shell; installed already, it runs no pip at all."""
    repo = _sandbox(tmp_path, installed=not fail)
    script = (OPTIONS.format(out="before") + "; source scripts/setup_env.sh; rc=$?; "
              + OPTIONS.format(out="after") + '; echo "rc=$rc venv=${VIRTUAL_ENV:-none}"; '
              'echo "leftover=${_moc_setup_status:-}${_moc_setup_root:-}"')
    proc = _bash(repo, script, "-i", **({"FAIL_PIP": "1"} if fail else {}))
    assert "leftover=\n" in proc.stdout, proc.stdout + proc.stderr
    assert (repo / "before").read_text() == (repo / "after").read_text()
    after = (repo / "after").read_text()
    assert all(f"set +o {o}\n" in after for o in ("errexit", "nounset", "pipefail")), after
    assert "i" in after.splitlines()[-1]  # $-: the shell was interactive
    calls = (repo / "calls").read_text().splitlines()
    if fail:
        assert "rc=1 venv=none" in proc.stdout and "[setup] failed (status 1)" in proc.stderr
        assert any("-m pip install" in c for c in calls)
        assert not (repo / ".venv" / ".moc-installed").exists()  # no stamp for a failure
    else:
        assert f"rc=0 venv={repo}/.venv" in proc.stdout
        assert calls == ["-c import torch"]  # the installed venv: no pip, one import


def test_setup_env_stops_a_strict_caller_at_a_failed_install(tmp_path):
    """test.sh and quickstart.sh source it under set -euo pipefail: a failed pip install
    stops them there, and its steps stay strict even when the caller's `source` is the
    left side of ||, where bash ignores set -e (no stamp after a failed install)."""
    repo = _sandbox(tmp_path, installed=False)
    proc = _bash(repo, "set -euo pipefail; source scripts/setup_env.sh; echo after",
                 FAIL_PIP="1")
    assert proc.returncode == 1 and "after" not in proc.stdout, proc.stdout + proc.stderr
    proc = _bash(repo, "source scripts/setup_env.sh || echo refused=$?", FAIL_PIP="1")
    assert "refused=1" in proc.stdout and not (repo / ".venv" / ".moc-installed").exists()
    proc = _bash(repo, "bash scripts/setup_env.sh; echo status=$?", FAIL_PIP="1")
    assert "status=1" in proc.stdout
