"""Operators for the tests of :mod:`deepspeed_ext.policy.operators` and
:mod:`deepspeed_ext.policy.window`: hand-made and random ranks."""

import random

from deepspeed_ext.policy.operators import Operator


def expert_op(name, layer, expert, active=12, frozen=2):
    return Operator(name, "expert", (layer, expert), active, frozen)


def dense_op(name, active=12, frozen=2, kind="dense"):
    return Operator(name, kind, None, active, frozen)


def plain_ops(sizes):
    """Dense operators o0, o1, ... with ``(active_bytes, frozen_bytes)`` from ``sizes``."""
    return [dense_op(f"o{i}", a, f) for i, (a, f) in enumerate(sizes)]


def random_model(seed):
    """A random rank: a few dense blocks and gates plus experts, and a random popularity."""
    rng = random.Random(seed)
    ops = [dense_op(f"dense{i}", rng.randrange(0, 500), rng.randrange(0, 100))
           for i in range(rng.randrange(0, 4))]
    ops += [dense_op(f"gate{i}", rng.randrange(0, 50), rng.randrange(0, 10), kind="gate")
            for i in range(rng.randrange(0, 3))]
    layers, experts = rng.randrange(1, 4), rng.randrange(1, 5)
    ops += [expert_op(f"e{layer}.{e}", layer, e, rng.randrange(0, 300), rng.randrange(0, 60))
            for layer in range(layers) for e in range(experts)]
    popularity = {(layer, e): rng.randrange(0, 5) for layer in range(layers)
                  for e in range(experts) if rng.random() < 0.8}
    rng.shuffle(ops)
    return ops, popularity
