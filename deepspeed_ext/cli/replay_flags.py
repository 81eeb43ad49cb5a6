"""The training flags densify replays with: those a frame marker records, checked, or
those the user gives after ``--``.

Nothing a checkpoint records is run. Checked here: a frame marker's command is a list of
plain words within bounds that starts with this project's entry point (dropped, never
run). The flags themselves are checked by that entry point, the program the replay will
run, so that the library never imports the trainer (``megatron``): :func:`ask_trainer`
runs this project's ``pretrain_gpt_moe.py --check-replay-flags`` with one JSON request on
stdin and reads its JSON answer. The trainer (``megatron.training.replay_flags``) checks
that every word is one of its flags with plain values, reads and checks a recorded
``--config`` file now (not the replay) and replaces it by its flags, refuses flags that
name code, leaves out fault injection and drops the flags densify sets itself.

The exchange, defined here (the trainer implements it):

- request: ``{"kind": "recorded" | "given", "words": [...], "marker": str,
  "densify_sets": [...], "max_word_chars": int, "max_config_bytes": int}``;
- answer, the last line on stdout: exit status 0 and ``{"flags": [...], "left_out":
  [...], "densify_sets": [...]}``, or exit status 2 and ``{"error": str}``, a message
  naming the flag and the file to fix.
"""

import os
import re
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Tuple

from deepspeed_ext.cli.common import UsageError
from deepspeed_ext.cli.entry_point import ENTRY_POINT, ask_entry_point
"""The training script densify replays with: this project's own, beside ``deepspeed_ext/``
(never one a checkpoint names)."""

CHECK_REPLAY_FLAGS = "--check-replay-flags"
"""The entry point's only argument when densify asks it to check flags (the trainer's
``pretrain_gpt_moe.CHECK_REPLAY_FLAGS``; a test checks they agree)."""

CHECK_TIMEOUT_S = 300.0
"""How long the entry point may take to answer (it imports no torch: well under a
second); a hung file system does not hang densify."""

_ENTRY_POINT_NAMES = (ENTRY_POINT, "moc-pretrain")
"""What a frame marker's recorded command may start with (dropped, never run): this
project's entry point, as a script or as its console script."""

MAX_RECORDED_TOKENS = 4096
MAX_TOKEN_CHARS = 4096
"""Bounds of a frame marker's recorded command (and of each of its words)."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest ``--config`` YAML file densify has the trainer read from a recorded
command."""

DENSIFY_SETS = ("--load", "--save", "--moc-shm-dir", "--exit-interval")
"""Flags densify sets itself: removed from the recorded ones, refused after ``--``."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ReplayCheckUnavailable(UsageError):
    """The entry point gave no answer to the flag check (it failed, or is of another
    version): not a problem of the flags, so densify does not suggest other ones."""


@dataclass(frozen=True)
class TrainerAnswer:
    """The entry point's answer to one request (:func:`ask_trainer`), type-checked."""

    flags: List[str]
    """The flags to replay with (recorded ones checked, ``--config`` files expanded)."""
    left_out: List[str]
    """Names of recorded flags left out that the user should know of."""
    densify_sets: List[str]
    """Names of given flags that set what densify sets itself."""


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


def stored_flags(command: List[str], marker: str, script: str) -> Tuple[List[str], List[str]]:
    """The training flags of a recorded command, to replay with this project's entry
    point ``script``: the leading script dropped, the flags checked by ``script``
    (:func:`ask_trainer`: every ``--config`` file replaced by the flags it stands for,
    read and checked now, not by the replay; densify's own flags removed)
    (:func:`deepspeed_ext.cli.densify.cmd_densify` calls it when no flags follow ``--``).

    Returns:
        (the flags, the names of recorded flags left out that the user should know of).

    Raises:
        UsageError: naming the flag and the file it came from, for anything that is not
            a known flag with plain values, a flag that names code, or a command that
            starts with something other than this project's entry point.
        ReplayCheckUnavailable: ``script`` gave no answer.
    """
    where = f"the command recorded in {marker}"
    first = _check_lead(command, where)
    answer = ask_trainer(script, "recorded", command[first:], marker)
    if len(answer.flags) > MAX_RECORDED_TOKENS:
        raise UsageError(f"{where}: {len(answer.flags)} words with its --config files (at "
                         f"most {MAX_RECORDED_TOKENS})")
    for word in answer.flags:  # checked by the trainer already; these reach the replay
        _check_word(word, where)
    return answer.flags, sorted(set(answer.left_out))


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


def user_flags(words: List[str], script: str) -> List[str]:
    """The training flags given after ``--`` (the user vouches for them), checked by
    ``script`` only for what densify sets itself
    (:func:`deepspeed_ext.cli.densify.cmd_densify` calls it instead of
    :func:`stored_flags`).

    Raises:
        UsageError: nothing after ``--``, a NUL character, or a flag densify sets.
        ReplayCheckUnavailable: ``script`` gave no answer.
    """
    if not words:
        raise UsageError("nothing after --: give the training flags there, or leave -- out "
                         "to replay with the flags the frames record")
    for word in words:
        if "\x00" in word:
            raise UsageError(f"after --: {word!r} holds a NUL character")
    clashes = ask_trainer(script, "given", words, marker="").densify_sets
    if clashes:
        raise UsageError(f"after --: densify sets {', '.join(DENSIFY_SETS)} itself (--out "
                         f"is the replay's --save); leave {clashes[0]} out")
    return list(words)


def ask_trainer(script: str, kind: str, words: List[str], marker: str) -> TrainerAnswer:
    """Have this project's entry point ``script`` check ``words`` (``kind`` "recorded":
    from ``marker``; "given": after ``--``): runs ``python script --check-replay-flags``
    in the current directory (a relative ``--config`` resolves from there, as in the
    replay), the request on its stdin.

    Raises:
        UsageError: the entry point refused the flags (its message, exit status 2).
        ReplayCheckUnavailable: it did not start, timed out, or gave no valid answer.
    """
    request = {"kind": kind, "words": list(words), "marker": marker,
               "densify_sets": list(DENSIFY_SETS), "max_word_chars": MAX_TOKEN_CHARS,
               "max_config_bytes": MAX_CONFIG_BYTES}
    what = f"{script} {CHECK_REPLAY_FLAGS}"
    try:
        done = ask_entry_point(script, CHECK_REPLAY_FLAGS, request, CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ReplayCheckUnavailable(f"{what} could not check the training flags "
                                     f"({err})") from None
    if done.error is not None:
        raise UsageError(done.error)
    answer = _typed_answer(done.reply) if done.status == 0 else None
    if answer is None:
        raise ReplayCheckUnavailable(f"{what} gave no answer to the flag check (exit status "
                                     f"{done.status}){': ' + done.tail if done.tail else ''}")
    return answer


def _typed_answer(reply: object) -> Optional[TrainerAnswer]:
    """``reply`` as a :class:`TrainerAnswer`; None unless each field is a list of
    strings."""
    names = ("flags", "left_out", "densify_sets")
    if not isinstance(reply, dict) or not all(
            isinstance(reply.get(name), list) and all(isinstance(w, str) for w in reply[name])
            for name in names):
        return None
    return TrainerAnswer(*(list(reply[name]) for name in names))
