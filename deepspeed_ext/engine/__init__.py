"""What a DeepSpeed engine holds, as the checkpoint library sees it.

A rank's engine carries the model's parameters (fp32 masters and the compute copies),
the optimizer's moments and scalars, the fp16 loss scaler, its step counters, and the
process's random-number generators. This package captures and restores that state;
today it holds :mod:`deepspeed_ext.engine.rng` (every generator a rank draws from;
the trainer imports its RNG handling from here, so the library never imports the
trainer) and :mod:`deepspeed_ext.engine.hostcopy` (the device-to-host copies of that
state into a snapshot's image, and the wait an optimizer step makes for them) and
:mod:`deepspeed_ext.engine.stages` (a pipeline stage's parameter names, MoE layer
ordinals and ranks in the whole model's terms).

May import: :mod:`deepspeed_ext.runtime`, :mod:`deepspeed_ext.policy`,
:mod:`deepspeed_ext.format` and :mod:`deepspeed_ext.store`; nothing above (the
checkpointer, the snapshots, the keeper), as ``tests/test_layering.py`` checks.
"""
