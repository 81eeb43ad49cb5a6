"""MoC's collectives on CPU tensors and objects run on the metadata group (gloo), never
on the training's device group (NCCL on GPUs, which has no CPU backend): the group's
life cycle, and the rule checked on the sources and in running jobs
(``group_rules.py``)."""

import json
import os
import signal

import pytest

from tests.deepspeed_ext.runtime import group_rules
from tests.launch import describe, fresh_python, run_ranks
from tests.shm import new_shm_dir, stop_keepers


def test_no_project_collective_hands_the_default_group_host_data():
    """Every ``torch.distributed`` collective in deepspeed_ext/, megatron/, benchmarks/,
    tools/ names its group, except the listed call sites (device tensors and the groups'
    own creation)."""
    found = group_rules.scan()
    assert not group_rules.violations(found), "\n".join(group_rules.violations(found))
    stale = [key for key in group_rules.DEFAULT_GROUP_CALLS if key not in found]
    assert not stale, f"allowed call sites that no longer exist (drop them): {stale}"


@pytest.mark.parametrize("source, expected", [
    ("import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n",
     [("f", "all_reduce", 3)]),
    ("import torch.distributed as dist\nclass C:\n    def f(self, t):\n"
     "        dist.all_reduce(t, group=None)\n", [("C.f", "all_reduce", 4)]),
    ("import torch\ndef f(x):\n    torch.distributed.all_gather_object([None], x, "
     "group=torch.distributed.group.WORLD)\n", [("f", "all_gather_object", 3)]),
    ("import torch.distributed as td\ndef f():\n    def g():\n        td.barrier()\n",
     [("f.<locals>.g", "barrier", 4)]),
    ("from torch.distributed import broadcast_object_list\n",
     [("<import>", "broadcast_object_list", 1)]),
    ("import torch.distributed as dist\nfrom deepspeed_ext.runtime.groups import metadata_group\n"
     "def f(t):\n    dist.all_reduce(t, group=metadata_group())\n", []),
])
def test_the_scan_finds_collectives_on_the_default_group(source, expected):
    assert group_rules.calls_on_default_group(source) == expected


def test_metadata_group_life_cycle():
    """On a gloo world the default group is the metadata group (CPU runs unchanged);
    as on NCCL (``separate_on_gloo``), a group of its own, made once by the first
    init_metadata_group (later calls return it) with the job's timeout, refused before
    it exists, and made again for a new default group."""
    lines = fresh_python("""
import os, datetime
import torch, torch.distributed as dist
from deepspeed_ext.runtime import groups
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
from tests.launch import free_port
os.environ["MASTER_PORT"] = str(free_port())
dist.init_process_group("gloo")
print(groups.metadata_group() is dist.group.WORLD, groups.init_metadata_group() is dist.group.WORLD)
dist.destroy_process_group()
groups.separate_on_gloo = True
os.environ["MASTER_PORT"] = str(free_port())
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=77))
try:
    groups.metadata_group()
except RuntimeError as e:
    print("refused", "init_metadata_group" in str(e))
g = groups.init_metadata_group()
print(g is not dist.group.WORLD, dist.get_backend(g), groups.init_metadata_group() is g,
      groups.metadata_group() is g)
print(g._get_backend(torch.device("cpu")).options._timeout)  # the job's timeout
t = torch.ones(2, dtype=torch.float64)
dist.all_reduce(t, group=groups.metadata_group())
print(t.tolist())
dist.destroy_process_group()
os.environ["MASTER_PORT"] = str(free_port())
dist.init_process_group("gloo")
g2 = groups.init_metadata_group()
print(g2 is not g, g2 is not dist.group.WORLD)
dist.destroy_process_group()
""")
    assert lines == ["True True", "refused True", "True gloo True True", "0:01:17",
                     "[1.0, 1.0]", "True True"], lines


def test_the_exchanger_runs_on_the_metadata_group(tmp_path):
    """The snapshot's exchange (its fixed-size all_gather and its all_gather_object)
    goes to the metadata group's CPU tensors, here a group of its own."""
    lines = fresh_python("""
import os
import torch.distributed as dist
from deepspeed_ext.runtime import groups
from deepspeed_ext.runtime.exchange import Exchanger
from tests.deepspeed_ext.runtime import group_rules
from tests.launch import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo")
groups.separate_on_gloo = True
groups.init_metadata_group()
bad, seen = [], {}
group_rules.install_guard(bad.append, seen)
e = Exchanger()
print(e.exchange("a"), e.exchange("b"), bad, seen, flush=True)
dist.destroy_process_group()
# Once in a clean clone's CI the interpreter's exit aborted ("terminate called without an
# active exception": a gloo thread torn down at exit) after all of the above had run.
os._exit(0)
""")
    assert lines == ["['a'] ['b'] [] {'own_group': 2}"], lines


def _guarded(tmp_path, corpus, args, ok=True, nproc=2, timeout=240):
    """Run the trainer under the guard; no violation on any rank (a crashed job's
    violations up to its crash included)."""
    out = tmp_path / "guard"
    out.mkdir(exist_ok=True)
    results = run_ranks(nproc, ["--config", "configs/tiny.yaml", "--split", "90,10,0",
                                "--data-path", corpus] + args,
                        script="tests/deepspeed_ext/runtime/groups_guard_worker.py",
                        timeout=timeout,
                        env={"MOC_GROUP_GUARD_OUT": str(out)})
    if ok:
        assert all(r.returncode == 0 for r in results), describe(results)
    bad = sorted({line for name in os.listdir(out) if name.endswith(".txt")
                  for line in open(out / name).read().splitlines()})
    assert not bad, "\n".join(bad)
    if ok:  # the guard saw the project's collectives on the metadata group
        for rank in range(nproc):
            assert json.loads((out / f"rank{rank}.json").read_text())["own_group"] > 0
    for name in os.listdir(out):
        os.remove(out / name)
    return results


@pytest.mark.parametrize("mode", ["two-level", "exact"])
def test_a_job_runs_no_host_collective_on_the_device_group(tmp_path, corpus, mode):
    """2 ranks of the trainer, as on NCCL (the metadata group a group of its own), a
    job killed (two-level at iteration 5, exact at 13) and its restart, which recovers from memory: two-level
    with peer replication (snapshots, the memory budget's check, rank 0's node memory
    lost and rebuilt from its peer, the end's persist) or exact (the automatic window's
    probe, the memory check, frames, the keeper, the window's agreement and replay, the
    end): no collective from the project's code runs on the default group outside the
    allowed (device) call sites."""
    shm = new_shm_dir()
    ckpt = tmp_path / "ckpt"
    common = ["--save", str(ckpt), "--load", str(ckpt), "--moc-checkpoint",
              "--moc-shm-dir", shm, "--train-iters", "6" if mode == "two-level" else "14"]
    if mode == "two-level":
        common += ["--moc-two-level", "--moc-snapshot-interval", "1",
                   "--moc-persist-interval", "100", "--moc-ranks-per-node", "1",
                   "--moc-redundancy", "replicate"]
        fault = "lose-memory@5"
    else:
        common += ["--moc-mode", "exact", "--moc-window", "0", "--save-interval", "100"]
        # the automatic W is timed (2 to 4 seen here): the crash comes late
        # enough for a whole window after the probe at 3
        fault = "crash@13"
    try:
        first = _guarded(tmp_path, corpus, common + ["--moc-fault", fault], ok=False)
        assert first[0].returncode == -signal.SIGKILL, describe(first)
        second = _guarded(tmp_path, corpus, common)
        if mode == "two-level":
            assert "from the peers' memory" in second[0].output, describe(second)
        else:
            assert "[moc] exact recovery: window W = " in first[0].output, describe(first)
            assert "exact replay from memory" in second[0].output, describe(first) + describe(second)
    finally:
        stop_keepers(shm)
