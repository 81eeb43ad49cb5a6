"""The JSON summary of a ``scripts/gpu_check.py`` run (schema 1: ``environment``,
``install``, ``checks``, ``total_s``, ``verdict``), where it goes, and the console lines."""

import datetime
import json
import os
import platform
import re
import shutil
from dataclasses import asdict, dataclass
from typing import List, Optional

from gpu_checks.common import FAIL, PASS, SKIP, CheckResult

SCHEMA = 1


@dataclass
class Environment:
    """Where the checks ran."""
    mode: str
    device: str
    date: str
    commit: str
    host: str
    python: str
    torch: str
    cuda: Optional[str]
    nccl: Optional[str]
    deepspeed: Optional[str]
    megatron_core: Optional[str]
    shm_free_gib: Optional[float]


@dataclass
class Summary:
    """The whole summary, written after every check (the last one whole if a run is killed)."""
    schema: int
    environment: Environment
    install: CheckResult
    checks: List[CheckResult]
    total_s: float
    verdict: str


def _version(package: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(mode: str, commit: str) -> Environment:
    """This machine's device, versions and free ``/dev/shm`` (imports torch)."""
    import torch
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    shm = shutil.disk_usage("/dev/shm").free / 2**30 if os.path.isdir("/dev/shm") else None
    return Environment(mode=mode, device=device,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       commit=commit, host=platform.node(), python=platform.python_version(),
                       torch=torch.__version__, cuda=torch.version.cuda, nccl=nccl,
                       deepspeed=_version("deepspeed"), megatron_core=_version("megatron-core"),
                       shm_free_gib=round(shm, 1) if shm is not None else None)


def summary_name(env: Environment) -> str:
    """``<date>-<device>.json``, e.g. ``2026-11-27-nvidia-h100-80gb-hbm3.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", env.device.lower()).strip("-") or "device"
    return f"{env.date[:10]}-{slug}.json"


def summary_paths(summary_dir: str, env: Environment) -> List[str]:
    """The summary's path in ``summary_dir``, and in ``$OUT`` when that is set."""
    paths = [os.path.join(summary_dir, summary_name(env))]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], summary_name(env)))
    return paths


def write_summary(summary: Summary, paths: List[str]) -> None:
    """Atomically (temp, fsync, rename), so a run killed mid-check leaves the last one whole."""
    text = json.dumps(asdict(summary), indent=1, default=str)
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def header(env: Environment) -> str:
    """The first console line: the device, the versions, the commit, the mode."""
    return (f"[gpu_check] {env.device}; torch {env.torch}, CUDA {env.cuda}, NCCL {env.nccl}, "
            f"deepspeed {env.deepspeed}, megatron-core {env.megatron_core}, Python {env.python}; "
            f"commit {env.commit}; mode {env.mode}")


def line(r: CheckResult) -> str:
    """A check's console line: ``STATUS name (seconds of cap): reason``."""
    cap = f" of {r.cap_s:.0f}" if r.cap_s else ""
    return f"{r.status} {r.name} ({r.seconds:.1f} s{cap}): {r.reason}"


def verdict(install: CheckResult, checks: List[CheckResult]) -> str:
    """FAIL if anything failed, else PASS if a check passed, else SKIP."""
    statuses = [install.status] + [c.status for c in checks]
    if FAIL in statuses:
        return FAIL
    return PASS if PASS in [c.status for c in checks] else SKIP
