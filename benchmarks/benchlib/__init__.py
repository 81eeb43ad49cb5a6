"""Helpers shared by the benchmark drivers in ``benchmarks/`` (each driver is a script:
``python benchmarks/<name>.py``; its directory is on ``sys.path``, so ``benchlib`` imports).

* :mod:`benchlib.ranks`: starting local rank processes, their collectives, results files
  and output directories;
* :mod:`benchlib.launch`: what every script does around its measurement (the header, the
  output directory or its error, the ranks' command line, worker or launcher, the exit);
* :mod:`benchlib.model`: the benchmarks' GPT-MoE DeepSpeed engine and its synthetic batches;
* :mod:`benchlib.host`: the machine (versions, filesystems) and the files under a directory;
* :mod:`benchlib.tables`: printing the result tables;
* :mod:`benchlib.stamped_job`: a training job run as a command, its output lines stamped
  with arrival times, killed whole after a timeout, its keepers and memory cleaned up
  (exact_bench and restart_bench);
* ``two_level_*`` and ``exact_*``: the parts of ``two_level_bench.py`` and
  ``exact_bench.py`` (the systems' peers, log parsing, the tables).
"""
