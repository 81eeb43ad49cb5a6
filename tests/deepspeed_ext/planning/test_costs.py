"""The cost model against hand-computed cases (see conftest.py for the toy cluster's figures).

Toy cluster: P_ne = 1e6, P_e = 8e6, N = 8 experts; 8 GPUs, 4 per node (2 nodes), EP 8.
Per rank: full state 13.5e6 B; write 1e8 B/s, read 2e8 B/s, network 2.5e8 B/s,
device-to-host 1e9 B/s, host-to-device 2e9 B/s; T_iter 1 s, forward+backward 0.5 s,
restart 10 s.
"""

import pytest

from deepspeed_ext.planning.costs import (Hardware, Infeasible, Layout, ModelShape, Policy,
                                          dynamic_k, policy_costs, predict)
from tests.deepspeed_ext.planning.conftest import toy_hardware, toy_model

approx = pytest.approx


# --- hardware bandwidth shares --------------------------------------------------------------

def test_per_rank_bandwidths(hw, layout):
    # 4 ranks of a node share its links.
    assert hw.write_bps(layout) == approx(0.4e9 / 4)     # 1e8
    assert hw.read_bps(layout) == approx(0.8e9 / 4)      # 2e8
    assert hw.network_bps(layout) == approx(1e9 / 4)     # 2.5e8
    # An aggregate limit: 0.4 GB/s over 8 ranks = 5e7 < 1e8 per rank.
    capped = toy_hardware(storage_total_gbps=0.4)
    assert capped.write_bps(layout) == approx(5e7)
    assert capped.read_bps(layout) == approx(5e7)        # min(2e8, 5e7)
    # One partial node of 2 ranks: they split the node's bandwidth 2 ways.
    assert hw.write_bps(Layout(gpus=2, gpus_per_node=4)) == approx(0.4e9 / 2)


def test_layout_nodes_and_expert_parallel(model):
    assert Layout(gpus=8, gpus_per_node=4).nodes == 2
    assert Layout(gpus=2, gpus_per_node=4).nodes == 1
    # ep 0: gcd(gpus, experts) = gcd(12, 8) = 4
    assert Layout(gpus=12, gpus_per_node=4).expert_parallel(model) == 4
    assert Layout(gpus=8, gpus_per_node=4, ep=2).expert_parallel(model) == 2


# --- per-rank bytes ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,k,expected", [
    ("full-async", 0, 13.5e6),   # (1e6 + 8e6) * 12 / 8
    ("pec", 8, 13.5e6),          # K = N: everything
    ("pec", 4, 7.5e6),           # (1e6 + 8e6 * 4/8) * 12 / 8 = 5e6 * 1.5
    ("pec", 2, 4.5e6),           # (1e6 + 8e6 * 2/8) * 1.5 = 3e6 * 1.5
    ("pec", 1, 3.0e6),           # (1e6 + 1e6) * 1.5
])
def test_rank_bytes(model, layout, hw, kind, k, expected):
    c = policy_costs(Policy(kind, interval=10, k=k), model, layout, hw)
    assert c.save_bytes_per_rank == approx(expected)
    assert c.persist_bytes_per_rank == approx(expected)
    assert c.k_effective == (k or 8)


# --- full-sync / full-async / pec -------------------------------------------------------------

def test_full_sync(model, layout):
    hw = toy_hardware(node_replace_s=5.0)
    c = policy_costs(Policy("full-sync", interval=10), model, layout, hw)
    assert c.copy_s == approx(0.0135)                # 13.5e6 / 1e9
    assert c.persist_s == approx(0.135)              # 13.5e6 / 1e8
    assert c.stall_s == approx(0.1485)               # sync: copy + write
    assert c.overhead_per_iteration_s == approx(0.01485)   # 0.1485 / 10
    assert c.host_bytes_per_rank == 0.0
    assert c.storage_every == 10
    assert c.software.lost_iterations == approx(5.0)       # 10 / 2, no lag
    assert c.software.downtime_s == approx(10.0675)        # 10 + 13.5e6 / 2e8
    assert c.software.plt == 0.0
    assert c.software.source == "storage"
    assert c.node.downtime_s == approx(15.0675)            # + node_replace_s 5
    assert c.node.lost_iterations == approx(5.0)


def test_full_async_hidden_copy(model, layout, hw):
    c = policy_costs(Policy("full-async", interval=10), model, layout, hw)
    assert c.copy_s == approx(0.0135)
    assert c.stall_s == 0.0                                # 0.0135 < 0.5 s fwd+bwd
    assert c.overhead_per_iteration_s == 0.0
    assert c.persist_s == approx(0.135)
    assert c.software.lost_iterations == approx(5.135)     # 10/2 + 0.135 s / 1 s
    assert c.software.downtime_s == approx(10.0675)
    assert c.host_bytes_per_rank == approx(13.5e6)
    assert c.notes == ()


def test_full_async_stall_when_copy_exceeds_fwd_bwd(model, layout):
    hw = toy_hardware(d2h_gbps=0.01)                       # 1e7 B/s
    c = policy_costs(Policy("full-async", interval=10), model, layout, hw)
    assert c.copy_s == approx(1.35)                        # 13.5e6 / 1e7
    assert c.stall_s == approx(0.85)                       # max(0, 1.35 - 0.5)
    assert c.overhead_per_iteration_s == approx(0.085)     # 0.85 / 10


def test_pec_k2(model, layout, hw):
    c = policy_costs(Policy("pec", interval=10, k=2), model, layout, hw)
    assert c.save_bytes_per_rank == approx(4.5e6)
    assert c.copy_s == approx(0.0045)                      # 4.5e6 / 1e9
    assert c.persist_s == approx(0.045)                    # 4.5e6 / 1e8
    assert c.software.lost_iterations == approx(5.045)     # 10/2 + 0.045
    # PLT per failure: I (N/K - 1) / 2 = 10 * (4 - 1) / 2 = 15
    assert c.software.plt == approx(15.0)
    assert c.node.plt == approx(15.0)
    # a recovery reads every expert (each from its newest checkpoint): the full 13.5e6 B
    assert c.software.downtime_s == approx(10.0675)        # 10 + 13.5e6 / 2e8


def test_pec_recovery_loads_the_full_state(model, layout, hw):
    c = policy_costs(Policy("pec", interval=10, k=2), model, layout, hw)
    assert c.software.downtime_s == approx(10 + 13.5e6 / 2e8)   # 10.0675


@pytest.mark.parametrize("interval,k,plt", [(10, 1, 35.0),   # 10 * (8 - 1) / 2
                                            (4, 4, 2.0),     # 4 * (2 - 1) / 2
                                            (6, 8, 0.0)])    # K = N: nothing lost
def test_pec_plt_per_failure(model, layout, hw, interval, k, plt):
    c = policy_costs(Policy("pec", interval=interval, k=k), model, layout, hw)
    assert c.software.plt == approx(plt)


# --- capping when storage is slower than the interval -----------------------------------------

def test_full_async_capped_by_slow_storage(model, layout):
    hw = toy_hardware(storage_write_gbps=0.004, d2h_gbps=0.01)   # write 1e6 B/s per rank
    c = policy_costs(Policy("full-async", interval=10), model, layout, hw)
    assert c.persist_s == approx(13.5)                     # 13.5e6 / 1e6 > 10 iterations
    assert c.storage_every == 14                           # ceil(13.5 / 1)
    assert len(c.notes) == 1 and "one every 14 iterations, not 10" in c.notes[0]
    assert c.software.lost_iterations == approx(20.5)      # 14/2 + 13.5
    # Stall per checkpoint 0.85 (see above), now one checkpoint every 14 iterations.
    assert c.overhead_per_iteration_s == approx(0.85 / 14)


def test_pec_capped_staleness_uses_the_effective_interval(model, layout):
    hw = toy_hardware(storage_write_gbps=0.004)            # 1e6 B/s per rank
    c = policy_costs(Policy("pec", interval=2, k=2), model, layout, hw)
    assert c.persist_s == approx(4.5)                      # 4.5e6 / 1e6
    assert c.storage_every == 5                            # ceil(4.5)
    assert c.software.lost_iterations == approx(7.0)       # 5/2 + 4.5
    assert c.software.plt == approx(7.5)                   # 5 * (4 - 1) / 2


@pytest.mark.parametrize("interval,persist_interval,capped", [(1, 10, 14),   # ceil(13.5/1)*1
                                                              (5, 2, 15)])   # ceil(13.5/5)*5
def test_two_level_persist_capped(model, layout, interval, persist_interval, capped):
    hw = toy_hardware(storage_write_gbps=0.004)
    c = policy_costs(Policy("two-level", interval=interval, persist_interval=persist_interval),
                     model, layout, hw)
    assert c.persist_s == approx(13.5)
    assert c.storage_every == capped
    assert c.memory_every == interval
    assert any(f"one every {capped} iterations, not {interval * persist_interval}" in n
               for n in c.notes)
    assert c.node.lost_iterations == approx(capped / 2 + 13.5)


def test_no_cap_note_when_storage_keeps_up(model, layout, hw):
    c = policy_costs(Policy("two-level", interval=1, persist_interval=10), model, layout, hw)
    assert c.notes == ()
    assert c.storage_every == 10


# --- two-level ------------------------------------------------------------------------------

def test_two_level_memory_and_storage_recovery(model, layout, hw):
    c = policy_costs(Policy("two-level", interval=1, persist_interval=10), model, layout, hw)
    assert c.save_bytes_per_rank == approx(13.5e6)
    assert c.copy_s == approx(0.0135)
    assert c.stall_s == 0.0
    assert c.persist_s == approx(0.135)
    assert c.host_bytes_per_rank == approx(3 * 13.5e6)     # three snapshot slots
    assert c.protect_s == 0.0
    # Software failure: from memory.
    assert c.software.source == "memory"
    assert c.software.downtime_s == approx(10.00675)       # 10 + 13.5e6 / 2e9
    assert c.software.lost_iterations == approx(0.5135)    # 1/2 + 0.0135
    assert c.software.plt == 0.0
    # Node failure: back to the last persist, the lost node's ranks loading from storage.
    assert c.node.source == "storage+memory"
    assert c.node.downtime_s == approx(10.0675)            # 10 + 13.5e6 / 2e8
    assert c.node.lost_iterations == approx(5.135)         # 10/2 + 0.135
    assert c.node.plt == 0.0


def test_two_level_partial_snapshots_and_persists(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10, k_snapshot=4, k=2)
    c = policy_costs(p, model, layout, hw)
    assert c.k_effective == 2
    assert c.save_bytes_per_rank == approx(7.5e6)          # (1e6 + 4e6) * 1.5
    assert c.persist_bytes_per_rank == approx(4.5e6)       # (1e6 + 2e6) * 1.5
    assert c.copy_s == approx(0.0075)
    assert c.persist_s == approx(0.045)
    # the trainer reserves a full image per slot, whatever Ks
    assert c.host_bytes_per_rank == approx(3 * 13.5e6)
    # memory staleness: 1 * (8/4 - 1) / 2 = 0.5 (the three slots hold all 8 experts)
    assert c.software.plt == approx(0.5)
    assert c.software.lost_iterations == approx(0.5075)
    # every expert is in one of the slots: all of the state loads from memory
    assert c.software.downtime_s == approx(10 + 13.5e6 / 2e9)
    # node: the node holds 4 of EP 8 experts (share 0.5): 0.5 * 10 * (8/2 - 1)/2 + 0.5 * 0.5
    assert c.node.plt == approx(7.75)
    assert c.node.lost_iterations == approx(5.045)         # 10/2 + 0.045
    assert c.node.downtime_s == approx(10 + 13.5e6 / 2e8)  # every expert read back


def test_two_level_replicate_recovers_node_from_peers(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10, redundancy="replicate")
    c = policy_costs(p, model, layout, hw)
    assert c.protect_s == approx(0.054)                    # 13.5e6 / 2.5e8
    assert c.host_bytes_per_rank == approx(3 * 13.5e6 + 2 * 13.5e6)   # 67.5e6
    assert c.software.source == "memory"
    assert c.software.lost_iterations == approx(0.5135)
    assert c.node.source == "peers"
    # restart 10 + rebuild 0.054 + load from memory 0.00675
    assert c.node.downtime_s == approx(10.06075)
    assert c.node.lost_iterations == approx(0.554)         # 1/2 + max(0.0135, 0.054)
    assert c.node.plt == 0.0
    assert c.notes == ()


def test_two_level_erasure_host_memory(model):
    # 3 nodes of 4 (erasure 2+1 needs groups of 3 nodes): full image 9e6 * 12 / 12 = 9e6
    three = Layout(gpus=12, gpus_per_node=4, ep=4)
    p = Policy("two-level", interval=1, redundancy="erasure", ec_data=2)
    c = policy_costs(p, model, three, toy_hardware())
    # three full slots + two parities of 9e6 / 2
    assert c.host_bytes_per_rank == approx(3 * 9e6 + 2 * 9e6 / 2)
    assert c.node.source == "peers"


def test_redundancy_lagging_note(model, layout):
    hw = toy_hardware(network_gbps=0.01)                   # 2.5e6 B/s per rank
    c = policy_costs(Policy("two-level", interval=1, redundancy="replicate"), model, layout, hw)
    assert c.protect_s == approx(5.4)                      # 13.5e6 / 2.5e6
    assert any("protection lags" in n for n in c.notes)
    assert c.node.lost_iterations == approx(0.5 + 5.4)


def test_redundancy_on_one_node_is_refused_as_by_the_trainer(model, hw):
    one = Layout(gpus=4, gpus_per_node=4)
    with pytest.raises(ValueError, match="the trainer refuses it on this layout: --moc-replicas "
                                         "1 needs at least 2 nodes"):
        policy_costs(Policy("two-level", interval=1, redundancy="replicate"), model, one, hw)


# --- exact ----------------------------------------------------------------------------------

def test_exact_frame_and_recovery(model, layout, hw):
    c = policy_costs(Policy("exact", window=4), model, layout, hw)
    # weights per rank: 9e6 * 2 B / 8 = 2.25e6
    # frame: 13.5e6 / 4 + 2.25e6 * 3 / 8 = 3.375e6 + 0.84375e6 = 4.21875e6
    assert c.save_bytes_per_rank == approx(4.21875e6)
    assert c.copy_s == approx(0.00421875)
    assert c.persist_s == approx(0.0421875)                # 4.21875e6 / 1e8
    assert c.stall_s == 0.0
    assert c.host_bytes_per_rank == approx(2 * 4 * 4.21875e6)   # 33.75e6
    assert c.storage_every == 4 and c.memory_every == 4
    # window: 4 frames = 16.875e6 B; replay 1.5 W = 6
    assert c.software.source == "memory"
    assert c.software.downtime_s == approx(10 + 16.875e6 / 2e9)
    assert c.software.lost_iterations == approx(6.00421875)
    assert c.node.source == "storage"
    assert c.node.downtime_s == approx(10 + 16.875e6 / 2e8)   # 10.084375
    assert c.node.lost_iterations == approx(6.0421875)         # 6 + max(copy, write)
    assert c.software.plt == 0.0 and c.node.plt == 0.0


def test_exact_window_one_is_a_full_frame(model, layout, hw):
    c = policy_costs(Policy("exact", window=1), model, layout, hw)
    assert c.save_bytes_per_rank == approx(13.5e6)         # 13.5e6 / 1 + 0


def test_exact_stall_is_per_iteration(model, layout):
    hw = toy_hardware(d2h_gbps=0.001)                      # 1e6 B/s
    c = policy_costs(Policy("exact", window=4), model, layout, hw)
    assert c.copy_s == approx(4.21875)
    assert c.stall_s == approx(4.21875 - 0.5)
    assert c.overhead_per_iteration_s == approx(4.21875 - 0.5)   # a frame every iteration


def test_exact_has_no_redundancy_as_the_trainer():
    # --moc-redundancy protects two-level snapshots only; exact mode refuses two-level
    with pytest.raises(ValueError, match="redundancy protects two-level snapshots: not with exact"):
        Policy("exact", window=4, redundancy="replicate")


def test_exact_infeasible_when_a_frame_write_exceeds_an_iteration(model, layout):
    hw = toy_hardware(storage_write_gbps=0.01)             # 2.5e6 B/s per rank
    # W=4: 4.21875e6 / 2.5e6 = 1.6875 s > 1 s
    with pytest.raises(Infeasible, match=r"exact W=4: storage needs 1\.69 s per frame"):
        policy_costs(Policy("exact", window=4), model, layout, hw)
    assert issubclass(Infeasible, ValueError)
    # W=64: 13.5e6/64 + 2.25e6 * 63/128 = 1318359.375 B -> 0.527 s: feasible
    c = policy_costs(Policy("exact", window=64), model, layout, hw)
    assert c.persist_s == approx(1318359.375 / 2.5e6)


# --- dynamic K ------------------------------------------------------------------------------

def test_dynamic_k_threshold_is_exclusive(model):
    hw = toy_hardware()
    # lambda = 1 / 1024; staleness(10, 8, 1) = 35 -> accumulated 35/1024 (exact in binary)
    assert dynamic_k(model, hw, 10, 1, 35 / 1024, 1024.0) == 1          # not above: stays
    assert dynamic_k(model, hw, 10, 1, 35 / 1024 - 1e-9, 1024.0) == 2   # just above: doubles
    # K=2: staleness 10 * 3 / 2 = 15 -> 15/1024 at the threshold: stays at 2
    assert dynamic_k(model, hw, 10, 1, 15 / 1024, 1024.0) == 2
    # below that: K=4 (staleness 5)
    assert dynamic_k(model, hw, 10, 1, 15 / 1024 - 1e-9, 1024.0) == 4
    assert dynamic_k(model, hw, 10, 1, 5 / 1024 - 1e-9, 1024.0) == 8
    # never above N, doubling capped: 3 -> 6 -> 8
    assert dynamic_k(model, hw, 10, 3, 0.0, 1024.0) == 8
    # k0 = 0: all experts already
    assert dynamic_k(model, hw, 10, 0, 0.0, 1024.0) == 8


def test_pec_dynamic_costs_use_dynamic_k(model, layout, hw):
    p = Policy("pec-dynamic", interval=10, k=1, plt_threshold=15 / 1024)
    c = policy_costs(p, model, layout, hw, mtbf_s=1024.0)
    assert c.k_effective == 2
    assert c.save_bytes_per_rank == approx(4.5e6)
    assert c.software.plt == approx(15.0)
    with pytest.raises(ValueError, match="needs the MTBF"):
        policy_costs(p, model, layout, hw)


# --- predict --------------------------------------------------------------------------------

def test_predict_full_sync_mixed_failures(model, layout):
    hw = toy_hardware(node_replace_s=5.0)
    pred = predict(Policy("full-sync", interval=10), model, layout, hw, 1000.0, 0.25)
    # downtime: 0.75 * 10.0675 + 0.25 * 15.0675 = 11.3175; lost 5 either way
    assert pred.expected_downtime_s == approx(11.3175)
    assert pred.expected_lost_iterations == approx(5.0)
    # step = 1 + 0.01485; E[R] = 11.3175 + 5 * 1.01485 = 16.39175
    expected = 1 / (1 + 0.01485 / 1) / (1 + 16.39175 / 1000)
    assert pred.ettr == approx(expected, rel=1e-12)
    assert pred.plt == 0.0
    assert pred.mtbf_s == 1000.0 and pred.node_fraction == 0.25


def test_predict_two_level_mixed_over_node_fraction(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)
    # software: downtime 10.00675, lost 0.5135; node: 10.0675, 5.135; no stall
    for frac, downtime, lost in [(0.0, 10.00675, 0.5135), (1.0, 10.0675, 5.135),
                                 (0.5, 10.037125, 2.82425)]:
        pred = predict(p, model, layout, hw, 600.0, frac)
        assert pred.expected_downtime_s == approx(downtime)
        assert pred.expected_lost_iterations == approx(lost)
        assert pred.ettr == approx(1 / (1 + (downtime + lost * 1.0) / 600.0), rel=1e-12)


def test_predict_pec_plt(model, layout, hw):
    pred = predict(Policy("pec", interval=10, k=2), model, layout, hw, 1000.0)
    # failures per iteration 1/1000 (no stall) * 15 iterations lost per failure
    assert pred.plt == approx(0.015)
    assert pred.ettr == approx(1 / (1 + (10.0675 + 5.045) / 1000.0))


def test_predict_is_monotone_in_mtbf(model, layout, hw):
    p = Policy("full-async", interval=10)
    values = [predict(p, model, layout, hw, m).ettr for m in (60, 600, 6000, 60000)]
    assert values == sorted(values)
    assert values[-1] < 1.0


# --- bad inputs -----------------------------------------------------------------------------

@pytest.mark.parametrize("mtbf", [0.0, -5.0])
def test_predict_rejects_bad_mtbf(model, layout, hw, mtbf):
    with pytest.raises(ValueError, match="MTBF must be > 0"):
        predict(Policy("full-async"), model, layout, hw, mtbf)


@pytest.mark.parametrize("frac", [-0.1, 1.5])
def test_predict_rejects_bad_node_fraction(model, layout, hw, frac):
    with pytest.raises(ValueError, match=r"node-failure fraction must be in \[0, 1\]"):
        predict(Policy("full-async"), model, layout, hw, 600.0, frac)


def test_unknown_policy_kind():
    with pytest.raises(ValueError, match="unknown policy 'bogus'; choose from full-sync"):
        Policy("bogus")


@pytest.mark.parametrize("policy,match", [
    (Policy("pec", k=9), "k=9 exceeds the 8 experts"),
    (Policy("two-level", k_snapshot=16), "k_snapshot=16 exceeds the 8 experts"),
])
def test_k_above_experts(model, layout, hw, policy, match):
    with pytest.raises(ValueError, match=match):
        policy_costs(policy, model, layout, hw)


def test_layout_errors(model):
    with pytest.raises(ValueError, match="--gpus 12 is not a whole number of nodes of "
                                         "--gpus-per-node 8"):
        Layout(gpus=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="--ep 3 must divide --gpus 8"):
        Layout(gpus=8, gpus_per_node=4, ep=3)
    with pytest.raises(ValueError, match=">= 1"):
        Layout(gpus=0)
    with pytest.raises(ValueError, match="--ep 4 does not divide the 6 experts"):
        Layout(gpus=8, gpus_per_node=4, ep=4).expert_parallel(toy_model(num_experts=6))
    # a single partial node is fine
    assert Layout(gpus=4, gpus_per_node=8).nodes == 1


@pytest.mark.parametrize("kind", ["full-sync", "full-async", "pec", "pec-dynamic"])
def test_redundancy_needs_two_level(kind):
    with pytest.raises(ValueError, match=f"redundancy protects two-level snapshots: not "
                                         f"with {kind}"):
        Policy(kind, redundancy="replicate")


def test_policy_errors():
    with pytest.raises(ValueError, match="exact policy needs a window"):
        Policy("exact")
    with pytest.raises(ValueError, match="interval and persist_interval must be >= 1"):
        Policy("full-async", interval=0)
    with pytest.raises(ValueError, match="redundancy must be one of"):
        Policy("two-level", redundancy="mirror")
    with pytest.raises(ValueError, match="k and k_snapshot must be >= 0"):
        Policy("pec", k=-1)


def test_model_and_hardware_errors():
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        toy_model(num_experts=0)
    with pytest.raises(ValueError, match="parameter counts"):
        toy_model(params_expert=-1)
    with pytest.raises(ValueError, match=r"d2h_gbps \(--d2h-gbps\) must be > 0"):
        toy_hardware(d2h_gbps=0)
    with pytest.raises(ValueError, match="fwd_bwd_fraction must be in"):
        toy_hardware(fwd_bwd_fraction=1.5)
    with pytest.raises(ValueError, match="restart_s"):
        Hardware(iteration_s=1.0, restart_s=-1)
    assert isinstance(toy_model(), ModelShape)


def test_policy_labels():
    assert Policy("exact", window=4).label() == "exact W=4"
    assert Policy("pec", interval=10, k=2).label() == "pec every 10 K=2"
    assert Policy("two-level", interval=1, persist_interval=10).label() == \
        "two-level every 1 Ks=all persist/10"
    assert Policy("two-level", interval=2, k=1, k_snapshot=4, redundancy="erasure",
                  ec_data=3).label() == "two-level every 2 K=1 Ks=4 persist/1 erasure(3+1)"


def test_save_call_cost_is_paid_by_saves_that_go_to_storage(model, layout):
    hw = toy_hardware(save_call_s=0.02)
    base = toy_hardware()
    pec = policy_costs(Policy("pec", interval=10, k=2), model, layout, hw)
    pec0 = policy_costs(Policy("pec", interval=10, k=2), model, layout, base)
    assert pec.stall_s == approx(pec0.stall_s + 0.02)
    assert pec.overhead_per_iteration_s == approx(pec0.overhead_per_iteration_s + 0.002)
    # two-level: a memory-only snapshot pays nothing, every 5th (persisted) pays its own
    # persist call (not a PEC save's)
    hw = toy_hardware(save_call_s=0.5, persist_call_s=0.02)
    two = policy_costs(Policy("two-level", interval=1, persist_interval=5), model, layout, hw)
    two0 = policy_costs(Policy("two-level", interval=1, persist_interval=5), model, layout, base)
    assert two.stall_s == approx(two0.stall_s)
    assert two.overhead_per_iteration_s == approx(two0.overhead_per_iteration_s + 0.02 / 5)
    # exact: frames run no collective
    ex = policy_costs(Policy("exact", window=8), model, layout, hw)
    assert ex.stall_s == approx(policy_costs(Policy("exact", window=8), model, layout, base).stall_s)
    with pytest.raises(ValueError, match=r"save_call_s \(--save-call-s\) must be >= 0"):
        toy_hardware(save_call_s=-1)


def test_background_work_and_warmup_terms(model, layout):
    base = toy_hardware()
    hw = toy_hardware(background_s_per_gb=2.0, warmup_s=3.0)
    # pec K=2 every 10: 4.5e6 B copied and 4.5e6 B written per checkpoint -> 0.9e6 B per
    # iteration -> 2 s/GB x 0.9e-3 GB = 1.8 ms per iteration
    pec, pec0 = (policy_costs(Policy("pec", interval=10, k=2), model, layout, h) for h in (hw, base))
    assert pec.overhead_per_iteration_s == approx(pec0.overhead_per_iteration_s + 0.0018)
    assert pec.software.downtime_s == approx(pec0.software.downtime_s + 3.0)
    # two-level every 1, persist every 5: 13.5e6 copied per iteration + 13.5e6 / 5 written
    two, two0 = (policy_costs(Policy("two-level", interval=1, persist_interval=5), model,
                              layout, h) for h in (hw, base))
    assert two.overhead_per_iteration_s == approx(two0.overhead_per_iteration_s
                                                  + 2.0 * (13.5e6 + 2.7e6) / 1e9)
    assert two.node.downtime_s == approx(two0.node.downtime_s + 3.0)
    # exact: every frame copied and written
    ex, ex0 = (policy_costs(Policy("exact", window=8), model, layout, h) for h in (hw, base))
    assert ex.overhead_per_iteration_s == approx(ex0.overhead_per_iteration_s
                                                 + 2.0 * 2 * ex0.save_bytes_per_rank / 1e9)
    # the simulator: the first start pays the warm-up too
    from deepspeed_ext.planning.simulate import simulate_run
    run = simulate_run(Policy("pec", interval=10, k=2), model, layout, hw, 100, [], 1000.0)
    assert run.wall_s == approx(3.0 + 100 * (1.0 + pec.overhead_per_iteration_s))


def test_snapshot_call_is_paid_by_every_two_level_snapshot(model, layout):
    base = toy_hardware()
    hw = toy_hardware(snapshot_call_s=0.003)
    pol = Policy("two-level", interval=2, persist_interval=5)
    two, two0 = (policy_costs(pol, model, layout, h) for h in (hw, base))
    assert two.stall_s == approx(two0.stall_s + 0.003)
    assert two.overhead_per_iteration_s == approx(two0.overhead_per_iteration_s + 0.003 / 2)


# --- two-level recovery from three snapshot slots (Ks < N/3) ----------------------------------

def test_memory_recovery_with_few_experts_per_snapshot_reads_storage(layout, hw):
    # N = 16, Ks = K = 1, a snapshot every iteration: the trainer's 3 slots hold 3 experts
    # (ages 0, 1, 2), the other 13 come from storage.
    model = toy_model(num_experts=16)
    costs = {pi: policy_costs(Policy("two-level", interval=1, k_snapshot=1, k=1,
                                     persist_interval=pi), model, layout, hw)
             for pi in (1, 1000)}
    # snapshot (1e6 + 8e6/16) * 1.5 = 2.25e6 B: copy 2.25e-3 s; persist 2.25e6/1e8 = 0.0225 s
    # memory lag 1/2 + 0.00225 = 0.50225 iterations
    # persist/1000: storage rotation 1000 * (16 - 1) / 2 = 7500, plus the newest persist's
    # distance behind the snapshot: (500 + 0.0225) - 0.50225 = 499.52025
    # PLT: (3 experts x mean age 1 + 13 x 7999.52025) / 16
    assert costs[1000].software.plt == approx((3 * 1 + 13 * 7999.52025) / 16)   # 6499.80
    # persist/1: rotation 7.5, distance (0.5 + 0.0225) - 0.50225 = 0.02025
    assert costs[1].software.plt == approx((3 * 1 + 13 * 7.52025) / 16)         # 6.30
    # the load: 3 experts' state from memory, the rest from storage
    # memory (1e6 + 8e6 * 3/16) * 1.5 = 3.75e6 B / 2e9; storage 9.75e6 B / 2e8
    for c in costs.values():
        assert c.software.downtime_s == approx(10 + 3.75e6 / 2e9 + 9.75e6 / 2e8)
        assert c.software.source == "memory"


def test_memory_recovery_when_the_slots_hold_every_expert(layout, hw):
    # Ks = 8 of 16: three slots cover all 16: the rotation's staleness, whatever the persists
    model = toy_model(num_experts=16)
    for pi in (1, 1000):
        c = policy_costs(Policy("two-level", interval=2, k_snapshot=8, k=8, persist_interval=pi),
                         model, layout, hw)
        assert c.software.plt == approx(2 * (16 / 8 - 1) / 2)
        assert c.software.downtime_s == approx(10 + 13.5e6 / 2e9)


def test_peers_rebuild_only_the_protected_snapshot(model, layout, hw):
    # Ks = 2 of 8, replicate: the lost node's ranks get one rebuilt snapshot (2 experts at
    # age 0) and read the other 6 from storage; the survivors' three slots hold 6 experts
    # (ages 0, 1, 2), 2 from storage.
    p = Policy("two-level", interval=1, persist_interval=10, k_snapshot=2, k=2,
               redundancy="replicate")
    c = policy_costs(p, model, layout, hw)
    snap = (1e6 + 2e6) * 1.5                                  # 4.5e6 B
    copy, persist, protect = snap / 1e9, snap / 1e8, snap / 2.5e8
    age = 10 * (8 / 2 - 1) / 2 + (10 / 2 + persist) - (1 / 2 + copy)   # 15 + 4.5405
    survivors = (6 * 1 + 2 * age) / 8
    lost = (2 * 0 + 6 * age) / 8
    assert c.software.plt == approx(survivors)
    assert c.node.plt == approx(0.5 * lost + 0.5 * survivors)   # the node holds half the experts
    # downtime: restart, rebuild (4.5e6 / 2.5e8), then the lost node's load: 4.5e6 B from
    # memory and 9e6 B from storage
    assert c.node.downtime_s == approx(10 + protect + 4.5e6 / 2e9 + 9e6 / 2e8)
    assert c.node.source == "peers"


# --- settings the trainer refuses --------------------------------------------------------------

def test_persisting_more_experts_than_the_snapshot_is_refused_as_by_the_trainer():
    with pytest.raises(ValueError, match=r"the trainer refuses it: --moc-k-persist/--moc-pec-k "
                                         r"\(8\) must not exceed --moc-k-snapshot \(2\)"):
        Policy("two-level", k=8, k_snapshot=2)


def test_persisting_every_expert_with_partial_snapshots(model, layout, hw):
    # k = 0 (all) with Ks = 2: the trainer persists every expert (its pec_k 0), so a
    # persisted snapshot holds them all; it used to be clipped to Ks.
    c = policy_costs(Policy("two-level", interval=1, k_snapshot=2, persist_interval=10),
                     model, layout, hw)
    assert c.k_effective == 8
    assert c.persist_bytes_per_rank == approx(13.5e6)
    assert c.persist_s == approx(0.135)
    # node: the lost half from the persist (every expert: age 0); the survivors' three
    # slots hold 6 experts (ages 0, 1, 2), the other 2 come from the persist
    assert c.node.plt == approx(0.5 * 0.0 + 0.5 * (6 * 1 + 2 * 0) / 8)


@pytest.mark.parametrize("threshold", [0.0, 1.0, -0.1, float("nan")])
def test_plt_threshold_outside_the_trainers_range(threshold):
    with pytest.raises(ValueError, match=r"the trainer refuses it: --moc-plt-threshold must be "
                                         r"in \(0, 1\)"):
        Policy("pec-dynamic", k=1, plt_threshold=threshold)


def test_erasure_groups_that_do_not_divide_the_nodes_are_refused(model, layout, hw):
    # 2 nodes: erasure 2+1 needs groups of 3 nodes (redundancy.check_layout)
    with pytest.raises(ValueError, match=r"the trainer refuses it on this layout: "
                                         r"--moc-redundancy erasure with --moc-ec-data 2"):
        policy_costs(Policy("two-level", redundancy="erasure", ec_data=2), model, layout, hw)
    # 1+1 on 2 nodes fits
    c = policy_costs(Policy("two-level", redundancy="erasure", ec_data=1), model, layout, hw)
    assert c.node.source == "peers"


# --- host memory as the trainer reserves it -----------------------------------------------------

def test_two_level_host_memory_is_full_slots_whatever_ks(model):
    three = Layout(gpus=12, gpus_per_node=4, ep=4)           # full image 9e6 B per rank
    hw = toy_hardware()
    for ks in (0, 2):
        c = policy_costs(Policy("two-level", k_snapshot=ks, k=ks, redundancy="erasure",
                                ec_data=2), model, three, hw)
        assert c.host_bytes_per_rank == approx(3 * 9e6 + 2 * 9e6 / 2)
    c = policy_costs(Policy("two-level", k_snapshot=1, k=1, redundancy="replicate"), model,
                     three, hw)
    assert c.host_bytes_per_rank == approx(3 * 9e6 + 2 * 9e6)


# --- non-finite hardware figures -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["restart_s", "iteration_s", "d2h_gbps", "storage_total_gbps",
                                  "warmup_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_hardware_rejects_non_finite_figures(name, value):
    with pytest.raises(ValueError, match=f"{name} .* must be a finite number"):
        toy_hardware(**{name: value})


def test_predict_rejects_an_infinite_mtbf(model, layout, hw):
    with pytest.raises(ValueError, match="MTBF must be > 0 seconds and finite"):
        predict(Policy("full-async"), model, layout, hw, float("inf"))
