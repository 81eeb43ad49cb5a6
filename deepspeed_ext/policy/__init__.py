"""Pure policy: what to save, who writes it, what a loss costs, how snapshots are spread.

Plain dataclasses built by deterministic functions of their inputs: every rank computes
the same plan from the same inputs without communicating. No file I/O, no
``torch.distributed``, no collective; ``redundancy`` alone touches tensors (XOR parity
of host buffers).

Modules: :mod:`.pec` (which experts a checkpoint holds, PEC scopes and parts),
:mod:`.plan` (the write plan: which rank writes which piece), :mod:`.plt` (the lost-token
ledger and dynamic K), :mod:`.redundancy` (node loss: placement, XOR parity, rebuild
plans), :mod:`.operators` (exact recovery's operators and their snapshot order) and
:mod:`.window` (the frame schedule, window choice and replay plan).

May import: :mod:`deepspeed_ext.runtime` (nothing of it is needed today) and each other;
never :mod:`deepspeed_ext.format`, :mod:`deepspeed_ext.store` or anything above them
(``tests/test_layering.py`` checks it).
"""
