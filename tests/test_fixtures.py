"""The fixtures under tests/fixtures/ are what their records say, unchanged.

``megatron_deepspeed_moe/``: a checkpoint upstream Megatron-DeepSpeed's own code saved
(RECIPE.md there says how it was made), the fixture of issue 38's importer. Every file
matches ``SHA256SUMS`` (an importer's test compares against upstream's numbers, which a
changed byte would silently break), and the expert files hold what RECIPE.md lists, read
without running pickled code (``weights_only=True``).
"""

import hashlib
import os
import re

import pytest
import torch

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                       "megatron_deepspeed_moe")
STEP = os.path.join(FIXTURE, "checkpoint", "global_step6")


def _sums():
    with open(os.path.join(FIXTURE, "SHA256SUMS")) as f:
        return [line.split(None, 1) for line in f.read().splitlines() if line.strip()]


def test_every_fixture_file_is_listed_and_matches_its_checksum():
    listed = {os.path.normpath(name.strip()): digest for digest, name in _sums()}
    on_disk = {os.path.relpath(os.path.join(d, f), FIXTURE)
               for d, _, files in os.walk(FIXTURE) for f in files} - {"SHA256SUMS", "RECIPE.md"}
    assert set(listed) == on_disk
    for name, digest in listed.items():
        with open(os.path.join(FIXTURE, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name


@pytest.mark.parametrize("moe_layer, layer", [(0, 1), (1, 3)])
def test_upstream_expert_files_are_flat_and_named_by_global_expert(moe_layer, layer):
    for expert in range(4):
        path = os.path.join(STEP, f"layer_{moe_layer}_expert_{expert}_mp_rank_00_model_states.pt")
        state = torch.load(path, map_location="cpu", weights_only=True)
        prefix = (f"language_model.encoder.layers.{layer}.mlp.deepspeed_moe.experts."
                  f"deepspeed_experts.{expert}.")
        assert {k: tuple(v.shape) for k, v in state.items()} == {
            prefix + "dense_h_to_4h.weight": (128, 64), prefix + "dense_h_to_4h.bias": (128,),
            prefix + "dense_4h_to_h.weight": (64, 128), prefix + "dense_4h_to_h.bias": (64,)}


def test_the_dense_file_needs_an_allow_list_to_load_without_pickled_code():
    """Its stored ``args`` reference megatron's ``ModelType`` (and an ``argparse.Namespace``
    and numpy's RNG state): a ``weights_only`` load with torch's own allow-list refuses it,
    and loads it once those globals are allowed. An importer allow-lists those few
    globals, never unpickles. importing ``megatron.core`` allows them for the whole
    process (its ``safe_globals.register_safe_globals``), which another test of the same
    worker may have done: the allow-list is emptied here and put back after."""
    import argparse
    import numpy
    from megatron.core.enums import ModelType
    dense = os.path.join(STEP, "mp_rank_00_model_states.pt")
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(Exception, match=re.escape("weights_only")):
            torch.load(dense, map_location="cpu", weights_only=True)
        allowed = [argparse.Namespace, ModelType, numpy.ndarray, numpy.dtype,
                   numpy.dtypes.UInt32DType, numpy._core.multiarray._reconstruct]
        with torch.serialization.safe_globals(allowed):
            state = torch.load(dense, map_location="cpu", weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert state["iteration"] == 6 and state["args"].num_experts == [4]


def test_the_recorded_losses_are_upstream_s_logged_ones():
    """Iteration 7, the first after the checkpoint, is what an import must reproduce."""
    with open(os.path.join(FIXTURE, "logs", "run_B_train10_nosave.losses.txt")) as f:
        losses = dict(re.findall(r"iteration +(\d+)/ +10 .*? lm loss: ([0-9.E+-]+)", f.read()))
    assert len(losses) == 10 and losses["7"] == "5.313589E+00"
    with open(os.path.join(FIXTURE, "RECIPE.md")) as f:
        assert "| 7 | 5.313589E+00 |" in f.read()
