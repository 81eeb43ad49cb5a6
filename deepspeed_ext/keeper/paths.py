"""Where a job's keepers live: ``<shm dir>/node<N>/``, one directory per node, each with
its keeper's socket ``keeper.sock``.

The trainer checks the longest of these socket paths before training
(:func:`check_keeper_socket_path`, on every rank, before any collective): a path longer
than a Unix socket allows fails only inside the keeper's bind, and the ranks would then
wait their whole start timeout for a keeper that never ran. Stdlib only, like
:mod:`~deepspeed_ext.keeper.protocol`.
"""

import os

from deepspeed_ext.keeper.protocol import SOCKET_NAME, SUN_PATH_MAX


class SocketPathTooLong(ValueError):
    """A shared-memory directory leaves no room for a keeper's socket path; the message
    names the flag, the path, its length and the limit."""


def node_directory(shm_dir: str, node: int) -> str:
    """The directory of node ``node`` under the job's shared-memory directory
    (``<shm dir>/node<N>``): its keeper's socket, log and lock, and the node's memory."""
    return os.path.join(shm_dir, f"node{node}")


def keeper_socket_path(shm_dir: str, node: int) -> str:
    """The Unix socket the keeper of node ``node`` listens on under the job's shared-memory
    directory (``<shm dir>/node<N>/keeper.sock``)."""
    return os.path.join(node_directory(shm_dir, node), SOCKET_NAME)


def check_keeper_socket_path(shm_dir: str, max_node: int, flag: str = "--moc-shm-dir") -> None:
    """Refuse a shared-memory directory whose keeper socket path (for the node with the
    largest index, ``max_node``) is longer than a Unix socket path may be.

    Raises:
        SocketPathTooLong: naming ``flag``, the socket path's length and the limit.
    """
    path = keeper_socket_path(shm_dir, max_node)
    length = len(os.fsencode(path))
    if length > SUN_PATH_MAX:
        raise SocketPathTooLong(
            f"{flag} {shm_dir} is too long: the keeper of node {max_node} would listen on "
            f"{path}, {length} bytes, and a Unix socket path holds at most {SUN_PATH_MAX}; "
            f"use a directory at least {length - SUN_PATH_MAX} bytes shorter")
