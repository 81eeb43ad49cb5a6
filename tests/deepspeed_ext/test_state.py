"""The state description covers every element of every tensor exactly once (ZeRO) or
names every holder (no ZeRO), with global expert names, on real multi-rank engines."""

import json
from collections import defaultdict

import pytest

from tests.launch import describe, run_ranks

WORKER = "tests/deepspeed_ext/engine_worker.py"


def _describe(tmp_path, nproc, flags):
    results = run_ranks(nproc, ["describe", str(tmp_path)] + flags, script=WORKER)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.load(open(tmp_path / f"rank{r}.json"))["fragments"] for r in range(nproc)]


@pytest.mark.parametrize("nproc, ep, zero", [(2, 2, 2), (4, 2, 1), (2, 1, 0)])
def test_fragments_cover_the_global_state(tmp_path, nproc, ep, zero):
    per_rank = _describe(tmp_path, nproc, ["--moe-expert-parallel-size", str(ep),
                                           "--zero-stage", str(zero)])
    covered = defaultdict(list)
    shapes = {}
    for rank, frags in enumerate(per_rank):
        for name, kind, shape, offset, length, expert, holders in frags:
            covered[(name, kind)].append((offset, length, tuple(holders), rank))
            shapes[name] = shape
            if ".deepspeed_experts." in name:
                index = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                assert expert is not None and expert[1] == index
    experts = {n for n, _ in covered if ".deepspeed_experts." in n}
    assert len({n.split(".deepspeed_experts.")[1].split(".")[0] for n in experts}) == 4  # global ids 0-3
    for (name, kind), frags in covered.items():
        numel = 1
        for d in shapes[name]:
            numel *= d
        if zero > 0:
            # Partitioned: every element owned by exactly one rank.
            spans = sorted((o, o + n) for o, n, _, _ in frags)
            assert spans[0][0] == 0 and spans[-1][1] == numel, (name, kind, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, kind, spans)
            assert all(h == (r,) for _, _, h, r in frags)
        else:
            # Replicated: each holder holds it whole, and lists the same holders.
            assert all(o == 0 and n == numel for o, n, _, _ in frags)
            holders = {h for _, _, h, _ in frags}
            assert len(holders) == 1 and sorted(r for *_, r in frags) == list(next(iter(holders)))
    kinds = {k for _, k in covered}
    assert kinds == {"fp32", "exp_avg", "exp_avg_sq"}
