"""Lost-token accounting and dynamic K (deepspeed_ext.policy.plt): hand-computed cases."""

import pytest

from deepspeed_ext.policy.pec import ExpertLayout, make_policy
from deepspeed_ext.policy.plt import (HISTORY, RecoveryLoss, TokenLedger, cumulative_plt, dynamic_k)

ROUTING = [[1, 2, 3, 4], [4, 0, 4, 2]]
"""Assignments per iteration: [moe_layer][expert], 10 per layer."""


def _run(ledger, saves, steps=6):
    for step in range(1, steps + 1):
        ledger.observe(ROUTING)
        if step in saves:
            ledger.mark_saved(saves[step], step)


ALL = [(layer, e) for layer in range(2) for e in range(4)]


def test_plt_of_a_scripted_routing_by_hand():
    ledger = TokenLedger(2, 4)
    _run(ledger, {2: ALL, 4: [(0, 0), (1, 1)], 6: [(0, 1), (1, 2)]})
    versions = {(0, 0): 4, (0, 1): 6, (0, 2): 2, (0, 3): 2,
                (1, 0): 2, (1, 1): 4, (1, 2): 6, (1, 3): 2}
    loss = ledger.loss(6, versions)
    # layer 0: e0 loses iterations 5-6 (2 x 1), e2 and e3 iterations 3-6 (4 x 3, 4 x 4)
    # layer 1: e0 iterations 3-6 (4 x 4), e1 routed nothing, e3 iterations 3-6 (4 x 2)
    assert loss.lost == [[2, 0, 12, 16], [16, 0, 0, 8]]
    assert loss.assigned == [60, 60] and loss.exact
    assert loss.plt == pytest.approx((30 / 60 + 24 / 60) / 2)  # 0.45
    assert RecoveryLoss.from_json(loss.to_json()) == loss


def test_ledger_agrees_with_the_pec_policy_on_storage_recoveries():
    """Loading the newest checkpoint takes exactly the versions the policy recorded, so the
    ledger's lost tokens must equal the policy's unsaved tokens at that checkpoint."""
    layout = ExpertLayout(2, 4, 2)
    policy, ledger = make_policy("sequential", layout, 1), TokenLedger(2, 4)
    for step in range(1, 9):  # the last checkpoint is step 8, where the recovery goes
        routing = [[(step * (e + 1) + layer) % 5 for e in range(4)] for layer in range(2)]
        policy.observe_tokens(routing)
        ledger.observe(routing)
        if step % 2 == 0:
            chosen = policy.select()
            policy.mark_saved(chosen, step)
            ledger.mark_saved(chosen, step)
    steps = policy.last_saved_steps()
    versions = {(layer, e): steps[layer][e] for layer in range(2) for e in range(4)}
    assert ledger.loss(8, versions).lost == policy.unsaved_tokens()
    assert any(n for row in policy.unsaved_tokens() for n in row)  # K = 1 lost something


def test_newer_memory_versions_lose_nothing_and_old_versions_are_bounded():
    ledger = TokenLedger(1, 2)
    for step in range(1, 2 * HISTORY + 3):
        ledger.observe([[1, 1]])
        ledger.mark_saved([(0, 0), (0, 1)], step)
    step = 2 * HISTORY + 2
    assert ledger.loss(step, {(0, 0): step + 3, (0, 1): step}).lost == [[0, 0]]
    recent = step - HISTORY + 1
    assert ledger.loss(step, {(0, 0): recent}).lost == [[HISTORY - 1, 0]]
    old = ledger.loss(step, {(0, 0): 1})  # forgotten: the oldest remembered bounds it
    assert not old.exact and old.lost == [[HISTORY - 1, 0]]


def test_ledger_state_round_trip_and_shape_checks():
    ledger = TokenLedger(2, 4)
    _run(ledger, {2: ALL, 4: [(0, 0)]})
    other = TokenLedger(2, 4)
    other.load_state_dict(ledger.state_dict())
    assert other == ledger
    with pytest.raises(ValueError, match="2 MoE layers x 4 experts"):
        TokenLedger(3, 4).load_state_dict(ledger.state_dict())
    with pytest.raises(ValueError, match="shaped"):
        ledger.observe([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="negative"):
        ledger.observe([[1, 2, 3, -4], [0, 0, 0, 0]])
    assert ledger.cumulative == [[6, 12, 18, 24], [24, 0, 24, 12]]  # nothing half-added
    with pytest.raises(ValueError, match="outside"):
        ledger.mark_saved([(2, 0)], 7)


def test_cumulative_plt_over_several_recoveries():
    first = RecoveryLoss(step=10, lost=[[5, 0]], assigned=[100])
    second = RecoveryLoss(step=20, lost=[[4, 6]], assigned=[200])
    assert first.plt == pytest.approx(0.05)
    assert cumulative_plt([first, second]) == pytest.approx(15 / 200)
    assert cumulative_plt([]) == 0.0
    with pytest.raises(ValueError, match="MoE layer counts"):
        cumulative_plt([first, RecoveryLoss(step=5, lost=[[1], [1]], assigned=[1, 1])])


def test_dynamic_k_doubles_exactly_when_the_threshold_is_crossed():
    threshold = 0.0375
    assert dynamic_k(1, 8, 0.0374, threshold) == 1
    assert dynamic_k(1, 8, threshold, threshold) == 1  # at the limit: not over it
    assert dynamic_k(1, 8, 0.0376, threshold) == 2
    k, trace = 1, []
    for cumulative in (0.01, 0.05, 0.06, 0.07, 0.08):
        k = dynamic_k(k, 8, cumulative, threshold)
        trace.append(k)
    assert trace == [1, 2, 4, 8, 8]  # capped at all experts
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--moc-plt-threshold"):
            dynamic_k(1, 8, 0.5, bad)
    with pytest.raises(ValueError, match="K must be in 1..8"):
        dynamic_k(9, 8, 0.5, threshold)


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

@pytest.mark.parametrize("layers, experts", [(-1, 4), (2, 0), (-1, 0)])
def test_ledger_refuses_a_negative_layer_count_or_no_expert(layers, experts):
    with pytest.raises(ValueError, match=">= 0 MoE layers and >= 1 expert"):
        TokenLedger(layers, experts)


def test_ledger_of_no_moe_layer_or_one_expert_is_fine():
    assert TokenLedger(0, 1).cumulative == []
    ledger = TokenLedger(2, 1)
    ledger.observe([[3], [4]])
    assert ledger.cumulative == [[3], [4]]


@pytest.mark.parametrize("expert_id", [(0, 4), (0, 5), (2, 0), (0, -1)])
def test_mark_saved_refuses_an_expert_one_or_more_past_the_end(expert_id):
    ledger = TokenLedger(2, 4)
    with pytest.raises(ValueError, match="outside"):
        ledger.mark_saved([expert_id], 1)
    assert ledger.versions == TokenLedger(2, 4).versions


def test_a_save_at_an_older_step_drops_the_abandoned_newer_versions():
    # After a recovery rolled the run back to step 3, the versions saved at 4 and 5 belong
    # to the abandoned timeline: the history stays oldest first and ends at the new save.
    ledger = TokenLedger(1, 1)
    for step in (2, 4, 5):
        ledger.observe([[1]])
        ledger.mark_saved([(0, 0)], step)
    ledger.mark_saved([(0, 0)], 3)
    assert ledger.versions == [[[(2, 1), (3, 3)]]]


def test_ledger_state_of_a_larger_model_or_extra_versions_is_refused():
    big = TokenLedger(2, 4)
    _run(big, {2: ALL})
    with pytest.raises(ValueError, match="saved for 2 MoE layers x 4 experts"):
        TokenLedger(1, 4).load_state_dict(big.state_dict())
    state = big.state_dict()
    state["versions"].append([[] for _ in range(4)])
    other = TokenLedger(2, 4)
    with pytest.raises(ValueError, match="versions are not shaped"):
        other.load_state_dict(state)
    assert other == TokenLedger(2, 4)


def test_a_count_of_minus_one_is_negative():
    ledger = TokenLedger(1, 2)
    with pytest.raises(ValueError, match="negative"):
        ledger.observe([[0, -1]])
    assert ledger.cumulative == [[0, 0]]
