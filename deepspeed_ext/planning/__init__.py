"""Planning fault tolerance for clusters we cannot run here (``moc-plan``).

* :mod:`.costs`: the model (parameters, layout, hardware figures) and, per checkpoint
  policy, its costs: bytes, snapshot/persist time, stall, recovery time, lost work, PLT,
  and the analytic effective training time ratio (ETTR).
* :mod:`.simulate`: replays failure processes (exponential MTBF or a trace) over a long
  run, per policy, with seeds and confidence intervals.
* :mod:`.search`: the best settings of each policy family for a cluster and MTBF.
* :mod:`.calibrate`: hardware figures measured on this machine or read from a
  benchmark's JSON.
* :mod:`.cli`: the ``moc-plan`` command (``recommend``, ``simulate``, ``calibrate``).

Everything but :mod:`.calibrate` and the CLI's output is pure.
"""
