"""The scaffolding around every benchmark script's measurement: the command line and the
machine it prints, the output directory (or the error that refuses the one given), the
command line of its ranks, the choice between launcher and rank, and the exit.

A multi-rank benchmark's script ends with::

    def main() -> int:
        return launch.launcher_or_worker(build_parser().parse_args(), worker_main,
                                         launcher_main)

    if __name__ == "__main__":
        launch.exit_after(main)

Launcher side: :func:`command_line`, :func:`print_header`, :func:`out_dir_or_error`,
:func:`worker_argv`; both sides: :func:`launcher_or_worker`, :func:`exit_after`.
"""

import os
import platform
import shlex
import sys

from benchlib import host, ranks


def command_line() -> str:
    """How this process was started, quoted as a shell takes it back: the header's
    ``command:`` line and the ``command`` of the JSON output, so that a result says how
    to run it again."""
    return shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))


def print_header(title: str, command: str) -> None:
    """The first lines of a benchmark's output: its title, ``command:`` and ``machine:``
    (cores, platform, Python/torch/DeepSpeed versions)."""
    print(title)
    print(f"command: {command}")
    print(f"machine: {os.cpu_count()} CPU cores, {platform.platform()}, {host.versions()}")


def out_dir_or_error(out_dir, prefix: str):
    """:func:`benchlib.ranks.prepare_out_dir`, or None after printing why ``--out-dir``
    is refused (``error: ...`` on stderr; the launcher then returns 2 before it starts any
    rank, so a non-empty directory of the user's is never emptied at the end)."""
    try:
        return ranks.prepare_out_dir(out_dir, prefix)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def job_run_setup(opts, prefix: str, error: str = None):
    """The start of a benchmark that runs training jobs on the quickstart's corpus:
    ``error`` (a refused option) or a refused ``--out-dir`` printed as ``error: ...``
    (returns None: the script exits 2), else ``(out, created, data, command)``: the
    output directory, whether it was made here, the corpus prefix (prepared from
    ``opts.data_prefix`` if missing) and the command line."""
    if error:
        print(f"error: {error}", file=sys.stderr)
        return None
    prepared = out_dir_or_error(opts.out_dir, prefix)
    if prepared is None:
        return None
    from megatron.data.stdlib_corpus import prepare_stdlib_corpus
    out, created = prepared
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = prepare_stdlib_corpus(os.path.join(repo, opts.data_prefix))
    return out, created, data, command_line()


def worker_argv(script: str, out_dir: str, opts, flags, shm_root: str = None) -> list:
    """The command line of ``script``'s ranks: ``--worker --out-dir OUT_DIR``, then
    ``--shm-root`` if given, then each of ``flags`` (names of ``opts``) with the value the
    launcher parsed, so every rank runs with the launcher's options."""
    argv = [sys.executable, os.path.abspath(script), "--worker", "--out-dir", out_dir]
    if shm_root is not None:
        argv += ["--shm-root", shm_root]
    for name in flags:
        argv += ["--" + name.replace("_", "-"), str(getattr(opts, name))]
    return argv


def launcher_or_worker(opts, worker_main, launcher_main) -> int:
    """A rank (``--worker``, started by the launcher): ``worker_main(opts)``, then 0; else
    the launcher: ``launcher_main(opts)``'s exit status."""
    if opts.worker:
        worker_main(opts)
        return 0
    return launcher_main(opts)


def exit_after(main) -> None:
    """Run ``main`` (the repository on ``sys.path`` first) and end the process with its
    status through the trainer's ``exit_without_teardown``, not ``sys.exit``: a rank's
    clean end must not turn into a teardown abort (-6) of a gloo or DeepSpeed thread."""
    sys.path.insert(0, ranks.REPO)
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(main())
