"""The process-level layer under the checkpoint library: what every module of
``deepspeed_ext`` shares about the process it runs in rather than about checkpoints.

Modules: ``log`` (the library's output through :mod:`logging`: module loggers under
``deepspeed_ext``, a stdout default for a process that configured none), ``retry`` (the
one polling loop with backoff), ``groups`` (the process groups the library's collectives
run on: the gloo metadata group, per-host groups) and ``exchange`` (the snapshot's one
collective: every rank's small value in one ``all_gather`` on the metadata group).

May import: the standard library and torch only. Nothing of the layers above
(:mod:`deepspeed_ext.policy`, ``format``, ``store``, ``engine``, the rest), so any module
of the package may import these (``tests/test_layering.py`` checks it).
"""
