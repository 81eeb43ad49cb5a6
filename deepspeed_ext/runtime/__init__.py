"""The process-level layer under the checkpoint library: what every module of
``deepspeed_ext`` shares about the process it runs in rather than about checkpoints.

Modules: ``log`` (the library's output through :mod:`logging`: module loggers under
``deepspeed_ext``, a stdout default for a process that configured none), ``retry`` (the
one polling loop with backoff). They import nothing of the layers above them, so any
module of the package may import them.
"""
