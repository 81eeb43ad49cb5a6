"""Boundaries of :mod:`deepspeed_ext.store.catalog` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import os

from deepspeed_ext.store.catalog import resolve_checkpoint, scan_checkpoints
from tests.deepspeed_ext.format.test_manifest import FakeRun, expert_param


def test_a_scan_passes_over_hidden_and_badly_named_folders(tmp_path):
    # ".trash" sorts first: passing it over must not end the scan; " x" is no tag.
    for name in (".trash", " x", "global_step1"):
        os.mkdir(tmp_path / name)
    scan = scan_checkpoints(str(tmp_path))
    assert (scan.complete, scan.corrupt, scan.incomplete) == ([], [], ["global_step1"])


def test_a_one_part_expert_resolves_each_part_to_its_own_checkpoint(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2, scope="w")
    run.save("global_step20", 20, 2, [(0, 0)], scope="w")
    res = resolve_checkpoint(str(tmp_path), "global_step20")
    assert res.problems == []
    # Expert 0/1's weights (fp32) were last saved at step 10, its moments at step 20.
    name = expert_param(0, 1, "w1")
    assert res.tensors[f"{name}|fp32"].tag == "global_step10"
    assert res.tensors[f"{name}|exp_avg"].tag == "global_step20"
