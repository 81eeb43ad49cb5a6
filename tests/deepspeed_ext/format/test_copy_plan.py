"""Copy plans: an image laid out in source order fills with one copy per flat source (a
ZeRO partition, an Adam moment), every tensor reads back bitwise, a stale plan falls back
to per-entry copies with the right bytes, and the default layout is what it was."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes

from deepspeed_ext.format.copy_plan import CopyPlan, plan_copies, run_copies, source_order
from deepspeed_ext.format.image import fill_image, image_view, layout_image, layout_of

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _zero_like(groups=(7, 5), seed=0):
    """ZeRO-2 on one rank: per param group a flat fp32 partition and two flat Adam moments;
    every parameter's fragment is a view of each (sizes ``3 + i``, so none line up)."""
    gen = torch.Generator().manual_seed(seed)
    flats, tensors = [], {}
    for g, count in enumerate(groups):
        sizes = [3 + i for i in range(count)]
        for kind in KINDS:
            flat = torch.randn(sum(sizes), generator=gen)
            flats.append(flat)
            offset = 0
            for p, size in enumerate(sizes):
                # Names whose key order is not the memory order (p=10 sorts before p=2).
                tensors[f"g{g}.p{p}|{kind}"] = flat.narrow(0, offset, size).view(1, size)
                offset += size
    return flats, tensors


def _ordered(tensors):
    return {k: tensors[k] for k in source_order(tensors)}


def _read_back(buffer, layout):
    """Every tensor as a slot image hands it out: a typed slice at its entry."""
    out = {}
    for e in layout.entries:
        raw = buffer[e.start:e.start + e.nbytes]
        out[e.key] = raw.view(getattr(torch, e.dtype)).reshape(e.shape)
    return out


def _assert_bitwise(back, tensors):
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert torch.equal(back[key].contiguous().view(torch.uint8),
                           tensor.contiguous().view(torch.uint8)), key


def _fill(tensors, layout=None, plan=None, pad=64):
    layout = layout or layout_of(_ordered(tensors), keep_order=True)
    plan = plan or plan_copies(layout, tensors)
    buffer = torch.full((layout.nbytes + pad,), 0xAB, dtype=torch.uint8)
    copies = run_copies(buffer, layout, plan, tensors)
    return buffer, layout, plan, copies


# -- (a) ZeRO-like state: one run per flat source ------------------------------------

def test_views_of_flat_sources_fill_with_one_copy_each():
    flats, tensors = _zero_like()
    buffer, layout, plan, copies = _fill(tensors)
    assert len(plan.runs) == len(flats) == 6
    assert copies == plan.copies == len(flats) + 1
    runs = {frozenset(r.keys) for r in plan.runs}
    for g, count in enumerate((7, 5)):
        for kind in KINDS:
            assert frozenset(f"g{g}.p{p}|{kind}" for p in range(count)) in runs
    _assert_bitwise(_read_back(buffer, layout), tensors)
    _assert_bitwise(load_bytes(bytes(image_view(buffer, layout))), tensors)
    # The same bytes as one copy per fragment.
    reference = torch.full_like(buffer, 0xAB)
    fill_image(reference, layout, tensors)
    assert torch.equal(reference, buffer)


def test_key_order_scatters_the_fragments():
    # Today's layout (key order) interleaves the flat sources: many more runs.
    flats, tensors = _zero_like()
    plan = plan_copies(layout_of(tensors), tensors)
    assert len(plan.runs) > 2 * len(flats)


def test_source_order_is_storage_order_and_stable():
    base = torch.arange(10.0)
    tensors = {"c": base[6:], "a": base[:3], "empty1": base[3:3], "b": base[3:6],
               "empty2": base[3:3], "other": torch.zeros(2)}
    order = source_order(tensors)
    ours = [k for k in order if k != "other"]
    assert ours == ["a", "empty1", "b", "empty2", "c"]  # ties keep the mapping's order
    # Zero-byte entries between joined views neither split nor count as a copy.
    _, layout, plan, copies = _fill(tensors)
    assert copies == 1 + 2 and {len(r.keys) for r in plan.runs} == {1, 5}


# -- (b) mixed dtypes ----------------------------------------------------------------

def test_mixed_dtypes_stay_aligned_and_read_back(tmp_path):
    flats, tensors = _zero_like(groups=(3,))
    ids = torch.arange(9, dtype=torch.int64)
    obj = torch.tensor(list(b"pickled objects!!"), dtype=torch.uint8)  # odd length
    half = torch.randn(5).to(torch.bfloat16)
    mixed = {"obj": obj, "half": half, "ids.0": ids[:4], "ids.1": ids[4:], **tensors}
    layout = layout_of(_ordered(mixed), keep_order=True)
    sizes = [torch.empty(0, dtype=getattr(torch, e.dtype)).element_size() for e in layout.entries]
    assert sizes == sorted(sizes, reverse=True)
    for entry, size in zip(layout.entries, sizes):
        assert entry.start % size == 0, entry
    buffer, _, plan, copies = _fill(mixed, layout)
    assert copies == 1 + len(flats) + 1 + 1 + 1  # flats, ids, half, obj
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(image_view(buffer, layout)))
    with safe_open(str(path), framework="pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}
    _assert_bitwise(back, mixed)
    _assert_bitwise(_read_back(buffer, layout), mixed)


def test_keep_order_keeps_the_given_order_within_an_element_size():
    spec = [("z", (2,), "uint8"), ("y", (3,), "float32"), ("x", (1,), "int64"),
            ("w", (4,), "float32"), ("v", (1,), "uint8")]
    layout = layout_image(spec, keep_order=True)
    assert [e.key for e in layout.entries] == ["x", "y", "w", "z", "v"]
    header = json.loads(layout.header[8:].decode())
    assert list(header) == ["x", "y", "w", "z", "v"]
    assert layout_image(spec, keep_order=True) != layout_image(list(reversed(spec)), keep_order=True)


# -- (c) a subset of experts ---------------------------------------------------------

def test_every_other_view_removed_gives_more_runs_but_right_bytes():
    flats, tensors = _zero_like()
    keys = list(tensors)
    subset = {k: tensors[k] for k in keys[::2]}
    buffer, layout, plan, copies = _fill(subset)
    # Every view of a group-kind is isolated from the next kept one.
    assert len(plan.runs) == len(subset) and copies == len(subset) + 1
    _assert_bitwise(_read_back(buffer, layout), subset)
    # Whole groups of experts kept: their views still join.
    kept = {k: v for k, v in tensors.items() if not k.startswith(("g0.p3|", "g0.p4|"))}
    buffer, layout, plan, _ = _fill(kept)
    assert len(plan.runs) == len(flats) + 3  # each g0 flat now two runs
    _assert_bitwise(_read_back(buffer, layout), kept)


# -- (d) a stale plan ----------------------------------------------------------------

def test_a_stale_plan_falls_back_to_per_entry_copies():
    flats, tensors = _zero_like()
    layout = layout_of(_ordered(tensors), keep_order=True)
    plan = plan_copies(layout, tensors)
    # The optimizer's state replaced (a load): new, independent tensors, new values.
    fresh = {k: torch.randn_like(v) for k, v in tensors.items()}
    buffer, _, _, copies = _fill(fresh, layout, plan)
    assert copies == 1 + len(tensors)
    _assert_bitwise(_read_back(buffer, layout), fresh)


def test_a_plan_survives_a_moved_flat_buffer_but_not_a_reordered_one():
    flats, tensors = _zero_like(groups=(4,))
    layout = layout_of(_ordered(tensors), keep_order=True)
    plan = plan_copies(layout, tensors)
    moved = {k: v.clone() for k, v in tensors.items()}
    for flat_index, kind in enumerate(KINDS):  # the same views of a new flat copy
        new_flat = flats[flat_index].clone() + 1
        offset = 0
        for p in range(4):
            moved[f"g0.p{p}|{kind}"] = new_flat.narrow(0, offset, 3 + p).view(1, 3 + p)
            offset += 3 + p
    buffer, _, _, copies = _fill(moved, layout, plan)
    assert copies == plan.copies
    _assert_bitwise(_read_back(buffer, layout), moved)
    # Views of one flat in another order (two same-size fragments swapped would be
    # undetectable by shape; here sizes differ, so place two equal-size ones).
    flat = torch.randn(8)
    pair = {"a": flat[:4], "b": flat[4:]}
    layout = layout_of(pair, keep_order=True)
    plan = plan_copies(layout, pair)
    assert plan.copies == 2
    swapped = {"a": flat[4:], "b": flat[:4]}
    buffer, _, _, copies = _fill(swapped, layout, plan)
    assert copies == 3
    _assert_bitwise(_read_back(buffer, layout), swapped)
    # Inside the storage's bounds, one view moved further along: the span would copy
    # flat[4:8] into b's place.
    flat = torch.randn(12)
    pair = {"a": flat[:4], "b": flat[4:8]}
    layout = layout_of(pair, keep_order=True)
    plan = plan_copies(layout, pair)
    moved = {"a": flat[:4], "b": flat[8:]}
    buffer, _, _, copies = _fill(moved, layout, plan)
    assert copies == 3
    _assert_bitwise(_read_back(buffer, layout), moved)


def test_a_span_past_its_storage_falls_back():
    # Same addresses as planned, but the first source's storage became too short to hold
    # the span (a new storage sharing the old memory): no out-of-bounds read.
    flat = torch.randn(8)
    pair = {"a": flat[:4], "b": flat[4:]}
    layout = layout_of(pair, keep_order=True)
    plan = plan_copies(layout, pair)
    short = torch.empty(0).set_(flat.untyped_storage()[:16], 0, (4,), (1,))  # first 4 floats
    assert short.data_ptr() == flat.data_ptr() and short.untyped_storage().nbytes() == 16
    buffer, _, _, copies = _fill({"a": short, "b": flat[4:]}, layout, plan)
    assert copies == 3
    _assert_bitwise(_read_back(buffer, layout), pair)


def test_errors_name_the_tensor_and_the_buffer():
    flats, tensors = _zero_like(groups=(3,))
    layout = layout_of(_ordered(tensors), keep_order=True)
    plan = plan_copies(layout, tensors)
    with pytest.raises(ValueError, match="needs"):
        run_copies(torch.empty(layout.nbytes - 1, dtype=torch.uint8), layout, plan, tensors)
    with pytest.raises(ValueError, match="uint8"):
        run_copies(torch.empty(layout.nbytes, dtype=torch.int16), layout, plan, tensors)
    wrong = dict(tensors, **{"g0.p1|exp_avg": torch.zeros(1, 4, dtype=torch.float64)})
    for call in (lambda: plan_copies(layout, wrong),
                 lambda: run_copies(torch.empty(layout.nbytes, dtype=torch.uint8), layout, plan, wrong)):
        with pytest.raises(ValueError, match=r"g0\.p1\|exp_avg"):
            call()
    other = layout_of(tensors)  # key order: the plan is not for it
    with pytest.raises(ValueError, match="does not match the layout"):
        run_copies(torch.empty(other.nbytes, dtype=torch.uint8), other, plan, tensors)


# -- (e) a non-contiguous source -----------------------------------------------------

def test_a_non_contiguous_source_is_a_run_of_its_own():
    base = torch.randn(4, 6)
    tensors = {"a": base[:, :3], "b": base[:, 3:], "t": base.t(), "flat": base.view(-1)[:5]}
    buffer, layout, plan, copies = _fill(tensors)
    assert all(len(r.keys) == 1 for r in plan.runs) and copies == 1 + 4
    _assert_bitwise(_read_back(buffer, layout), tensors)
    # Storage offsets that follow each other, but a transposed view first: no run.
    flat = torch.randn(13)
    tensors = {"t": flat[:9].view(3, 3).t(), "next": flat[9:]}
    assert tensors["t"].storage_offset() + 9 == tensors["next"].storage_offset()
    buffer, layout, plan, copies = _fill(tensors)
    assert len(plan.runs) == 2 and copies == 3
    _assert_bitwise(_read_back(buffer, layout), tensors)
    # Planned contiguous, transposed since (same place, same shape): the run is stale.
    square = {"s": flat[:9].view(3, 3), "next": flat[9:]}
    layout = layout_of(square, keep_order=True)
    plan = plan_copies(layout, square)
    assert plan.copies == 2
    turned = {"s": flat[:9].view(3, 3).t(), "next": flat[9:]}
    buffer, _, _, copies = _fill(turned, layout, plan)
    assert copies == 3
    _assert_bitwise(_read_back(buffer, layout), turned)


# -- (f) the default layout is unchanged ---------------------------------------------

def test_default_layout_is_unchanged():
    # Computed with the code before keep_order existed (key order within element size).
    spec = [("m.b", (3,), "bfloat16"), ("a.w", (2, 2), "float32"), ("z.i", (1,), "int64"),
            ("k.u", (5,), "uint8"), ("b.w", (3,), "float32"), ("e", (0,), "float32")]
    expected = (
        b'{"__metadata__":{"step":"7"},'
        b'"z.i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},'
        b'"a.w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]},'
        b'"b.w":{"dtype":"F32","shape":[3],"data_offsets":[24,36]},'
        b'"e":{"dtype":"F32","shape":[0],"data_offsets":[36,36]},'
        b'"m.b":{"dtype":"BF16","shape":[3],"data_offsets":[36,42]},'
        b'"k.u":{"dtype":"U8","shape":[5],"data_offsets":[42,47]}}')
    for order in (spec, list(reversed(spec))):
        for layout in (layout_image(order, {"step": "7"}),
                       layout_image(order, {"step": "7"}, keep_order=False)):
            assert layout.header == struct.pack("<Q", 368) + expected
            assert [(e.key, e.start, e.nbytes) for e in layout.entries] == [
                ("z.i", 376, 8), ("a.w", 384, 16), ("b.w", 400, 12), ("e", 412, 0),
                ("m.b", 412, 6), ("k.u", 418, 5)]
            assert layout.nbytes == 423


def test_plan_is_a_plain_record():
    _, tensors = _zero_like(groups=(2,))
    layout = layout_of(_ordered(tensors), keep_order=True)
    plan = plan_copies(layout, tensors)
    assert isinstance(plan, CopyPlan) and plan == plan_copies(layout, tensors)
    assert plan.header_nbytes == len(layout.header)
    run = plan.runs[0]
    assert run.start == layout.entries[run.first].start and run.dtype == "float32"
    assert run.nbytes == sum(e.nbytes for e in layout.entries[run.first:run.first + len(run.keys)])
    with pytest.raises(AttributeError):
        run.start = 0


# -- (g) a real ZeRO-2 engine: tests/deepspeed_ext/two_level/test_two_level.py's stages test plans
# the whole state of its engine (one run per flat partition), in a process it starts anyway.


# -- CUDA: the copies are queued on the caller's stream ------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_non_blocking_copies_from_cuda():
    flats, tensors = _zero_like()
    on_gpu = {}
    for flat in flats:  # the same views, of flats on the GPU
        gpu = flat.cuda()
        for k, v in tensors.items():
            if v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                on_gpu[k] = gpu.narrow(0, v.storage_offset(), v.numel()).view(v.shape)
    layout = layout_of(_ordered(on_gpu), keep_order=True)
    plan = plan_copies(layout, on_gpu)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copies = run_copies(buffer, layout, plan, on_gpu, non_blocking=True)
    stream.synchronize()
    assert copies == len(flats) + 1
    _assert_bitwise(_read_back(buffer, layout), tensors)

