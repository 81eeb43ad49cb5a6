"""Boundaries of :mod:`deepspeed_ext.two_level.layouts` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/two_level``), on fragments made here."""

import dataclasses
import types

import pytest
import torch

from deepspeed_ext.format.image import layout_of
from deepspeed_ext.two_level.layouts import LAYOUT_CACHE, SnapshotLayouts, layout_signature


def _frag(key, length, kind="fp32"):
    return types.SimpleNamespace(key=key, length=length, kind=kind)


def test_the_signature_is_the_master_fragments_and_the_world():
    masters = [_frag("a|fp32|0", 4), _frag("b|fp32|0", 2)]
    with_moments = masters + [_frag("a|exp_avg|0", 4, "exp_avg")]
    sig = layout_signature(masters, 2)
    assert sig == layout_signature(with_moments, 2) and len(sig) == 16
    assert sig != layout_signature(masters, 3)
    assert sig != layout_signature([_frag("a|fp32|0", 4), _frag("b|fp32|0", 3)], 2)


def _rows():
    flat = torch.arange(10, dtype=torch.float32)
    # Storage order: dense (0..3), expert 0/1 (4..6), expert 0/0 (7..9).
    return [("e00|fp32|0", flat[7:10], (0, 0), {"n": "e00"}),
            ("dense|fp32|0", flat[0:4], None, {"n": "dense"}),
            ("e01|fp32|0", flat[4:7], (0, 1), {"n": "e01"})]


def test_content_holds_the_dense_fragments_and_the_chosen_experts_in_storage_order():
    layouts = SnapshotLayouts(None, 1)
    every = layouts.content(_rows(), None)
    assert list(every.tensors) == ["dense|fp32|0", "e01|fp32|0", "e00|fp32|0"]
    assert list(every.specs) == list(every.tensors) and every.specs["e01|fp32|0"] == {"n": "e01"}
    some = layouts.content(_rows(), frozenset({(0, 0)}))
    assert list(some.tensors) == ["dense|fp32|0", "e00|fp32|0"]
    assert layouts.content(_rows(), None) is every   # cached per expert set
    with pytest.raises(dataclasses.FrozenInstanceError):
        every.tensors = {}


def test_the_caches_are_bounded_and_forgotten():
    layouts = SnapshotLayouts(None, 1)
    first = layouts.content(_rows(), frozenset())
    for i in range(LAYOUT_CACHE - 1):
        layouts.content(_rows(), frozenset({(9, i)}))
    assert layouts.content(_rows(), frozenset()) is first   # 16 sets fit
    layouts.content(_rows(), frozenset({(9, 99)}))           # the 17th clears them
    assert layouts.content(_rows(), frozenset()) is not first
    again = layouts.content(_rows(), None)
    layouts.forget()
    assert layouts.content(_rows(), None) is not again
    assert LAYOUT_CACHE == 16


def test_a_layout_is_made_once_per_expert_set_and_object_shapes():
    layouts = SnapshotLayouts(None, 1)
    content = layouts.content(_rows(), None)
    objects = {"obj/rng": torch.zeros(5, dtype=torch.uint8)}
    tensors = dict(content.tensors, **objects)
    made = layouts.layout(None, content, tensors, objects)
    assert made.image == layout_of(tensors, keep_order=True)
    assert made.entries == [e.to_json() for e in made.image.entries]
    assert len(made.layout_id) == 24 and made.plan.copies >= 1
    assert layouts.layout(None, content, tensors, objects) is made
    with pytest.raises(dataclasses.FrozenInstanceError):   # shared by every snapshot
        made.layout_id = "x"
    other = {"obj/rng": torch.zeros(6, dtype=torch.uint8)}
    bigger = layouts.layout(None, content, dict(content.tensors, **other), other)
    assert bigger is not made and bigger.layout_id != made.layout_id
    assert layouts.layout(None, content, tensors, objects) is made   # both kept
    for i in range(LAYOUT_CACHE):
        shape = {"obj/rng": torch.zeros(7 + i, dtype=torch.uint8)}
        layouts.layout(None, content, dict(content.tensors, **shape), shape)
    assert layouts.layout(None, content, tensors, objects) is not made


def test_a_fragments_spec_is_its_manifest_spec_made_once():
    layouts = SnapshotLayouts(None, 1)
    frag = types.SimpleNamespace(key="w|fp32|2", name="w", kind="fp32", offset=2, length=3,
                                 shape=(5,), tensor=torch.zeros(3, dtype=torch.bfloat16),
                                 expert=(0, 1), split=None)
    spec = layouts.spec(frag)
    assert spec == {"name": "w", "kind": "fp32", "offset": 2, "length": 3, "shape": [5],
                    "dtype": "bfloat16", "expert": [0, 1]}
    assert layouts.spec(frag) is spec
