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
