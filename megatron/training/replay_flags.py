"""The trainer's answer to ``moc-ckpt densify``: which training flags a replay may run
with, checked against this trainer's own parser.

densify (:mod:`deepspeed_ext.cli.replay_flags`, which defines the exchange) runs this
project's ``pretrain_gpt_moe.py --check-replay-flags`` with one JSON request on stdin;
the entry point calls :func:`answer`, which writes one JSON answer on stdout and returns
the exit status. The checkpoint library so calls a program instead of importing the
trainer, and the flags are judged by the program the replay will run.

A recorded command's flags (``kind`` "recorded", the leading script already dropped by
densify) are data from a checkpoint: every word must be a known ``--flag`` with plain
values; a ``--config`` file is read and checked now (not by the replay) and replaced by
the flags it stands for; flags that name code are refused; fault injection and the
launcher's rank are left out, and the flags densify sets itself dropped. The user's own
flags (``kind`` "given") are only searched for the flags densify sets itself.
"""

import argparse
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, NamedTuple, Sequence, Set, TextIO

from megatron.errors import ConfigError
from megatron.training.entry_requests import answer_request, request_object

ENTRY_POINT = "pretrain_gpt_moe.py"
"""The program these flags are for (named in the messages)."""

_NOT_REPLAYED = ("moc_fault", "moc_fault_mtbf", "moc_fault_seed", "local_rank")
"""Recorded flags (by destination) a replay leaves out: fault injection (a fault would
fire again in the replay) and the launcher's rank."""

_REFUSED = {"deepspeed_config": "a DeepSpeed config reaches DeepSpeed unchecked and can make "
                                "it import the Python modules it names"}
"""Recorded flags (by destination) that name code or what loads code: never taken from a
checkpoint, only from the user (after ``--``)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUMBER = re.compile(r"^-\.?\d")


@dataclass(frozen=True)
class ReplayRequest:
    """What densify asks (one JSON object on stdin), checked by :meth:`from_json`."""

    kind: str
    """Either ``recorded`` (flags from a frame marker) or ``given`` (the user's, after
    ``--``)."""
    words: List[str]
    """The flags and their values, without the script."""
    marker: str
    """The frame marker the recorded flags come from (named in the messages)."""
    densify_sets: List[str]
    """The flags densify sets itself (``--load``, ``--save``, ...)."""
    max_word_chars: int
    """The longest word a ``--config`` file may give."""
    max_config_bytes: int
    """The largest ``--config`` file read."""

    @classmethod
    def from_json(cls, text: str) -> "ReplayRequest":
        """The request in ``text``.

        Raises:
            ConfigError: not a JSON object with these fields of these types.
        """
        data = request_object(text)
        lists = ("words", "densify_sets")
        ints = ("max_word_chars", "max_config_bytes")
        if not (isinstance(data, dict) and data.get("kind") in ("recorded", "given")
                and isinstance(data.get("marker"), str)
                and all(isinstance(data.get(k), list) and
                        all(isinstance(w, str) for w in data[k]) for k in lists)
                and all(type(data.get(k)) is int and data[k] > 0 for k in ints)):
            raise ConfigError("the request on stdin is not a replay-flags request "
                              "(moc-ckpt densify writes those)")
        return cls(**{k: data[k] for k in ("kind", "marker", *lists, *ints)})


@dataclass(frozen=True)
class ReplayFlags:
    """The answer (one JSON object on stdout, exit status 0)."""

    flags: List[str]
    """The flags to replay with: recorded ones checked, ``--config`` files expanded."""
    left_out: List[str] = field(default_factory=list)
    """Recorded flags left out that the user should know of (sorted names)."""
    densify_sets: List[str] = field(default_factory=list)
    """Given flags naming one densify sets itself (their names, in order)."""


class _FlagGroup(NamedTuple):
    word: str
    """The flag as written (``--lr`` or ``--lr=0.1``)."""
    action: argparse.Action
    values: List[str]


def _long_options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """The ``--flag`` names of the training parser (not --help), to their action.
    argparse lists a parser's actions only in ``_actions`` (yaml_to_argv reads it too)."""
    return {opt: action for action in parser._actions if action.dest != "help"
            for opt in action.option_strings if opt.startswith("--")}


def _check_word(word: str, where: str, max_chars: int) -> None:
    if _CONTROL.search(word):
        raise ConfigError(f"{where}: {word!r} holds a control character")
    if len(word) > max_chars:
        raise ConfigError(f"{where}: a word of {len(word)} characters (at most {max_chars})")


def _flag_groups(words: Sequence[str], options: Dict[str, argparse.Action],
                 where: str) -> List[_FlagGroup]:
    """``words`` (flags only) as flag groups, checked: every flag a ``--flag`` of the
    training parser, every value a plain string."""
    groups: List[_FlagGroup] = []
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            action = options.get(name)
            if action is None:
                raise ConfigError(f"{where}: unknown flag {name!r} ({ENTRY_POINT} has no "
                                  f"such flag)")
            groups.append(_FlagGroup(word, action, [value] if eq else []))
        elif not groups:
            raise ConfigError(f"{where}: {word!r} where a flag should be")
        elif word.startswith("-") and not _NUMBER.match(word):
            raise ConfigError(f"{where}: {groups[-1].action.option_strings[0]} has the value "
                              f"{word!r}, which is no plain value")
        else:
            groups[-1].values.append(word)
    for group in groups:
        if group.action.nargs == 0 and group.values:
            raise ConfigError(f"{where}: {group.word.partition('=')[0]} takes no value, but "
                              f"has {group.values[0]!r}")
    return groups


def _densify_dests(request: ReplayRequest, options: Dict[str, argparse.Action]) -> Set[str]:
    """The destinations of the flags densify sets itself.

    Raises:
        ConfigError: densify sets a flag this parser does not know.
    """
    unknown = [f for f in request.densify_sets if f not in options]
    if unknown:
        raise ConfigError(f"densify sets {', '.join(unknown)}, which {ENTRY_POINT} does not "
                          f"know: densify and the trainer are from different versions")
    return {options[f].dest for f in request.densify_sets}


def recorded_flags(request: ReplayRequest, parser: argparse.ArgumentParser) -> ReplayFlags:
    """The flags of a recorded command (``request.kind`` "recorded"), to replay with:
    every ``--config`` file replaced by the flags it stands for (read and checked now, not
    by the replay), densify's own flags removed (:func:`answer` calls it).

    Raises:
        ConfigError: naming the flag and the file it came from, for anything that is not
            a known flag with plain values, or a flag that names code.
    """
    where = f"the command recorded in {request.marker}"
    options = _long_options(parser)
    own = _densify_dests(request, options)
    from_files: List[str] = []
    flags: List[str] = []
    left_out: List[str] = []
    groups = _flag_groups(request.words, options, where)
    for group in groups:
        if group.action.dest != "config":
            continue
        if len(group.values) != 1:
            raise ConfigError(f"{where}: --config takes one file, got {len(group.values)}")
        path = group.values[0]
        source = f"{path} (--config recorded in {request.marker})"
        _keep(_config_groups(path, parser, options, request, source), source, own,
              from_files, left_out)
    _keep([g for g in groups if g.action.dest != "config"], where, own, flags, left_out)
    # As pretrain_gpt_moe.py parses them: the files' flags first, the command's win.
    return ReplayFlags(from_files + flags, sorted(set(left_out)))


def _config_groups(path: str, parser: argparse.ArgumentParser,
                   options: Dict[str, argparse.Action], request: ReplayRequest,
                   source: str) -> List[_FlagGroup]:
    """The flags a recorded ``--config`` file stands for, read and checked now (not by
    the replay), as :func:`_flag_groups` gives them.

    Raises:
        ConfigError: naming ``path`` and the marker: not a regular file, too large, or
            not a config the trainer reads; or naming ``source``: a word or flag
            :func:`_check_word` or :func:`_flag_groups` refuses.
    """
    from megatron.training.arguments import yaml_to_argv
    try:
        if not os.path.isfile(path):  # not a device or a pipe that never ends
            raise ConfigError("not a file")
        if os.path.getsize(path) > request.max_config_bytes:
            raise ConfigError(f"larger than {request.max_config_bytes} bytes")
        file_argv = yaml_to_argv(path, parser)
    except (ConfigError, OSError, UnicodeDecodeError, RecursionError) as err:
        hint = ("" if os.path.isabs(path) else
                f" (a relative path, resolved from the current directory {os.getcwd()})")
        raise ConfigError(f"--config {path}{hint}, recorded in {request.marker}: "
                          f"{err}") from None
    for file_word in file_argv:
        _check_word(file_word, source, request.max_word_chars)
    return _flag_groups(file_argv, options, source)


def _keep(groups: Sequence[_FlagGroup], source: str, own: Set[str], out: List[str],
          left_out: List[str]) -> None:
    """Append the flags of ``groups`` to replay to ``out``: densify's own (``own``, by
    destination) dropped, those never replayed named in ``left_out``.

    Raises:
        ConfigError: naming ``source``, for a flag that names code (:data:`_REFUSED`).
    """
    for group in groups:
        name, dest = group.word.partition("=")[0], group.action.dest
        if dest in _REFUSED:
            raise ConfigError(f"{source}: {name}: {_REFUSED[dest]}, so densify does not take "
                              f"it from a checkpoint")
        if dest in own:
            continue
        if dest in _NOT_REPLAYED:
            left_out.append(name)
            continue
        out += [group.word, *group.values]


def given_flags(request: ReplayRequest, parser: argparse.ArgumentParser) -> ReplayFlags:
    """The user's flags (``request.kind`` "given"), unchanged, with the names of those
    that set what densify sets itself (:func:`answer` calls it; densify refuses them)."""
    options = _long_options(parser)
    own = _densify_dests(request, options)
    clashes = []
    for word in request.words:
        name = word.partition("=")[0]
        action = options.get(name) if word.startswith("--") else None
        if action is not None and action.dest in own:
            clashes.append(name)
    return ReplayFlags(list(request.words), densify_sets=clashes)


def answer(stdin: TextIO, stdout: TextIO) -> int:
    """Read densify's request from ``stdin`` and write the answer on ``stdout`` as one
    JSON line: the :class:`ReplayFlags` (returns 0), or ``{"error": message}`` naming
    the flag and file to fix (returns :attr:`ConfigError.exit_code`). Run by
    ``pretrain_gpt_moe.py --check-replay-flags``, in densify's working directory (a
    relative ``--config`` resolves from there, as in the replay)."""
    from megatron.training.arguments import build_parser

    def handle(text: str) -> dict:
        request = ReplayRequest.from_json(text)
        check = recorded_flags if request.kind == "recorded" else given_flags
        return asdict(check(request, build_parser()))

    return answer_request(stdin, stdout, handle)
