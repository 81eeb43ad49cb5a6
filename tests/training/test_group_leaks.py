"""megatron/training/group_leaks.py: which process groups of a failed run outlive its
teardown, and what holds them. The registry torch keeps of a process's groups is replaced
by one of stand-in groups (no process group is formed here)."""

import gc
import types

import torch.distributed as dist

from megatron.training import group_leaks


class StandInGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


HELD = {}
"""A module-level dict, as a library's cache of groups would be."""


def test_a_group_still_held_after_the_teardown_is_named_with_its_holder(monkeypatch):
    kept, dropped = StandInGroup(4), StandInGroup(2)
    registry = types.SimpleNamespace(pg_map={kept: "a", dropped: "b"})
    monkeypatch.setattr(dist.distributed_c10d, "_world", registry, raising=False)
    refs = group_leaks.group_refs()
    assert len(refs) == 2
    HELD["_DATA_PARALLEL_GROUP"] = kept
    registry.pg_map.clear()  # destroyed: torch forgets them
    del kept, dropped
    gc.collect()
    try:
        (survivor,) = group_leaks.outlived(refs)
        text = group_leaks.describe([survivor])
        assert text.startswith("a group of 4 rank(s) held by ") and \
            "dict[_DATA_PARALLEL_GROUP]" in text, text
    finally:
        HELD.clear()
    del survivor
    gc.collect()
    assert group_leaks.outlived(refs) == []  # the last holder gone: nothing outlives


def test_without_torch_s_registry_nothing_is_watched(monkeypatch):
    monkeypatch.setattr(dist.distributed_c10d, "_world", None, raising=False)
    assert group_leaks.group_refs() == []


def test_a_closure_holding_a_group_is_named_by_its_function(monkeypatch):
    group = StandInGroup(2)

    def make_hook(g):
        def reduce_hook():
            return g.size()
        return reduce_hook
    hook = make_hook(group)
    text = group_leaks.describe([group])
    assert "a closure of test_a_closure_holding_a_group_is_named_by_its_function.<locals>." \
           "make_hook.<locals>.reduce_hook" in text, text
    assert hook() == 2


def test_releasing_an_engine_drops_the_groups_zero_pinned_on_its_parameters():
    import torch
    from megatron.training.engine_setup import release_engine
    module = torch.nn.Linear(2, 2)
    group = StandInGroup(4)
    for param in module.parameters():
        param._dp_group, param._hp_mapping = group, object()
    release_engine(types.SimpleNamespace(module=module))  # no destroy(): a half-built one
    assert all(p._dp_group is None and p._hp_mapping is None for p in module.parameters())
