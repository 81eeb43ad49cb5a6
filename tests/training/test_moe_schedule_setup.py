"""The trainer's side of --moe-schedule (megatron/training/moe_schedule_setup.py): the fit
of measured collective times, and the layer shape it predicts for. The trainer runs with
the flag are in test_tensor_parallel_training.py."""

import argparse

import pytest

from megatron.training.moe_schedule_setup import fit_link, layer_shape


def test_the_calibration_fit_recovers_alpha_and_beta():
    alpha, beta, ranks = 2e-4, 3e-9, 4
    points = [(b, alpha * (ranks - 1) + beta * b * (ranks - 1) / ranks) for b in (65536, 4194304)]
    fitted = fit_link(ranks, points)
    assert fitted.alpha == pytest.approx(alpha) and fitted.beta == pytest.approx(beta)
    # noise that makes the big message look faster: clamped, not negative
    assert fit_link(ranks, [(65536, 2e-3), (4194304, 1e-3)]).beta == 0.0


def test_layer_shape_from_the_trainer_flags():
    args = argparse.Namespace(micro_batch_size=2, seq_length=32, num_experts=4, topk=2,
                              moe_train_capacity_factor=1.0, moe_min_capacity=4,
                              disable_moe_token_dropping=False, hidden_size=64,
                              moe_expert_parallel_size=2, tensor_model_parallel_size=2,
                              fp16=False, bf16=True)
    shape = layer_shape(args)
    # 64 tokens, 4 experts, top-2: 32 slots; bf16 activations
    assert (shape.experts, shape.capacity, shape.hidden, shape.ep, shape.tp,
            shape.bytes_per_element) == (4, 32, 64, 2, 2, 2)
    # top-1 at factor 1.3: the gate's 21 slots, padded to 22 for the tensor-parallel pair
    args.topk, args.moe_train_capacity_factor = 1, 1.3
    assert layer_shape(args).capacity == 22
