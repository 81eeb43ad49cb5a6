"""``--moc-restart`` and ``--moc-spares``: how the job comes back from a failed process,
with their own checks (:func:`check_restart`, called by ``validate_args`` on every rank
before any collective)."""

import argparse
import os

from megatron.errors import ConfigError

RESTART_MODES = ("relaunch", "in-job")


def add_restart_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("in-job restart")
    g.add_argument("--moc-restart", choices=RESTART_MODES, default="relaunch",
                   help="relaunch: a failed process ends the job's processes and the "
                        "launcher starts them again (torchrun, launch_cluster.sh); in-job: "
                        "the survivors keep their processes and memory, a hot spare takes "
                        "the failed rank's place and training goes on from the snapshots "
                        "(needs MoC's supervisor: scripts/run_elastic.sh passes it on).")
    g.add_argument("--moc-spares", type=int, default=0,
                   help="--moc-restart in-job: how many of the launched processes wait as "
                        "hot spares (the last ones of the launch); read by "
                        "scripts/run_elastic.sh, which starts the supervisor.")
    g.add_argument("--moc-refill-spares", action="store_true",
                   help="--moc-restart in-job: after each recovery, start a new process in "
                        "the dead one's slot as a waiting spare (a later failure is recovered "
                        "in place too, up to the supervisor's --max-rounds); read by "
                        "scripts/run_elastic.sh.")


def check_restart(args: argparse.Namespace, world_size: int) -> None:
    """Refuse a restart setting that cannot work, naming the flag.

    ``world_size`` counts the training ranks (the spares are not in it).
    """
    spares = args.moc_spares
    if spares < 0:
        raise ConfigError(f"--moc-spares must be >= 0, got {spares}")
    if args.moc_restart != "in-job":
        if spares:
            raise ConfigError("--moc-spares needs --moc-restart in-job (a relaunch starts "
                              "every process again and has no use for spares)")
        if getattr(args, "moc_refill_spares", False):
            raise ConfigError("--moc-refill-spares needs --moc-restart in-job (the spares it "
                              "refills are the in-job restart's)")
        return
    from deepspeed_ext.runtime.rounds import STORE_ENV
    if not os.environ.get(STORE_ENV):
        raise ConfigError("--moc-restart in-job needs MoC's supervisor, which keeps the job's "
                          "store and lets the survivors live (bash scripts/run_elastic.sh "
                          "NPROC 0 ... --moc-restart in-job [--moc-spares N]); torchrun's "
                          "agent and the deepspeed launcher stop every process when one dies")
    if not (args.moc_checkpoint and args.save and args.load == args.save):
        raise ConfigError("--moc-restart in-job needs --moc-checkpoint and --load equal to "
                          "--save (each round resumes from the newest checkpoint there)")
