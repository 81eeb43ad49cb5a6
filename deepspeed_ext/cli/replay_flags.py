"""The training flags densify replays with: those a frame marker records, checked, or
those the user gives after ``--``.

Nothing a checkpoint records is run: the recorded command must start with this project's
entry point (dropped), every word is a known ``--flag`` of the trainer's parser with
plain values, a recorded ``--config`` file is read and checked here (not by the
replay), and flags that name code are refused. The only module of the library that
imports the trainer (``megatron``): its argument parser is the list of known flags.
"""

import argparse
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_ext.cli.common import UsageError

ENTRY_POINT = "pretrain_gpt_moe.py"
"""The training script densify replays with: this project's own, beside ``deepspeed_ext/``
(never one a checkpoint names)."""

_ENTRY_POINT_NAMES = (ENTRY_POINT, "moc-pretrain")
"""What a frame marker's recorded command may start with (dropped, never run): this
project's entry point, as a script or as its console script."""

MAX_RECORDED_TOKENS = 4096
MAX_TOKEN_CHARS = 4096
"""Bounds of a frame marker's recorded command (and of each of its words)."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest ``--config`` YAML file densify reads from a recorded command."""

_DENSIFY_SETS = {"load": "--load", "save": "--save", "moc_shm_dir": "--moc-shm-dir",
                 "exit_interval": "--exit-interval"}
"""Flags (by destination) densify sets itself: removed from the recorded ones."""

_NOT_REPLAYED = ("moc_fault", "moc_fault_mtbf", "moc_fault_seed", "local_rank")
"""Recorded flags densify leaves out: fault injection (a fault would fire again in the
replay) and the launcher's rank."""

_REFUSED = {"deepspeed_config": "a DeepSpeed config reaches DeepSpeed unchecked and can make "
                                "it import the Python modules it names"}
"""Recorded flags (by destination) that name code or what loads code: never taken from a
checkpoint, only from the user (after ``--``)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUMBER = re.compile(r"^-\.?\d")


def _training_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import build_parser
    return build_parser()


def _long_options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """The ``--flag`` names of the training parser (not --help), to their action."""
    return {opt: action for action in parser._actions
            if not isinstance(action, argparse._HelpAction)
            for opt in action.option_strings if opt.startswith("--")}


def _check_word(word: str, where: str) -> None:
    if _CONTROL.search(word):
        raise UsageError(f"{where}: {word!r} holds a control character")
    if len(word) > MAX_TOKEN_CHARS:
        raise UsageError(f"{where}: a word of {len(word)} characters (at most "
                         f"{MAX_TOKEN_CHARS})")


def recorded_command(record: object, marker: str) -> Tuple[List[str], Optional[str]]:
    """The recorded command and working directory of a frame marker, type-checked
    (:func:`deepspeed_ext.cli.densify.cmd_densify` calls it, then :func:`stored_flags`).

    Raises:
        UsageError: naming ``marker``, when either is missing or malformed.
    """
    if not isinstance(record, dict):
        raise UsageError(f"{marker} is not a frame marker (a JSON object)")
    command, cwd = record.get("command"), record.get("cwd")
    if not command:
        raise UsageError(f"{marker} does not record the training command (frames written "
                         f"by {ENTRY_POINT} do)")
    if not isinstance(command, list) or not all(isinstance(w, str) for w in command):
        raise UsageError(f"{marker}: the recorded \"command\" is not a list of strings")
    if len(command) > MAX_RECORDED_TOKENS:
        raise UsageError(f"{marker}: the recorded \"command\" has {len(command)} words "
                         f"(at most {MAX_RECORDED_TOKENS})")
    for word in command:
        _check_word(word, f"{marker}: the recorded \"command\"")
    if cwd is not None:
        if not isinstance(cwd, str):
            raise UsageError(f"{marker}: the recorded \"cwd\" is not a string")
        _check_word(cwd, f"{marker}: the recorded \"cwd\"")
    return command, cwd


def _flag_groups(words: Sequence[str], options: Dict[str, argparse.Action],
                 where: str) -> List[Tuple[str, argparse.Action, List[str]]]:
    """``words`` (flags only) as (flag word, its action, its values), checked: every flag
    a ``--flag`` of the training parser, every value a plain string."""
    groups: List[Tuple[str, argparse.Action, List[str]]] = []
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            action = options.get(name)
            if action is None:
                raise UsageError(f"{where}: unknown flag {name!r} ({ENTRY_POINT} has no "
                                 f"such flag)")
            groups.append((word, action, [value] if eq else []))
        elif not groups:
            raise UsageError(f"{where}: {word!r} where a flag should be")
        elif word.startswith("-") and not _NUMBER.match(word):
            raise UsageError(f"{where}: {groups[-1][1].option_strings[0]} has the value "
                             f"{word!r}, which is no plain value")
        else:
            groups[-1][2].append(word)
    for word, action, values in groups:
        if action.nargs == 0 and values:
            raise UsageError(f"{where}: {word.partition('=')[0]} takes no value, but has "
                             f"{values[0]!r}")
    return groups


def stored_flags(command: List[str], marker: str) -> Tuple[List[str], List[str]]:
    """The training flags of a recorded command, to replay with this project's entry
    point: the leading script dropped, every ``--config`` file replaced by the flags it
    stands for (read and checked now, not by the replay), densify's own flags removed
    (:func:`deepspeed_ext.cli.densify.cmd_densify` calls it when no flags follow ``--``).

    Returns:
        (the flags, the names of recorded flags left out that the user should know of).

    Raises:
        UsageError: naming the flag and the file it came from, for anything that is not
            a known flag with plain values, a flag that names code, or a command that
            starts with something other than this project's entry point.
    """
    where = f"the command recorded in {marker}"
    first = _check_lead(command, where)
    parser = _training_parser()
    options = _long_options(parser)
    from_files: List[str] = []
    flags: List[str] = []
    left_out: List[str] = []
    groups = _flag_groups(command[first:], options, where)
    for word, action, values in groups:
        if action.dest != "config":
            continue
        if len(values) != 1:
            raise UsageError(f"{where}: --config takes one file, got {len(values)}")
        source = f"{values[0]} (--config recorded in {marker})"
        _keep(_config_groups(values[0], parser, options, marker, source), source,
              from_files, left_out)
    _keep([g for g in groups if g[1].dest != "config"], where, flags, left_out)
    # As pretrain_gpt_moe.py parses them: the files' flags first, the command's win.
    flags = from_files + flags
    if len(flags) > MAX_RECORDED_TOKENS:
        raise UsageError(f"{where}: {len(flags)} words with its --config files (at most "
                         f"{MAX_RECORDED_TOKENS})")
    return flags, sorted(set(left_out))


def _check_lead(command: List[str], where: str) -> int:
    """The index of the recorded command's first ``--flag``; what comes before it must be
    this project's entry point (a script, its console script, or ``-m`` and its module).

    Raises:
        UsageError: anything else leads the command.
    """
    first = next((i for i, w in enumerate(command) if w.startswith("--")), len(command))
    lead = command[:first]
    if not (lead == [] or (len(lead) == 1 and os.path.basename(lead[0]) in _ENTRY_POINT_NAMES)
            or lead == ["-m", ENTRY_POINT[:-len(".py")]]):
        raise UsageError(f"{where} starts with {' '.join(map(repr, lead))}, not this "
                         f"project's {ENTRY_POINT}")
    return first


def _config_groups(path: str, parser: argparse.ArgumentParser,
                   options: Dict[str, argparse.Action], marker: str,
                   source: str) -> List[Tuple[str, argparse.Action, List[str]]]:
    """The flags a recorded ``--config`` file stands for, read and checked now (not by
    the replay), as :func:`_flag_groups` gives them.

    Raises:
        UsageError: naming ``path`` and ``marker``: not a regular file, too large, or
            not a config the trainer reads; or naming ``source``: a word or flag
            :func:`_check_word` or :func:`_flag_groups` refuses.
    """
    from megatron.training.arguments import yaml_to_argv
    from megatron.training.errors import ConfigError
    try:
        if not os.path.isfile(path):  # not a device or a pipe that never ends
            raise ConfigError("not a file")
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes")
        file_argv = yaml_to_argv(path, parser)
    except (ConfigError, OSError, UnicodeDecodeError, RecursionError) as err:
        hint = ("" if os.path.isabs(path) else
                f" (a relative path, resolved from the current directory {os.getcwd()})")
        raise UsageError(f"--config {path}{hint}, recorded in {marker}: {err}") from None
    for file_word in file_argv:
        _check_word(file_word, source)
    return _flag_groups(file_argv, options, source)


def _keep(groups: Sequence[Tuple[str, argparse.Action, List[str]]], source: str,
          out: List[str], left_out: List[str]) -> None:
    """Append the flags of ``groups`` to replay to ``out``: densify's own dropped, those
    it never replays named in ``left_out``.

    Raises:
        UsageError: naming ``source``, for a flag that names code (:data:`_REFUSED`).
    """
    for word, action, values in groups:
        name = word.partition("=")[0]
        if action.dest in _REFUSED:
            raise UsageError(f"{source}: {name}: {_REFUSED[action.dest]}, so densify "
                             f"does not take it from a checkpoint")
        if action.dest in _DENSIFY_SETS:
            continue
        if action.dest in _NOT_REPLAYED:
            left_out.append(name)
            continue
        out += [word, *values]


def user_flags(words: List[str]) -> List[str]:
    """The training flags given after ``--`` (the user vouches for them), checked only
    for what densify sets itself (:func:`deepspeed_ext.cli.densify.cmd_densify` calls it
    instead of :func:`stored_flags`)."""
    if not words:
        raise UsageError("nothing after --: give the training flags there, or leave -- out "
                         "to replay with the flags the frames record")
    options = _long_options(_training_parser())
    for word in words:
        if "\x00" in word:
            raise UsageError(f"after --: {word!r} holds a NUL character")
        action = options.get(word.partition("=")[0]) if word.startswith("--") else None
        if action is not None and action.dest in _DENSIFY_SETS:
            raise UsageError(f"after --: densify sets {', '.join(_DENSIFY_SETS.values())} "
                             f"itself (--out is the replay's --save); leave "
                             f"{word.partition('=')[0]} out")
    return list(words)
