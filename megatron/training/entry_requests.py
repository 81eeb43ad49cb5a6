"""The trainer's entry point answering a tool's JSON question on stdin with one JSON
line on stdout (``pretrain_gpt_moe.py --check-replay-flags``, ``--model-shape``): the
wire rules both share. The asking side is ``deepspeed_ext/cli/entry_point.py``.
"""

import json
from typing import Callable, Dict, TextIO

from megatron.errors import ConfigError


def request_object(text: str) -> Dict:
    """The JSON object a request's ``text`` holds (its fields are checked by the caller).

    Raises:
        ConfigError: ``text`` is not JSON.
    """
    try:
        return json.loads(text)
    except ValueError as err:
        raise ConfigError(f"the request on stdin is not JSON ({err})") from None


def answer_request(stdin: TextIO, stdout: TextIO, handle: Callable[[str], Dict]) -> int:
    """Read the whole request from ``stdin``, write ``handle``'s reply as one JSON line
    and return 0; a :class:`ConfigError` becomes ``{"error": message}`` and its exit code
    (the message names the flag or file to fix). Nothing else is written on stdout."""
    try:
        reply, status = handle(stdin.read()), 0
    except ConfigError as err:
        reply, status = {"error": str(err)}, ConfigError.exit_code
    stdout.write(json.dumps(reply) + "\n")
    stdout.flush()
    return status
