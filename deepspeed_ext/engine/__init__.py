"""What a DeepSpeed engine holds, as the checkpoint library sees it.

A rank's engine carries the model's parameters (fp32 masters and the compute copies),
the optimizer's moments and scalars, the fp16 loss scaler, its step counters, and the
process's random-number generators. This package captures and restores that state;
today it holds :mod:`deepspeed_ext.engine.rng` (every generator a rank draws from),
and the trainer imports its RNG handling from here, so the library never imports the
trainer.
"""
