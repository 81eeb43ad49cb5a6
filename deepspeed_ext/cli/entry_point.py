"""This project's training entry point as a program the command-line tools ask questions
(``moc-ckpt densify``: a replay's flags; ``moc-plan``: a config's model shape).

The checkpoint library never imports the trainer: a tool that needs the trainer's parser
runs ``python pretrain_gpt_moe.py --<question>`` with one JSON request on stdin and reads
one JSON line back (exit status 0: the answer; 2: ``{"error": message}``, the trainer's
own message naming the flag or file to fix).
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

ENTRY_POINT = "pretrain_gpt_moe.py"
"""The training entry point, beside the ``deepspeed_ext`` package (repository or install)."""


def find_entry_point(name: str, purpose: str, error: type) -> str:
    """The path of this project's ``name`` beside the ``deepspeed_ext`` package.

    Raises:
        error: it is not there; the message says what it is needed for (``purpose``).
    """
    import deepspeed_ext
    root = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_ext.__file__)))
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        raise error(f"cannot find this project's {name} in {root} (beside deepspeed_ext/), "
                    f"which {purpose}; reinstall MoC (pip install -e . in its repository)")
    return path


@dataclass(frozen=True)
class EntryPointReply:
    """What the entry point answered."""

    status: int
    """Its exit status."""
    reply: Any
    """The JSON value on its last non-empty stdout line (a library may print a banner on
    import before it); None when there is none."""
    tail: str
    """The end of its stderr (else stdout), for a message when the reply is unusable."""

    @property
    def error(self) -> Optional[str]:
        """The trainer's refusal (exit status 2 with ``{"error": message}``), else None."""
        if self.status == 2 and isinstance(self.reply, dict) \
                and isinstance(self.reply.get("error"), str):
            return self.reply["error"]
        return None


def ask_entry_point(script: str, question: str, request: Dict[str, Any],
                    timeout_s: float) -> EntryPointReply:
    """Run ``python script question`` in the current directory (a relative path in the
    request resolves from there) with ``request`` as JSON on stdin.

    Raises:
        OSError, subprocess.TimeoutExpired: it did not start or did not end in time.
    """
    done = subprocess.run([sys.executable, script, question], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in (done.stdout or "").splitlines() if line.strip()]
    try:
        reply = json.loads(lines[-1]) if lines else None
    except ValueError:
        reply = None
    tail = ((done.stderr or "").strip() or (done.stdout or "").strip())[-2000:]
    return EntryPointReply(done.returncode, reply, tail)
