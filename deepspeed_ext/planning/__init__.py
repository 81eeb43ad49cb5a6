"""Planning fault tolerance for clusters we cannot run here (``moc-plan``).

* :mod:`.costs`: the model (parameters, layout, hardware figures) and, per checkpoint
  policy, its costs: bytes, snapshot/persist time, stall, recovery time, lost work, PLT,
  and the analytic effective training time ratio (ETTR).
* :mod:`.simulate`: replays failure processes (exponential MTBF or a trace) over a long
  run, per policy, with seeds and confidence intervals.
* :mod:`.restart`: the in-job restart's phases against a relaunch, and its hot spares
  (which failures are recovered in place, when spares come back).
* :mod:`.search`: the best settings of each policy family for a cluster and MTBF, and
  whether spares pay (a relaunch against an in-job restart with spare nodes).
* :mod:`.calibrate`: hardware figures measured on this machine or read from a
  benchmark's JSON.
* :mod:`.cli`: the ``moc-plan`` command (``recommend``, ``simulate``, ``calibrate``);
  :mod:`.restart_cli` its in-job restart flags and lines, :mod:`.tables` its tables.

Everything but :mod:`.calibrate` and the CLI's output is pure.
"""
