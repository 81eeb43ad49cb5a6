"""Non-tensor state without pickle (deepspeed_ext.format.objects)."""

import collections
import json
import math
import pickle
import random

import numpy as np
import pytest
import torch

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.fragment_reader import FragmentReader
from deepspeed_ext.format.objects import (OBJECTS_FILE, decode, encode, read_objects_file,
                                          tensor_keys, write_objects_file)
from deepspeed_ext.format.storage import write_fragment_file


def _through_disk(tmp_path, obj):
    """encode -> safetensors + objects.json -> read back -> decode, as a checkpoint does."""
    tree, tensors = encode(obj)
    write_fragment_file(str(tmp_path / "rank00000.safetensors"), tensors)
    write_objects_file(str(tmp_path), tree, "rank00000.safetensors")
    loaded = read_objects_file(str(tmp_path))
    with FragmentReader(str(tmp_path / loaded.tensor_file)) as reader:
        back = {k: reader.read_tensor(k) for k in tensor_keys(loaded.tree)}
    return decode(loaded.tree, back)


def _same(a, b) -> bool:
    """Equality that also compares types, NaNs, -0.0, tensors and arrays exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a.detach(), b.detach()))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return a.hex() == b.hex() if not math.isnan(a) else math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (list(a.keys()) == list(b.keys())
                and all(type(k) is type(j) for k, j in zip(a, b))
                and all(_same(a[k], b[k]) for k in a))
    return a == b


def _sample():
    return {
        "iteration": 1200, "big": 2 ** 100, "neg": -7, "flag": True, "none": None,
        "floats": [0.1, -0.0, 1e-310, float("nan"), float("inf"), -float("inf")],
        "tuple": (1, "a", (2.5, None)), "list_of_tuple": [(1, 2), []],
        "int_keys": {1: "one", 2: {3: "three"}}, "mixed": {1: "int", "1": "str", None: 0, 2.5: "f",
                                                            (1, 2): "tuple", False: "bool"},
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "tag_collision": {"__moc__": "tuple", "items": [1]},
        "bytes": b"\x00\xffabc",
        "tensor": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(3), "empty": torch.zeros(0, 2),
        "grad": torch.ones(2, requires_grad=True),
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
        "arrays": [np.arange(6, dtype=np.uint32).reshape(2, 3), np.array(2.5, dtype=">f8"),
                   np.array(["ab", "c"]), np.zeros((0, 4), dtype=np.int16),
                   np.asfortranarray(np.arange(6.0).reshape(2, 3))],
        "np_scalars": [np.float32(1.5), np.float64(0.1), np.int64(-3), np.bool_(True),
                       np.uint8(255)],
    }


def test_round_trip_keeps_values_and_types(tmp_path):
    obj = _sample()
    assert _same(_through_disk(tmp_path, obj), obj)


def test_tree_is_plain_strict_json():
    tree, tensors = encode(_sample())
    text = json.dumps(tree, allow_nan=False)  # raises on NaN or a non-JSON type
    assert "tensor" in tree and json.loads(text) == tree
    assert all(k.startswith("obj/") for k in tensors)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())


def test_rng_states_restore_the_same_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "numpy_dict": np.random.get_state(legacy=False), "torch": torch.get_rng_state(),
             "generator": np.random.default_rng(5).bit_generator.state}
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    restored = _through_disk(tmp_path, state)
    random.setstate(restored["python"])
    np.random.set_state(restored["numpy"])
    torch.set_rng_state(restored["torch"])
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected
    np.random.set_state(restored["numpy_dict"])
    assert np.random.rand(3).tolist() == expected[1]
    bitgen = np.random.PCG64()
    bitgen.state = restored["generator"]  # 128-bit ints must survive JSON
    assert np.random.Generator(bitgen).random() == np.random.default_rng(5).random()


def test_unknown_types_name_their_path():
    with pytest.raises(TypeError, match=r"'a/1/b'"):
        encode({"a": [0, {"b": {1, 2}}]})
    point = collections.namedtuple("Point", "x y")
    with pytest.raises(TypeError, match="Point"):
        encode({"p": point(1, 2)})
    with pytest.raises(TypeError, match="'arr'"):
        encode({"arr": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="defaultdict"):
        encode(collections.defaultdict(int))


def test_cycle_is_refused():
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match="cycle"):
        encode({"loop": loop})


def test_nested_plain_lists_are_copies_and_others_take_the_general_path(tmp_path):
    # Lists of lists of plain values (the token ledger's histories) are copied whole;
    # one non-plain value anywhere inside must still be encoded (a tensor extracted, a
    # non-finite float spelled out, an unknown type named with its path).
    history = [[[1, 10], [2, 30]], [[1, 5]], []]
    tree, tensors = encode({"h": history})
    assert tree["h"] == history and tree["h"] is not history and tree["h"][0] is not history[0]
    assert not tensors
    mixed = [[[1, 2]], [[3, torch.ones(2)]], [[float("nan")]]]
    tree, tensors = encode({"m": mixed})
    assert list(tensors) == ["obj/m/1/0/1"]
    assert _same(_through_disk(tmp_path, {"m": mixed}), {"m": mixed})
    with pytest.raises(TypeError, match=r"'d/0/0/0/0/0'"):  # deeper than the fast path
        encode({"d": [[[[[{1}]]]]]})
    inner = []
    inner.append([inner])  # a cycle through a nested list
    with pytest.raises(ValueError, match="cycle"):
        encode({"loop": [inner]})


def test_colliding_paths_get_distinct_keys(tmp_path):
    obj = {1: torch.zeros(2), "1": torch.ones(2), "a/b": torch.full((2,), 2.0),
           "a": {"b": torch.full((2,), 3.0)}}
    _, tensors = encode(obj)
    assert len(tensors) == 4
    assert _same(_through_disk(tmp_path, obj), obj)


def test_shared_tensor_stored_once_and_snapshotted():
    shared = torch.arange(4.0)
    tree, tensors = encode({"a": shared, "b": [shared]})
    assert len(tensors) == 1
    shared.add_(100)  # later training steps must not leak into the checkpoint
    back = decode(tree, tensors)
    assert back["a"] is back["b"][0] and back["a"].tolist() == [0, 1, 2, 3]


def test_decode_checks_tensors():
    tree, tensors = encode({"t": torch.zeros(3)})
    with pytest.raises(ValueError, match="obj/t"):
        decode(tree, {})
    with pytest.raises(ValueError, match="recorded"):
        decode(tree, {"obj/t": torch.zeros(4)})
    with pytest.raises(ValueError, match="unknown node type"):
        decode({"__moc__": "pickle", "data": "..."}, {})


def test_nothing_is_unpickled(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    obj = _sample()
    assert _same(_through_disk(tmp_path, obj), obj)


def test_objects_file_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=OBJECTS_FILE):
        read_objects_file(str(tmp_path))
    (tmp_path / OBJECTS_FILE).write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="not a MoC objects file"):
        read_objects_file(str(tmp_path))
    (tmp_path / OBJECTS_FILE).write_text("{broken")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_objects_file(str(tmp_path))
    tree, _ = encode({"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="name the file"):
        write_objects_file(str(tmp_path), tree, None)


def test_deep_or_huge_objects_files_are_checkpoint_errors(tmp_path, monkeypatch):
    """``[[[...]]]`` 100000 deep raised RecursionError out of read_objects_file, and a
    tree that parsed but nested deeper than decode's recursion could follow raised it
    out of a load's objects(); both are checkpoint errors naming the file (decode alone:
    ValueError). The file is also read only up to its size cap."""
    from deepspeed_ext.format import objects as ob
    path = tmp_path / OBJECTS_FILE
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested") as err:
        read_objects_file(str(tmp_path))
    assert str(path) in str(err.value)
    path.write_text('{"format": "moc-objects", "version": 1, "tensor_file": null, "tree": '
                    + "[" * 900 + "]" * 900 + "}")
    with pytest.raises(CheckpointError, match="nested"):
        read_objects_file(str(tmp_path))
    with pytest.raises(ValueError, match="nested"):
        decode(_deep_list(5000), {})
    write_objects_file(str(tmp_path), {"x": 1}, None)
    monkeypatch.setattr(ob, "OBJECTS_MAX_BYTES", 8)
    with pytest.raises(CheckpointError, match="larger than 8 bytes"):
        read_objects_file(str(tmp_path))


def _deep_list(depth: int) -> list:
    node: list = []
    for _ in range(depth):
        node = [node]
    return node
