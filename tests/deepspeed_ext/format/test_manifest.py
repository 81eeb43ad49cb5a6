"""Manifest, expert index, latest, verification and retention (deepspeed_ext.format.manifest).

:class:`FakeRun` (also used by test_reader and test_cli) saves small checkpoints of a
fake 2-MoE-layer x 4-expert model through the public API the way the multi-rank
orchestration does, in one process: uneven fragments spread over several rank files,
later checkpoints holding only some experts.
"""

import json
import os
import random
import shutil
import time
import zlib
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import pytest
import torch

from deepspeed_ext.format.naming import ITERATION_FILE
from deepspeed_ext.format import expert_index
from deepspeed_ext.format import manifest as mf
from deepspeed_ext.format import naming
from deepspeed_ext.format.assemble import FragmentSpec, RankReport, assemble_manifest
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.expert_index import build_expert_index
from deepspeed_ext.format.manifest import FileEntry, Manifest, read_manifest, write_manifest
from deepspeed_ext.format.naming import (check_tag, expert_key, fragment_key, rank_file_name,
                                         split_tensor_key)
from deepspeed_ext.format.objects import OBJECTS_FILE, encode, write_objects_file
from deepspeed_ext.format.storage import atomic_write_json, write_fragment_file
from deepspeed_ext.store import catalog, latest, locking, retention
from deepspeed_ext.store.catalog import list_checkpoints, referenced_tags, scan_checkpoints
from deepspeed_ext.store.latest import read_latest, update_latest
from deepspeed_ext.store.prepare import prepare_checkpoint_dir, set_aside_checkpoints_after
from deepspeed_ext.store.retention import apply_retention, remove_checkpoint
from deepspeed_ext.store.verify import verify_checkpoint
from tests.launch import fresh_python

LAYERS, EXPERTS = 2, 4
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
NON_EXPERT = {"embed.weight": (10, 6), "final_norm.weight": (7,)}
EXPERT_PARAMS = {"w1": (3, 5), "b1": (4,)}
ALL_EXPERTS = [(l, e) for l in range(LAYERS) for e in range(EXPERTS)]


def expert_param(layer: int, expert: int, param: str) -> str:
    return f"layers.{2 * layer + 1}.mlp.experts.{expert}.{param}"


def value(name: str, kind: str, step: int, shape) -> torch.Tensor:
    """The deterministic content of a tensor as saved at ``step``."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}|{kind}|{step}".encode()))
    return torch.randn(shape, generator=gen)


class FakeRun:
    """Saves checkpoints into ``save_dir`` and remembers what a load must return."""

    def __init__(self, save_dir, seed: int = 0):
        self.save_dir = str(save_dir)
        self.rng = random.Random(seed)
        self.previous: Optional[Manifest] = None
        self.truth: Dict[Tuple[str, str], torch.Tensor] = {}
        self.objects = {}

    def tensors_to_save(self, experts, scope="wo") -> Iterable:
        """``(name, shape, expert, kinds)``: PEC's ``experts`` whole; with a one-part
        ``scope`` the other part of every other expert too."""
        for name, shape in NON_EXPERT.items():
            yield name, shape, None, KINDS
        always = {"wo": (), "w": KINDS[1:], "o": KINDS[:1]}[scope]
        for layer, expert in ALL_EXPERTS:
            kinds = KINDS if (layer, expert) in set(experts) else always
            for param, shape in EXPERT_PARAMS.items():
                if kinds:
                    yield expert_param(layer, expert, param), shape, (layer, expert), kinds

    def save(self, tag: str, step: int, world_size: int, experts=ALL_EXPERTS,
             scope: str = "wo") -> Manifest:
        tag_dir = prepare_checkpoint_dir(self.save_dir, tag)
        per_rank = [dict() for _ in range(world_size)]
        specs = [[] for _ in range(world_size)]
        saved = {}
        for name, shape, expert, kinds in self.tensors_to_save(experts, scope):
            for kind in kinds:
                data = value(name, kind, step, shape)
                saved[(name, kind)] = data
                flat = data.reshape(-1)
                pieces = self.rng.randint(1, 4)
                cuts = sorted(self.rng.sample(range(1, flat.numel()), pieces - 1))
                for start, stop in zip([0] + cuts, cuts + [flat.numel()]):
                    rank = self.rng.randrange(world_size)
                    spec = FragmentSpec(name, kind, start, stop - start, tuple(shape),
                                        "float32", expert)
                    specs[rank].append(spec)
                    per_rank[rank][spec.key] = flat[start:stop]  # views of one buffer
        objects = {"iteration": step, "rng": {"python": random.getstate(),
                                               "numpy": np.random.get_state(),
                                               "torch": torch.get_rng_state()},
                   "scheduler": {"last_epoch": step, "lrs": (0.1, 0.01)}}
        tree, obj_tensors = encode(objects)
        per_rank[0].update(obj_tensors)
        reports = []
        for rank in range(world_size):
            record = write_fragment_file(os.path.join(tag_dir, rank_file_name(rank)),
                                         per_rank[rank])
            reports.append(RankReport.from_record(rank, rank_file_name(rank), record,
                                                  specs[rank]).to_json())
        obj_record = write_objects_file(tag_dir, tree, rank_file_name(0))
        # rank 0 from here on, with the gathered (plain-data) reports
        index = build_expert_index(self.previous, experts, step, tag, LAYERS, EXPERTS,
                                   scope=scope)
        manifest = assemble_manifest(
            tag, step, world_size,
            {"num_moe_layers": LAYERS, "num_experts": EXPERTS, "ep_size": 2, "zero_stage": 2},
            [RankReport.from_json(r) for r in reports], index,
            extra_files={OBJECTS_FILE: FileEntry.from_record(obj_record, rank=0)})
        write_manifest(tag_dir, manifest)
        update_latest(self.save_dir, tag)
        self.previous = manifest
        self.truth.update(saved)
        self.objects = objects
        return manifest


def three_checkpoints(save_dir) -> FakeRun:
    """step 10: every expert, 4 ranks; step 20: experts 0/1 and 1/3, 3 ranks;
    step 30: experts 0/2 and 1/3, 2 ranks."""
    run = FakeRun(save_dir)
    run.save("global_step10", 10, 4)
    run.save("global_step20", 20, 3, [(0, 1), (1, 3)])
    run.save("global_step30", 30, 2, [(0, 2), (1, 3)])
    return run


def rank_file(save_dir, tag, rank=0) -> str:
    return os.path.join(str(save_dir), tag, rank_file_name(rank))


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def edit_manifest(save_dir, tag, change) -> None:
    """Rewrite a manifest as raw JSON (bypassing write_manifest's validation), signed
    again: what a writer's bug would leave, not storage damage."""
    path = os.path.join(str(save_dir), tag, mf.MANIFEST_FILE)
    data = json.load(open(path))
    change(data)
    atomic_write_json(path, mf.sign_manifest(data))


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """fsync makes writes durable, which no test here can observe; on a disk shared with
    busy neighbours each call can take tens of ms, hundreds of them per test module.
    test_storage keeps the real one."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


# ------------------------------------------------------------------------------ tests

def test_names():
    assert fragment_key("a.b", "fp32", 12) == "a.b|fp32|12"
    assert split_tensor_key("a.b|exp_avg") == ("a.b", "exp_avg")
    assert expert_key(1, 3) == "1/3" and naming.parse_expert_key("1/3") == (1, 3)
    assert rank_file_name(3) == "rank00003.safetensors"
    with pytest.raises(ValueError):
        fragment_key("a|b", "fp32", 0)
    for bad in ("", "..", "../x", "a/b", ".hidden", "latest", " x"):
        with pytest.raises(ValueError):
            check_tag(bad)


def test_build_expert_index():
    with pytest.raises(ValueError, match="first checkpoint must hold every expert"):
        build_expert_index(None, [(0, 0)], 10, "t10", 1, 2)
    first = build_expert_index(None, [(0, 0), (0, 1)], 10, "t10", 1, 2)
    prev = Manifest(tag="t10", step=10, world_size=1, expert_index=first)
    index = build_expert_index(prev, [(0, 1)], 20, "t20", 1, 2)
    assert {k: (v.step, v.tag) for k, v in index.items()} == {"0/0": (10, "t10"),
                                                              "0/1": (20, "t20")}
    assert prev.expert_index["0/1"].tag == "t10"  # the previous index is not modified
    with pytest.raises(ValueError, match="outside"):
        build_expert_index(prev, [(0, 2)], 20, "t20", 1, 2)
    with pytest.raises(ValueError, match="after the new step"):
        build_expert_index(prev, [], 5, "t5", 1, 2)
    with pytest.raises(ValueError, match="different model"):
        build_expert_index(prev, [], 20, "t20", 1, 1)


@pytest.mark.parametrize("scope", ["w", "o"])
def test_one_part_scope_indexes_each_part_at_its_newest_version(tmp_path, scope):
    """The paper's W-only and O-only variants: the part PEC leaves out keeps its old
    version, the other part of every expert is new; a load assembles both, bitwise."""
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 4, scope=scope)
    run.save("global_step20", 20, 3, [(0, 1), (1, 3)], scope=scope)
    last = run.save("global_step30", 30, 2, [(0, 2), (1, 3)], scope=scope)
    partial, whole = ("w", "o") if scope == "w" else ("o", "w")
    expected = {(0, 1): 20, (1, 3): 30, (0, 2): 30}
    for (layer, expert), version in last.expert_versions().items():
        assert version.part(whole) == (30, "global_step30")
        step = expected.get((layer, expert), 10)
        assert version.part(partial) == (step, f"global_step{step}"), (layer, expert)
        assert version.oldest_step == step
    assert last.validate() == []
    assert Manifest.from_json(json.loads(json.dumps(last.to_json()))) == last
    assert expert_index.read_expert_versions(str(tmp_path / "global_step30"))[1][(0, 1)] == 20
    assert catalog.referenced_tags(str(tmp_path), "global_step30") == {
        "global_step10", "global_step20", "global_step30"}
    assert verify_checkpoint(str(tmp_path), "global_step30") == []
    from deepspeed_ext.store.reader import CheckpointReader
    with CheckpointReader(str(tmp_path)) as ckpt:
        for name, kind in ckpt.keys():
            assert torch.equal(ckpt.read_full(name, kind), run.truth[(name, kind)]), (name, kind)
        assert ckpt.expert_versions()[(0, 1)] == (20, "global_step20")
    # Deleting the checkpoint that holds only the older part of some experts is caught.
    shutil.rmtree(tmp_path / "global_step10")
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert any("points to 'global_step10'" in p for p in problems), problems


def test_one_part_index_that_contradicts_the_files_is_refused(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2, scope="w")
    run.save("global_step20", 20, 2, [(0, 0)], scope="w")

    def claim_weights_here(data):  # expert 0/1's weights are not in global_step20
        data["expert_index"]["0/1"] = {"step": 20, "tag": "global_step20"}
    edit_manifest(tmp_path, "global_step20", claim_weights_here)
    problems = verify_checkpoint(str(tmp_path), "global_step20")
    assert any("0/1" in p for p in problems), problems

    def send_held_optimizer_elsewhere(data):
        data["expert_index"]["0/1"] = {"step": 10, "tag": "global_step10"}
    edit_manifest(tmp_path, "global_step20", send_held_optimizer_elsewhere)
    problems = verify_checkpoint(str(tmp_path), "global_step20")
    assert any("holds expert 0/1 (optimizer state)" in p for p in problems), problems


def test_version_1_manifests_still_load(tmp_path):
    three_checkpoints(tmp_path)
    edit_manifest(tmp_path, "global_step30", lambda d: d.update(version=1))
    assert read_manifest(str(tmp_path / "global_step30")).version == 1
    assert verify_checkpoint(str(tmp_path), "global_step30") == []


def test_build_expert_index_scopes():
    first = build_expert_index(None, [(0, 0), (0, 1)], 10, "t10", 1, 2, scope="w")
    prev = Manifest(tag="t10", step=10, world_size=1, expert_index=first)
    w = build_expert_index(prev, [(0, 1)], 20, "t20", 1, 2, scope="w")
    assert w["0/0"].part("w") == (10, "t10") and w["0/0"].part("o") == (20, "t20")
    assert w["0/0"].to_json() == {"step": 10, "tag": "t10",
                                  "optim": {"step": 20, "tag": "t20"}}
    assert w["0/1"].to_json() == {"step": 20, "tag": "t20"}
    o = build_expert_index(prev, [(0, 1)], 20, "t20", 1, 2, scope="o")
    assert o["0/0"].part("w") == (20, "t20") and o["0/0"].part("o") == (10, "t10")
    # Switching scope on a restart starts from the per-part record as it is.
    prev_w = Manifest(tag="t20", step=20, world_size=1, expert_index=w)
    mixed = build_expert_index(prev_w, [], 30, "t30", 1, 2, scope="o")
    assert mixed["0/0"].part("w") == (30, "t30") and mixed["0/0"].part("o") == (20, "t20")
    with pytest.raises(ValueError, match="--moc-pec-scope"):
        build_expert_index(prev, [], 20, "t20", 1, 2, scope="x")
    with pytest.raises(ValueError, match="first checkpoint must hold every expert"):
        build_expert_index(None, [(0, 0)], 10, "t10", 1, 2, scope="o")


def test_manifest_json_round_trip(tmp_path):
    run = FakeRun(tmp_path)
    manifest = run.save("global_step10", 10, 3)
    assert read_manifest(str(tmp_path / "global_step10")) == manifest
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    assert manifest.held_experts() == set(ALL_EXPERTS)
    # the uneven split really produced several fragments in several files
    frags = manifest.tensors["embed.weight|fp32"].fragments
    assert [f.offset for f in frags] == sorted(f.offset for f in frags)
    assert len({f.file for e in manifest.tensors.values() for f in e.fragments}) == 3


def test_read_manifest_errors_name_the_file(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    tag_dir = str(tmp_path / "global_step10")
    path = os.path.join(tag_dir, mf.MANIFEST_FILE)
    good = open(path).read()
    with pytest.raises(CheckpointError, match="missing"):
        read_manifest(str(tmp_path / "nope"))
    for text, message in [("{not json", "unreadable"),
                          (good.replace('"moc-ckpt"', '"other"'), "not a MoC checkpoint"),
                          (good.replace('"version": 2', '"version": 7'), "version 7"),
                          (good.replace('"step": 10', '"step": "10"'), r"\.step: expected int"),
                          (good.replace('"tag": "global_step10"', '"tag": "elsewhere"'),
                           "renamed")]:
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(CheckpointError, match=message) as err:
            read_manifest(tag_dir)
        assert path in str(err.value)


def test_a_damaged_manifest_that_still_parses_fails_its_own_checksum(tmp_path):
    """Every other file's checksum is in the manifest; its own covers a flipped digit
    that still parses (an offset, a step), which would otherwise load the wrong bytes.
    Manifests written before the checksum existed are read unchecked."""
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    tag_dir = str(tmp_path / "global_step10")
    path = os.path.join(tag_dir, mf.MANIFEST_FILE)
    data = json.load(open(path))
    assert data[mf.MANIFEST_CHECKSUM] == mf.sign_manifest(data)[mf.MANIFEST_CHECKSUM]
    frag = next(iter(data["tensors"].values()))["fragments"][0]
    damaged = dict(data, tensors=json.loads(json.dumps(data["tensors"])))
    next(iter(damaged["tensors"].values()))["fragments"][0]["offset"] = frag["offset"] + 1
    with open(path, "w") as f:
        json.dump(damaged, f)
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        read_manifest(tag_dir)
    assert path in str(err.value)
    del damaged[mf.MANIFEST_CHECKSUM]  # an older manifest: no checksum, read as before
    with open(path, "w") as f:
        json.dump(damaged, f)
    assert read_manifest(tag_dir).step == 10


def test_assemble_manifest_refuses_bad_plans():
    spec = lambda off, n, shape=(10,): FragmentSpec("w", "fp32", off, n, shape, "float32")
    index = {}
    ok = assemble_manifest("t", 1, 2, {}, [RankReport(0, "a", 1, "x", [spec(0, 4)]),
                                           RankReport(1, "b", 1, "y", [spec(4, 6)])], index)
    assert [f.file for f in ok.tensors["w|fp32"].fragments] == ["a", "b"]
    with pytest.raises(ValueError, match=r"\[4, 10\) are in no fragment"):
        assemble_manifest("t", 1, 1, {}, [RankReport(0, "a", 1, "x", [spec(0, 4)])], index)
    with pytest.raises(ValueError, match="overlap"):
        assemble_manifest("t", 1, 2, {}, [RankReport(0, "a", 1, "x", [spec(0, 6)]),
                                          RankReport(1, "b", 1, "y", [spec(4, 6)])], index)
    with pytest.raises(ValueError, match="describes it as"):
        assemble_manifest("t", 1, 2, {}, [RankReport(0, "a", 1, "x", [spec(0, 4)]),
                                          RankReport(1, "b", 1, "y", [spec(4, 6, (2, 5))])],
                          index)
    expert_spec = FragmentSpec("e", "fp32", 0, 2, (2,), "float32", (0, 0))
    with pytest.raises(ValueError, match="holds expert 0/0"):
        assemble_manifest("t", 1, 1, {}, [RankReport(0, "a", 1, "x", [expert_spec])], {})


def test_latest_and_listing(tmp_path):
    assert read_latest(str(tmp_path)) is None
    assert list_checkpoints(str(tmp_path)) == []
    run = three_checkpoints(tmp_path)
    assert read_latest(str(tmp_path)) == "global_step30"
    (tmp_path / "global_step40").mkdir()  # a save in progress
    (tmp_path / "global_step5").mkdir()
    assert list_checkpoints(str(tmp_path)) == [(10, "global_step10"), (20, "global_step20"),
                                               (30, "global_step30")]
    assert sorted(scan_checkpoints(str(tmp_path)).incomplete) == ["global_step40",
                                                                  "global_step5"]
    with pytest.raises(ValueError, match="no manifest.json"):
        update_latest(str(tmp_path), "global_step40")
    assert read_latest(str(tmp_path)) == "global_step30"
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="latest"):
        read_latest(str(tmp_path))
    assert run.previous.tag == "global_step30"


def test_three_checkpoints_verify_clean(tmp_path):
    three_checkpoints(tmp_path)
    for _, tag in list_checkpoints(str(tmp_path)):
        assert verify_checkpoint(str(tmp_path), tag) == []
    index = read_manifest(str(tmp_path / "global_step30")).expert_index
    assert {k: v.step for k, v in index.items()} == {
        "0/0": 10, "0/1": 20, "0/2": 30, "0/3": 10, "1/0": 10, "1/1": 10, "1/2": 10, "1/3": 30}


def test_verify_catches_truncated_file(tmp_path):
    three_checkpoints(tmp_path)
    path = rank_file(tmp_path, "global_step30", 1)
    os.truncate(path, os.path.getsize(path) - 5)
    problems = verify_checkpoint(str(tmp_path), "global_step30", checksums=False)
    assert any(path in p and "truncated" in p for p in problems)


def test_verify_catches_flipped_byte(tmp_path):
    three_checkpoints(tmp_path)
    path = rank_file(tmp_path, "global_step10", 2)  # an old file an expert resolves to
    flip_last_byte(path)
    assert verify_checkpoint(str(tmp_path), "global_step30", checksums=False) == []
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert len(problems) == 1 and path in problems[0] and "checksum" in problems[0]


def test_verify_catches_missing_manifest(tmp_path):
    three_checkpoints(tmp_path)
    os.remove(tmp_path / "global_step20" / mf.MANIFEST_FILE)
    problems = verify_checkpoint(str(tmp_path), "global_step20")
    assert len(problems) == 1 and "global_step20" in problems[0] and "missing" in problems[0]
    # and global_step30's index names global_step20 for expert 0/1
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert any("expert_index['0/1']" in p and "global_step20" in p for p in problems)


def test_verify_catches_coverage_gap(tmp_path):
    three_checkpoints(tmp_path)

    def drop_fragment(data):
        data["tensors"]["embed.weight|exp_avg"]["fragments"].pop()

    edit_manifest(tmp_path, "global_step30", drop_fragment)
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert any("embed.weight|exp_avg" in p and "gap" in p for p in problems)


def test_verify_catches_overlap_in_an_older_checkpoint(tmp_path):
    three_checkpoints(tmp_path)
    name = expert_param(0, 0, "w1")

    def overlap(data):
        frag = dict(data["tensors"][f"{name}|fp32"]["fragments"][-1])
        data["tensors"][f"{name}|fp32"]["fragments"].append(frag)

    edit_manifest(tmp_path, "global_step10", overlap)
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert any(name in p and "overlap" in p and "global_step10" in p for p in problems)


def test_verify_catches_index_to_deleted_checkpoint(tmp_path):
    three_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / "global_step10")
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    # experts 0/0, 0/3, 1/0, 1/1, 1/2 have their newest version only there
    assert sum("points to 'global_step10'" in p for p in problems) == 5


def test_verify_catches_index_to_checkpoint_without_the_expert(tmp_path):
    three_checkpoints(tmp_path)
    edit_manifest(tmp_path, "global_step30",
                  lambda d: d["expert_index"].update({"0/0": {"step": 20,
                                                              "tag": "global_step20"}}))
    problems = verify_checkpoint(str(tmp_path), "global_step30")
    assert any("'0/0'" in p and "holds no tensor of expert 0/0" in p for p in problems)


def test_verify_catches_fragment_missing_from_its_file(tmp_path):
    three_checkpoints(tmp_path)

    def rename_key(data):
        frag = data["tensors"]["final_norm.weight|fp32"]["fragments"][0]
        frag["key"] = frag["key"] + "0"
        frag["offset"] = int(frag["offset"]) * 10

    edit_manifest(tmp_path, "global_step20", rename_key)
    problems = verify_checkpoint(str(tmp_path), "global_step20", checksums=False)
    assert any("lacks fragment" in p and "final_norm.weight" in p for p in problems)


def test_referenced_tags(tmp_path):
    three_checkpoints(tmp_path)
    assert referenced_tags(str(tmp_path), "global_step30") == {
        "global_step10", "global_step20", "global_step30"}
    assert referenced_tags(str(tmp_path), "global_step10") == {"global_step10"}


def _age(path, seconds=3600):
    old = time.time() - seconds
    for root, _, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(root, name), (old, old))
    os.utime(path, (old, old))


def test_retention_keeps_referenced_checkpoints(tmp_path):
    run = three_checkpoints(tmp_path)
    assert apply_retention(str(tmp_path), keep=1) == []  # 30 needs 10 and 20
    # step 40 saves every expert global_step10 and global_step20 held newest versions of
    run.save("global_step40", 40, 2, [(0, 0), (0, 1), (0, 3), (1, 0), (1, 1), (1, 2)])
    assert apply_retention(str(tmp_path), keep=1) == ["global_step10", "global_step20"]
    assert [t for _, t in list_checkpoints(str(tmp_path))] == ["global_step30",
                                                                "global_step40"]
    assert verify_checkpoint(str(tmp_path), "global_step40") == []
    assert not any(n.startswith(retention.TRASH_PREFIX) for n in os.listdir(tmp_path))


def test_retention_removes_stale_partial_saves_only(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    stale = tmp_path / "global_step15"
    stale.mkdir()
    (stale / "rank00001.safetensors").write_bytes(b"partial")
    (stale / "rank00000.safetensors.tmp.123").write_bytes(b"partial")
    _age(stale)
    foreign = tmp_path / "tensorboard"
    foreign.mkdir()
    (foreign / "events.out").write_bytes(b"x")
    _age(foreign)
    run.save("global_step20", 20, 2)
    in_progress = tmp_path / "global_step30"
    in_progress.mkdir()
    (in_progress / "rank00000.safetensors").write_bytes(b"being written")
    os.utime(in_progress / "rank00000.safetensors", (time.time() + 5, time.time() + 5))
    (tmp_path / f"{retention.TRASH_PREFIX}global_step3.99").mkdir()
    deleted = apply_retention(str(tmp_path), keep=2)
    assert deleted == ["global_step15"]
    assert sorted(os.listdir(tmp_path)) == [locking.LOCK_FILE, "global_step10", "global_step20",
                                            "global_step30", "latest", ITERATION_FILE,
                                            "tensorboard"]


def test_interrupted_deletion_is_incomplete_then_cleaned(tmp_path, monkeypatch):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2)

    def crash(*args):
        raise OSError("killed")

    with monkeypatch.context() as m:
        m.setattr(retention.os, "rename", crash)
        with pytest.raises(OSError, match="killed"):
            remove_checkpoint(str(tmp_path), "global_step10")
    # half-deleted: never listed or loaded as complete
    assert list_checkpoints(str(tmp_path)) == [(20, "global_step20")]
    assert "missing" in verify_checkpoint(str(tmp_path), "global_step10")[0]
    _age(tmp_path / "global_step10")
    assert apply_retention(str(tmp_path), keep=1) == ["global_step10"]
    assert not (tmp_path / "global_step10").exists()


def test_prepare_checkpoint_dir(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    with pytest.raises(FileExistsError, match="complete checkpoint"):
        prepare_checkpoint_dir(str(tmp_path), "global_step10")
    partial = tmp_path / "global_step20"
    partial.mkdir()
    (partial / "rank00007.safetensors").write_bytes(b"from a bigger run")
    (partial / "objects.safetensors").write_bytes(b"a crashed save's objects")  # MoC's too
    assert prepare_checkpoint_dir(str(tmp_path), "global_step20") == str(partial)
    assert os.listdir(partial) == ["commit.claim"]  # emptied, then claimed for this save
    (partial / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="did not write"):
        prepare_checkpoint_dir(str(tmp_path), "global_step20")
    prepare_checkpoint_dir(str(tmp_path), "global_step10", overwrite=True)
    assert os.listdir(tmp_path / "global_step10") == ["commit.claim"]


def _set_aside_tags(tmp_path):
    return sorted(n.split(".")[2] for n in os.listdir(tmp_path) if n.startswith(".moc-set-aside."))


def test_set_aside_abandoned_timeline(tmp_path):
    run = three_checkpoints(tmp_path)  # FakeRun's manifests record no attempt: earlier ones
    # resumed from global_step10: 20 and 30 are another history
    assert set_aside_checkpoints_after(str(tmp_path), 11, attempt_started=1e12,
                                       keep="global_step10") == ["global_step30", "global_step20"]
    assert list_checkpoints(str(tmp_path)) == [(10, "global_step10")]
    assert read_latest(str(tmp_path)) == "global_step10"
    assert _set_aside_tags(tmp_path) == ["global_step20", "global_step30"]  # kept for a human
    assert verify_checkpoint(str(tmp_path), "global_step10") == []
    run.previous = read_manifest(str(tmp_path / "global_step10"))
    run.save("global_step20", 20, 2, [(1, 1)])  # the same step again, no collision
    assert verify_checkpoint(str(tmp_path), "global_step20") == []
    apply_retention(str(tmp_path), keep=1)
    assert _set_aside_tags(tmp_path) == ["global_step20", "global_step30"]  # never deleted


def test_a_new_run_setting_aside_every_checkpoint_leaves_no_latest_naming_one(tmp_path):
    """A new run saving into another run's directory sets aside all of its checkpoints:
    `latest` must not keep naming one of them, or a restart before the new run's first
    commit finds nothing loadable instead of starting afresh."""
    from deepspeed_ext.store.reader import find_loadable
    three_checkpoints(tmp_path)
    assert read_latest(str(tmp_path)) == "global_step30"
    assert len(set_aside_checkpoints_after(str(tmp_path), 5, attempt_started=1e12)) == 3
    assert read_latest(str(tmp_path)) is None
    assert find_loadable(str(tmp_path)) == (None, [])  # a fresh start, not an error


def test_prepare_sets_aside_an_earlier_attempts_checkpoint_of_the_same_tag(tmp_path):
    """A complete checkpoint of the tag being saved, committed late by an earlier attempt
    (an abandoned timeline), is set aside; this attempt's own, a later attempt's, and the
    one this run resumed from are refused as before."""
    save_dir = str(tmp_path)
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2)
    manifest = read_manifest(str(tmp_path / "global_step20"))
    manifest.extra["attempt_started"] = 200.0
    write_manifest(str(tmp_path / "global_step20"), manifest)
    for ours in (200.0, 150.0):  # its own attempt, and an attempt older than it
        with pytest.raises(FileExistsError, match="complete checkpoint"):
            prepare_checkpoint_dir(save_dir, "global_step20", attempt_started=ours)
    with pytest.raises(FileExistsError, match="complete checkpoint"):  # resumed from it
        prepare_checkpoint_dir(save_dir, "global_step10", attempt_started=300.0,
                               keep="global_step10")
    prepare_checkpoint_dir(save_dir, "global_step20", attempt_started=300.0)
    assert os.listdir(tmp_path / "global_step20") == ["commit.claim"]
    assert _set_aside_tags(tmp_path) == ["global_step20"]
    # 10 records no attempt (an older MoC): earlier than any
    assert set_aside_checkpoints_after(save_dir, 5, attempt_started=300.0) == ["global_step10"]




def test_locked_dir_locks_a_writable_file_and_excludes_other_processes(tmp_path):
    """A POSIX lock on ``.moc-lock`` (NFS refuses a lock on a directory's read-only
    descriptor, and the old flock then went unlocked without a word): a second process
    waits until the first leaves the block."""
    import subprocess
    import sys
    import time
    script = ("import sys, time\n"
              "from deepspeed_ext.store.locking import locked_dir\n"
              "print('ready', flush=True)\n"
              "with locked_dir(sys.argv[1]):\n"
              "    print(time.time(), flush=True)\n")
    with locking.locked_dir(str(tmp_path)):
        assert (tmp_path / locking.LOCK_FILE).is_file()
        child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"  # imported: now at the lock
        time.sleep(1.0)
        assert child.poll() is None  # blocked on the lock
        released = time.time()
    acquired = float(child.communicate(timeout=60)[0])
    assert acquired >= released
    assert catalog.scan_checkpoints(str(tmp_path)).complete == []  # the lock file is no checkpoint


# ------------------------------------------------- untrusted manifests (issue 20, 4/5)

def test_validate_costs_what_the_file_lists_not_what_its_layout_declares(tmp_path, monkeypatch):
    """A crafted layout declaring 10^9 MoE layers x 10^9 experts made validate() build
    every expert key of the product: hours of CPU and all memory, at every restart,
    instead of skipping the checkpoint. The missing experts are counted from the keys
    the file lists; at most a handful more are named."""
    run = FakeRun(tmp_path)
    manifest = run.save("global_step10", 10, 2)
    calls = []
    real = naming.expert_key

    def counted(layer, expert):
        calls.append(1)
        if len(calls) > 10_000:
            raise AssertionError("validate() iterates over the declared layers x experts")
        return real(layer, expert)
    monkeypatch.setattr(mf, "expert_key", counted)
    manifest.layout.update(num_moe_layers=10 ** 9, num_experts=10 ** 9)
    problems = manifest.validate()
    assert any(f"lacks {10 ** 18 - LAYERS * EXPERTS} of {10 ** 18} experts" in p
               and "first: 0/4" in p for p in problems), problems
    assert len(calls) <= 4 * len(manifest.expert_index) + 5  # what the file lists
    # The same through a load: the checkpoint is skipped (with its reason), fast.
    edit_manifest(tmp_path, "global_step10",
                  lambda d: d["layout"].update(num_moe_layers=10 ** 9, num_experts=10 ** 9))
    problems = verify_checkpoint(str(tmp_path), "global_step10", checksums=False)
    assert any("lacks" in p for p in problems), problems


@pytest.mark.parametrize("layers, experts", [("2", 4), (2, [4]), (True, 4), (-1, 4), (2, 4.0)])
def test_declared_expert_counts_of_the_wrong_type_are_problems(tmp_path, layers, experts):
    """num_moe_layers/num_experts decide the completeness check: a string, list, bool,
    float or negative count is a damaged manifest, not a count to skip silently."""
    run = FakeRun(tmp_path)
    manifest = run.save("global_step10", 10, 2)
    manifest.layout.update(num_moe_layers=layers, num_experts=experts)
    assert any("num_moe_layers" in p and "num_experts" in p for p in manifest.validate())


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_json_in_a_manifest_is_a_checkpoint_error(tmp_path):
    """``[[[[...]]]]`` 100000 deep raised RecursionError out of read_manifest, and so out
    of `moc-ckpt inspect`/`verify` and a restart's load, instead of skipping that
    checkpoint. Nesting that parses at the reader's depth but not deeper in a load's
    stack (inside the free-form ``extra``) is refused the same way."""
    from deepspeed_ext.store.reader import find_loadable
    three_checkpoints(tmp_path)
    tag_dir = str(tmp_path / "global_step30")
    path = os.path.join(tag_dir, mf.MANIFEST_FILE)
    good = open(path).read()
    with open(path, "w") as f:
        f.write(_nested(100_000))
    for call in (lambda: read_manifest(tag_dir), lambda: expert_index.read_expert_versions(tag_dir)):
        with pytest.raises(CheckpointError, match="nested") as err:
            call()
        assert path in str(err.value)
    assert verify_checkpoint(str(tmp_path), "global_step30")[0].startswith(path)
    assert scan_checkpoints(str(tmp_path)).corrupt[0][0] == "global_step30"
    update_latest(str(tmp_path), "global_step20")
    tag, skipped = find_loadable(str(tmp_path), checksums=False)
    assert tag == "global_step20" and any("global_step30" in s for s in skipped)
    data = json.loads(good)
    data["extra"]["deep"] = json.loads(_nested(900))
    with open(path, "w") as f:
        json.dump(mf.sign_manifest(data), f)
    with pytest.raises(CheckpointError, match="nested"):
        read_manifest(tag_dir)


def test_every_json_file_read_has_a_size_cap(tmp_path, monkeypatch):
    """A manifest, ``latest`` or attempt record of any size was read whole into memory
    (``latest`` linked to /dev/zero: forever). Each kind has its cap; past it the file
    is a checkpoint error naming it (the attempt record: unreadable, so ignored)."""
    three_checkpoints(tmp_path)
    tag_dir = str(tmp_path / "global_step30")
    size = os.path.getsize(os.path.join(tag_dir, mf.MANIFEST_FILE))
    monkeypatch.setattr(mf, "MANIFEST_MAX_BYTES", size - 1)
    for call in (lambda: read_manifest(tag_dir), lambda: expert_index.read_expert_versions(tag_dir)):
        with pytest.raises(CheckpointError, match=f"larger than {size - 1} bytes"):
            call()
    monkeypatch.setattr(mf, "MANIFEST_MAX_BYTES", size)
    assert read_manifest(tag_dir).step == 30
    latest_path = tmp_path / naming.LATEST_FILE
    latest_path.write_text("global_step" + "3" * latest.LATEST_MAX_BYTES)
    with pytest.raises(CheckpointError, match="latest: larger than"):
        read_latest(str(tmp_path))
    (tmp_path / latest.ATTEMPT_FILE).write_text(
        '{"attempt_started": 1e9, "pad": "' + " " * latest.ATTEMPT_MAX_BYTES + '"}')
    assert not latest.later_attempt_started(str(tmp_path), 1.0)
    (tmp_path / latest.ATTEMPT_FILE).write_text(_nested(100_000))
    assert not latest.later_attempt_started(str(tmp_path), 1.0)


def test_latest_linked_to_dev_zero_is_refused_not_read_forever(tmp_path):
    """The load used to read ``latest`` until memory ran out. Run in a child with a
    memory limit and a deadline, so that the old code fails instead of taking the
    machine down."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero")
    os.symlink("/dev/zero", tmp_path / naming.LATEST_FILE)
    out = fresh_python("import sys\nfrom deepspeed_ext.format.errors import CheckpointError\n"
                       "from deepspeed_ext.store.latest import read_latest\n"
                       "try:\n"
                       "    read_latest(sys.argv[1])\n"
                       "except CheckpointError as err:\n"
                       "    print('refused:', err)\n", args=[str(tmp_path)], memory_limit=4 << 30)
    assert len(out) == 1 and out[0].startswith("refused:") and "latest: larger than" in out[0]


def test_a_file_name_with_a_nul_is_a_problem_not_a_stray_error(tmp_path):
    """A manifest listing a file named with a NUL made os.stat raise ValueError out of
    verify_checkpoint and the restart's search, instead of skipping that checkpoint."""
    from deepspeed_ext.store.reader import find_loadable
    three_checkpoints(tmp_path)

    def rename(data):
        data["files"]["rank\x0000.safetensors"] = data["files"].pop(rank_file_name(0))
    edit_manifest(tmp_path, "global_step30", rename)
    problems = verify_checkpoint(str(tmp_path), "global_step30", checksums=False)
    assert any("not a plain file name" in p for p in problems), problems
    tag, skipped = find_loadable(str(tmp_path), checksums=False)
    assert tag == "global_step20" and "global_step30" in skipped[0]


@pytest.mark.parametrize("how", ["set aside", "overwrite"])
def test_preparing_a_save_over_the_checkpoint_latest_names_moves_latest_first(tmp_path, how):
    """An earlier attempt's committer finished late and pointed ``latest`` at its
    global_step20; this attempt, resumed from global_step10, saves step 20 again. Setting
    the old one aside (or overwriting it) left ``latest`` naming a tag without a manifest
    until the new save committed: a kill in between, and the restart had no ``latest``
    to load. ``latest`` now moves to the checkpoint this run resumed from first."""
    save_dir = str(tmp_path)
    run = FakeRun(tmp_path)
    run.save("global_step5", 5, 2)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2)  # FakeRun records no attempt: an earlier one's
    latest.update_latest(save_dir, "global_step20")
    if how == "overwrite":
        prepare_checkpoint_dir(save_dir, "global_step20", overwrite=True, keep="global_step10")
    else:
        prepare_checkpoint_dir(save_dir, "global_step20", attempt_started=300.0,
                               keep="global_step10")
        assert _set_aside_tags(tmp_path) == ["global_step20"]
    assert read_latest(save_dir) == "global_step10"
    assert os.path.isfile(tmp_path / "global_step10" / mf.MANIFEST_FILE)
    # Without a checkpoint this run resumed from: the newest one that stays.
    latest.update_latest(save_dir, "global_step10")
    prepare_checkpoint_dir(save_dir, "global_step10", overwrite=True)
    assert read_latest(save_dir) == "global_step5"


# Exact covers in any order: none. One element off at either end, overlapping or past the
# end by one, an empty or a negative fragment: each a problem.
@pytest.mark.parametrize("spans, numel, problems", [
    (((3, 4), (0, 3)), 7, []), (((0, 1),), 1, []), ((), 0, []),
    (((0, 3), (3, 3)), 7, ["[6, 7) are in no fragment"]), (((1, 6),), 7, ["[0, 1) are in no"]),
    (((0, 4), (3, 4)), 7, ["[3, 4) are in more than one"]), (((0, 7),), 6, ["element 7, past"]),
    (((0, 7), (7, 0)), 7, ["offset 7 length 0"]), (((-1, 8),), 7, ["offset -1", "[0, 7) are"]),
])
def test_coverage_problems_of_fragments_one_element_off(spans, numel, problems):
    got = mf.coverage_problems([mf.Fragment("r", f"w@{o}", o, n) for o, n in spans], numel)
    assert len(got) == len(problems) and all(p in g for p, g in zip(problems, got)), got
