"""``moc-ckpt``: inspect, verify and consolidate MoC checkpoints without DeepSpeed.

Examples::

    moc-ckpt inspect  checkpoints/                 # every checkpoint, expert ages
    moc-ckpt verify   checkpoints/ [--tag T]       # exit 1 on any problem
    moc-ckpt consolidate checkpoints/ --out model.safetensors [--optimizer]
    moc-ckpt densify  checkpoints/ --out dense/    # exact-mode frames -> a checkpoint
    moc-ckpt densify  checkpoints/ --out dense/ -- --config my.yaml --data-path ...

Exit status: 0 fine, 1 a checkpoint has problems (verify, consolidate), 2 bad input
(missing directory, unknown tag, bad arguments).

One module per subcommand (:mod:`~deepspeed_ext.cli.inspection`,
:mod:`~deepspeed_ext.cli.verify`, :mod:`~deepspeed_ext.cli.consolidate`,
:mod:`~deepspeed_ext.cli.densify` with :mod:`~deepspeed_ext.cli.replay_flags`), what they
share in :mod:`~deepspeed_ext.cli.common`, the parser and entry points in
:mod:`~deepspeed_ext.cli.main` (the console script is ``deepspeed_ext.cli:main_cli``).
"""

from deepspeed_ext.cli.common import UsageError
from deepspeed_ext.cli.consolidate import WEIGHTS_KIND, cmd_consolidate
from deepspeed_ext.cli.densify import (cmd_densify, entry_point, hostfile_slots,
                                       replay_launcher)
from deepspeed_ext.cli.inspection import cmd_inspect
from deepspeed_ext.cli.main import build_parser, main, main_cli
from deepspeed_ext.cli.replay_flags import (ENTRY_POINT, MAX_CONFIG_BYTES,
                                            MAX_RECORDED_TOKENS, MAX_TOKEN_CHARS)
from deepspeed_ext.cli.verify import LATEST_READS, cmd_verify

__all__ = ["ENTRY_POINT", "LATEST_READS", "MAX_CONFIG_BYTES", "MAX_RECORDED_TOKENS",
           "MAX_TOKEN_CHARS", "WEIGHTS_KIND", "UsageError", "build_parser",
           "cmd_consolidate", "cmd_densify", "cmd_inspect", "cmd_verify", "entry_point",
           "hostfile_slots", "main", "main_cli", "replay_launcher"]
