"""The settings search: constructed cases with a known best family, constraints, ordering."""

import pytest

from deepspeed_ext.planning.cli import training_flags
from deepspeed_ext.planning.costs import POLICIES, Layout, Policy, predict
from deepspeed_ext.planning.search import Constraints, best_of, candidates, k_choices, recommend
from deepspeed_ext.policy import redundancy as rd
from tests.deepspeed_ext.planning.conftest import CONFIG_16E, toy_hardware, toy_model


@pytest.fixture
def model16():
    """The toy model with gpt-350m-16e's 16 experts (the config the trainer validates)."""
    return toy_model(num_experts=16)


def _by_kind(choices):
    return {c.kind: c for c in choices}


def test_ks():
    assert k_choices(8) == [1, 2, 4, 8]
    assert k_choices(6) == [1, 2, 4, 6]
    assert k_choices(1) == [1]


def test_candidate_counts(model, layout):
    one_node = Layout(gpus=4, gpus_per_node=4)
    assert len(list(candidates("full-sync", model, layout))) == 12       # INTERVALS
    assert len(list(candidates("pec", model, layout))) == 12 * 4         # x K in 1,2,4,8
    assert len(list(candidates("exact", model, layout))) == 7            # no redundancy
    assert len(list(candidates("exact", model, one_node))) == 7          # no peers
    # two-level: 6 intervals x (1+2+3+4) (Ks, K<=Ks) x 9 persist intervals x redundancy
    assert len(list(candidates("two-level", model, one_node))) == 6 * 10 * 9
    assert len(list(candidates("two-level", model, layout))) == 6 * 10 * 9 * 3
    assert all(p.k <= p.k_snapshot for p in candidates("two-level", model, layout))
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        list(candidates("nope", model, layout))


def test_slow_storage_no_node_failures_prefers_memory(model, layout):
    # 1e-5 GB/s per node: a full checkpoint takes 13.5e6 / 2.5e3 = 5400 s per rank.
    hw = toy_hardware(storage_write_gbps=1e-5)
    choices = recommend(model, layout, hw, 3600.0, Constraints(node_fraction=0.0))
    kinds = _by_kind(choices)
    assert choices[0].kind == "two-level"
    assert choices[0].best.costs.software.source == "memory"
    assert choices[0].best.ettr > 0.99
    # storage-bound families: every checkpoint lags 5400 s
    for kind in ("full-sync", "full-async"):
        assert kinds[kind].best.ettr < 0.5
        assert kinds[kind].best.ettr < choices[0].best.ettr
    # exact writes every frame to storage: infeasible at every window
    assert kinds["exact"].best is None
    assert "per frame, more than an iteration" in kinds["exact"].why_none
    assert choices[-1].kind == "exact"
    assert kinds["exact"].tried == 7


def test_memory_policy_best_when_storage_slow_and_exact_feasible(model, layout):
    # storage slow enough that full checkpoints cost much, but a W=64 frame (1.32e6 B)
    # still fits in an iteration: 0.01 GB/s -> 2.5e6 B/s per rank.
    hw = toy_hardware(storage_write_gbps=0.01, storage_read_gbps=0.01)
    choices = recommend(model, layout, hw, 600.0, Constraints())
    kinds = _by_kind(choices)
    assert choices[0].kind == "two-level"
    # W=1..8 frames take >= 1.07 s to write: the smallest feasible window is 16
    assert kinds["exact"].best.costs.policy.window == 16
    for kind in ("full-sync", "full-async"):
        assert kinds[kind].best.ettr < kinds["two-level"].best.ettr


def test_plt_limit_zero_excludes_partial_experts(model, layout, hw):
    choices = recommend(model, layout, hw, 600.0, Constraints(plt_limit=0.0, node_fraction=0.5))
    kinds = _by_kind(choices)
    for c in choices:
        assert c.best is not None
        assert c.best.plt == 0.0
    assert kinds["pec"].best.costs.policy.k == 8
    assert kinds["pec"].best.costs.k_effective == 8
    assert kinds["pec-dynamic"].best.costs.k_effective == 8
    tl = kinds["two-level"].best.costs.policy
    assert tl.k_snapshot == 8
    # a node failure goes back to a persist with K < N only without peers' copies
    assert tl.redundancy != "none" or tl.k in (0, 8)
    # the same search with a loose limit picks a K < N for pec (less to write, same ETTR
    # rounding, or better): the limit is what forced K = N
    loose = best_of("pec", model, layout, hw, 600.0, Constraints(plt_limit=1.0))
    assert loose.best.plt > 0.0


def test_plt_limit_keeps_pec_below_it(model, layout, hw):
    limit = 0.01
    c = best_of("pec", model, layout, hw, 600.0, Constraints(plt_limit=limit))
    assert c.best.plt <= limit
    # brute force: the best admissible candidate's ETTR
    admissible = [predict(p, model, layout, hw, 600.0) for p in candidates("pec", model, layout)]
    admissible = [p for p in admissible if p.plt <= limit]
    assert round(c.best.ettr, 6) == round(max(p.ettr for p in admissible), 6)
    assert c.tried == 48


def test_tiny_host_memory_leaves_only_full_sync(model, layout, hw):
    choices = recommend(model, layout, hw, 600.0, Constraints(host_memory_gb=1e-9))
    assert choices[0].kind == "full-sync"
    assert choices[0].best.costs.host_bytes_per_rank == 0.0
    for c in choices[1:]:
        assert c.best is None
        assert "more than 1e-09 GiB of host memory per rank" in c.why_none


def test_host_memory_limit_excludes_big_snapshots(model, layout, hw):
    # 0.02 GiB = 21.47e6 B per rank: a full async buffer (13.5e6) fits; the trainer's three
    # full snapshot slots (40.5e6, whatever Ks) do not; exact needs 2 W frames (>= 27e6).
    choices = recommend(model, layout, hw, 600.0, Constraints(host_memory_gb=0.02))
    kinds = _by_kind(choices)
    for c in choices:
        if c.best is not None:
            assert c.best.costs.host_bytes_per_rank <= 0.02 * 2**30
    assert kinds["exact"].best is None
    assert "host memory" in kinds["exact"].why_none
    assert kinds["two-level"].best is None
    assert kinds["full-async"].best is not None
    # unlimited: two-level may hold full snapshots
    free = best_of("two-level", model, layout, hw, 600.0, Constraints(host_memory_gb=0.0))
    assert free.best is not None


def test_host_memory_budget_is_in_gib_as_the_trainers(model, layout, hw):
    # three slots of 13.5e6 B = 40.5e6 B = 0.0377 GiB (0.0405 GB): a budget of exactly that
    # many GiB admits two-level without redundancy, a byte less does not
    exact = 40.5e6 / 2**30
    fits = best_of("two-level", model, layout, hw, 600.0, Constraints(host_memory_gb=exact))
    assert fits.best is not None and fits.best.costs.policy.redundancy == "none"
    assert fits.best.costs.host_bytes_per_rank == pytest.approx(40.5e6)
    short = best_of("two-level", model, layout, hw, 600.0,
                    Constraints(host_memory_gb=(40.5e6 - 1) / 2**30))
    assert short.best is None and "GiB of host memory per rank" in short.why_none


def test_results_sorted_by_ettr(model, layout, hw):
    for constraints in (Constraints(), Constraints(node_fraction=1.0),
                        Constraints(host_memory_gb=0.02)):
        choices = recommend(model, layout, hw, 300.0, constraints)
        assert sorted(c.kind for c in choices) == sorted(POLICIES)
        scored = [c.best.ettr for c in choices if c.best is not None]
        assert scored == sorted(scored, reverse=True)
        first_none = next((i for i, c in enumerate(choices) if c.best is None), len(choices))
        assert all(c.best is None for c in choices[first_none:])


def test_recommend_subset_of_families(model, layout, hw):
    choices = recommend(model, layout, hw, 600.0, Constraints(), ["full-sync", "pec"])
    assert sorted(c.kind for c in choices) == ["full-sync", "pec"]


def test_node_failures_favour_redundancy(model, layout):
    # every failure loses a node and storage is slow to read back: peers beat storage
    hw = toy_hardware(storage_write_gbps=0.01, storage_read_gbps=0.01, network_gbps=10)
    c = best_of("two-level", model, layout, hw, 600.0, Constraints(node_fraction=1.0))
    assert c.best.costs.policy.redundancy in ("replicate", "erasure")
    assert c.best.costs.node.source == "peers"


def test_recommend_errors(model, layout, hw):
    with pytest.raises(ValueError, match="--mtbf must be > 0 seconds"):
        recommend(model, layout, hw, 0.0, Constraints())
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        recommend(model, layout, hw, 600.0, Constraints(), ["bogus"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(plt_limit=-0.1), r"--plt-limit must be in \[0, 1\]"),
    (dict(plt_limit=1.5), r"--plt-limit must be in \[0, 1\]"),
    (dict(host_memory_gb=-1.0), "--host-memory-gb must be a finite number >= 0"),
    (dict(host_memory_gb=float("nan")), "--host-memory-gb must be a finite number >= 0"),
    (dict(node_fraction=-0.5), r"--node-failure-fraction must be in \[0, 1\]"),
    (dict(node_fraction=2.0), r"--node-failure-fraction must be in \[0, 1\]"),
])
def test_constraints_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Constraints(**kwargs)


# --- what the search proposes must be runnable by the trainer --------------------------------

def _trainer_refuses(policy, layout, save_dir):
    """What the trainer's own validation says of ``policy``'s flags on ``layout`` (None:
    it accepts them)."""
    from megatron.training.arguments import ConfigError, parse_args, validate_args
    argv = ["--config", CONFIG_16E, "--data-path", "unused", "--save", str(save_dir),
            "--moc-ranks-per-node", str(layout.gpus_per_node)] + training_flags(policy)
    try:
        validate_args(parse_args(argv), layout.gpus)
    except ConfigError as err:
        return str(err)
    return None


def test_every_candidate_passes_the_trainers_validation(model16, tmp_path):
    # 16 GPUs in 4 nodes (the config's batch and expert parallelism fit 16 ranks)
    layout = Layout(gpus=16, gpus_per_node=4)
    seen = set()
    for kind in POLICIES:
        for p in candidates(kind, model16, layout):
            # the flags' validity does not depend on the interval values
            key = (p.kind, p.k, p.k_snapshot, p.window, p.redundancy, p.ec_data)
            if key in seen:
                continue
            seen.add(key)
            assert _trainer_refuses(p, layout, tmp_path) is None, p.label()
    assert len(seen) > 50
    # the check does catch what the trainer refuses: erasure 2+1 needs groups of 3 nodes
    refused = _trainer_refuses(Policy("two-level", redundancy="erasure", ec_data=2), layout,
                               tmp_path)
    assert "groups nodes by 3" in refused


def test_erasure_candidates_fit_the_trainers_node_groups(model):
    layout = Layout(gpus=64, gpus_per_node=8)              # 8 nodes
    topo = rd.Topology(layout.gpus, layout.gpus_per_node)
    for p in candidates("two-level", model, layout):
        if p.redundancy == "erasure":
            rd.check_layout(rd.RedundancySpec("erasure", 1, p.ec_data, 1), topo)


def test_erasure_candidates_on_two_nodes_fit(model, layout):
    topo = rd.Topology(layout.gpus, layout.gpus_per_node)  # 2 nodes: ec_data 1, groups of 2
    ecs = {p.ec_data for p in candidates("two-level", model, layout) if p.redundancy == "erasure"}
    assert ecs == {1}
    rd.check_layout(rd.RedundancySpec("erasure", 1, 1, 1), topo)
