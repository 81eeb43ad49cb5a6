"""The keeper's wire protocol: JSON lines over the Unix socket ``<dir>/keeper.sock``.

Both sides use it: a training process sends one request per connection
(:func:`request`) and the keeper (:mod:`deepspeed_ext.keeper.server`) answers it with
one JSON object carrying ``"ok"``. Never pickle: nothing read from the socket is executed.
Stdlib only, so that a rank or the keeper importing it never waits for torch.
"""

import json
import os
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

SOCKET_NAME = "keeper.sock"
LOG_NAME = "keeper.log"
LOCK_NAME = "keeper.lock"
MAX_MESSAGE_BYTES = 256 << 20
"""Longest request or reply (a persist job lists every tensor of a rank's image: about
200 bytes each). A longer one is cut off and refused: a client that never ends its
line must not grow the keeper's memory without bound."""
CONNECTION_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long is closed (one thread per connection:
clients that open connections and go silent must not pile threads up)."""
SUN_PATH_MAX = 107
"""Longest Unix socket path Linux accepts (``sun_path`` is 108 bytes with its NUL)."""


class KeeperError(RuntimeError):
    """The keeper could not be started or reached."""


def read_line(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """Bytes from ``sock`` up to and including the first newline (a protocol message),
    or what came before the peer closed (no newline then).

    Raises:
        KeeperError: more than ``limit`` bytes came without a newline.
    """
    parts: List[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > limit:
            raise KeeperError(f"a message longer than {limit} bytes")
    return b"".join(parts)


def socket_path(directory: str) -> str:
    """The keeper's socket in ``directory``.

    Raises:
        KeeperError: the path is too long for a Unix socket (the bind would fail, and a
            rank would wait its whole start timeout for a keeper that never ran).
    """
    path = os.path.join(directory, SOCKET_NAME)
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise KeeperError(f"the keeper's socket {path} is {len(os.fsencode(path))} bytes long; "
                          f"Unix sockets allow {SUN_PATH_MAX}: choose a shorter --moc-shm-dir")
    return path


def peer_credentials(sock: socket.socket) -> Optional[Tuple[int, int, int]]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (Linux's
    ``SO_PEERCRED``); None where the platform has no such option."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def request(directory: str, message: Dict[str, Any], timeout_s: float = 10.0) -> Dict[str, Any]:
    """Send one request to the keeper of ``directory`` and return its reply.

    Raises:
        KeeperError: no keeper listens there (it died or was never started), or it
            answered with an error.
    """
    path = socket_path(directory)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(json.dumps(message).encode() + b"\n")
            data = read_line(sock)
    except OSError as err:
        raise KeeperError(f"no keeper at {path}: {err}") from None
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        raise KeeperError(f"keeper at {path} sent a malformed reply") from None
    if not isinstance(reply, dict):
        raise KeeperError(f"keeper at {path} sent a malformed reply")
    if not reply.get("ok"):
        raise KeeperError(f"keeper at {path}: {reply.get('error')}")
    return reply
