"""The checks of ``scripts/gpu_check.py`` (run by ``scripts/gpu_check.sh``), one module per
group: :mod:`.unit_tests` (``cuda_unit_tests``), :mod:`.ranks` (``ranks_per_gpu``),
:mod:`.bandwidth` (``snapshot_bandwidth`` and the pinned reference), :mod:`.recovery`
(``memory_recovery``, ``exact_replay``), :mod:`.stall` (``checkpoint_stall``,
``checkpoint_stall_large``); :mod:`.common` is what every check uses (the capped run, the
result record, the corpus), :mod:`.summary` the JSON summary and its lines, :mod:`.runner`
the list of checks and the loop that runs them.

A package of ``scripts/``, not of the project: ``gpu_check.py`` puts ``scripts/`` on
``sys.path``, so the GPU machine needs nothing installed for it.
"""
