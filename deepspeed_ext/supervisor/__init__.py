"""The per-node supervisor of an in-job restart (``python -m deepspeed_ext.supervisor``):
it starts the training processes and the hot spares, keeps the job's store, and when one
process dies hands its rank to a spare in a new recovery round
(:mod:`deepspeed_ext.runtime.rounds`) instead of stopping the survivors.

Modules: :mod:`~deepspeed_ext.supervisor.options` (the command line, checked before
anything starts), :mod:`~deepspeed_ext.supervisor.children` (the processes: environment,
exits, stop), :mod:`~deepspeed_ext.supervisor.store` (the store it serves and the round
writes), :mod:`~deepspeed_ext.supervisor.job` (the watch: rounds, the job's end) and
:mod:`~deepspeed_ext.supervisor.main` (the entry point). One node for now; the options
keep room for one supervisor per node (docs/failures.md).
"""
