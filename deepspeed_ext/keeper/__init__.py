"""The per-node keeper: owns the snapshot memory of a node and persists it in the background.

One keeper process runs per node (per ``--moc-ranks-per-node`` group when nodes are
simulated on one machine). It is separate from the training processes, so a training
process that crashes (a software failure) loses nothing: its snapshots stay in the
keeper's directory in shared memory (``/dev/shm``), and the restarted process finds them
there. The keeper also writes snapshots to storage, so training never waits for storage.

Lifecycle:

* :func:`ensure_keeper` is called by every rank of the node at start-up; the first one
  to get the directory lock starts the keeper when nothing listens on its socket
  (``python -c <bootstrap> ... deepspeed_ext.keeper --dir ...``, see
  :data:`~deepspeed_ext.keeper.bootstrap.BOOTSTRAP`, in a new session so the launcher's
  kill of the workers does not reach it); the others wait until it answers. A keeper that is only
  slow to answer is waited for: a second keeper would take over the socket, and the
  first would later delete the directory under it.
* Every rank registers its pid (``hello``). The keeper exits on its own when none of
  its registered processes has been alive for ``idle_timeout_s`` (a crashed job
  whose launcher gave up), after finishing its persist queue.
* :func:`shutdown_keeper` (end of training) finishes the queue and the job's commits,
  deletes the whole directory and stops the keeper, and returns once the keeper's
  process has exited: no shared memory is left behind, and nothing of the job is still
  writing when the training process returns. A keeper whose job died (no shutdown) may
  still finish its persists and commits later, under the same rules (manifest before
  ``latest``, claims, :func:`deepspeed_ext.store.latest.advance_latest`).

Protocol: JSON lines over the Unix socket ``<dir>/keeper.sock`` (never pickle). Requests:
``{"op": "ping"}``, ``{"op": "hello", "pid": N}``, ``{"op": "persist", "job": {...}}``
(see :func:`~deepspeed_ext.keeper.persist.run_persist_job`; a job with an ``id`` already
queued is not queued again), ``{"op": "drain", "attempt_started": T}`` (answered once
every queued job and the commits :func:`~deepspeed_ext.keeper.commits.commits_to_finish`
names are done: :func:`drain_keeper`), ``{"op": "shutdown", "attempt_started": T}``; a keeper
started for a job (``--run-id``) answers the last four only when they carry that
``run_id``. Every reply is a JSON object with ``"ok"``.

Trust: the directory is private (mode 0700, this user's: :mod:`deepspeed_ext.private_dir`)
and bound to one job (:mod:`deepspeed_ext.job_identity`); a connection from another
user's process is dropped (``SO_PEERCRED``); a request is at most
:data:`MAX_MESSAGE_BYTES` and must arrive within :data:`CONNECTION_TIMEOUT_S`; a persist
job whose paths leave the keeper's directory or the job's save directory is refused
(:mod:`deepspeed_ext.keeper.job_checks`); liveness counts only this user's processes; and a
snapshot is persisted only if its memory checksum still matches.

Modules, one concept each (lower ones never import higher ones):

* :mod:`~deepspeed_ext.keeper.protocol` the socket's JSON lines, names and limits;
* :mod:`~deepspeed_ext.keeper.paths` where a job's node directories and keeper sockets are
  (and the socket path's length check);
  :mod:`~deepspeed_ext.keeper.log` the keeper's log lines;
  :mod:`~deepspeed_ext.keeper.lock` the node directory's lock;
* :mod:`~deepspeed_ext.keeper.client` what trainers ask of a running keeper;
  :mod:`~deepspeed_ext.keeper.bootstrap` starting it (``ensure_keeper``);
* :mod:`~deepspeed_ext.keeper.job_checks` what a keeper accepts as a job;
  :mod:`~deepspeed_ext.keeper.faults` its ``persist-crash`` fault point;
  :mod:`~deepspeed_ext.keeper.persist` running a job;
  :mod:`~deepspeed_ext.keeper.commits` its background commits and their gate;
* :mod:`~deepspeed_ext.keeper.server` the keeper process (``python -m deepspeed_ext.keeper``).

This package re-exports what callers outside it use.
"""

# Everything here is stdlib-only at import time: a rank, and the keeper process answering
# its first ping, never wait for torch (persist and commits import it inside functions).
from deepspeed_ext.keeper.bootstrap import BOOTSTRAP, claim_node_dir, ensure_keeper, spawn
from deepspeed_ext.keeper.client import (HAND_OVER_BACKOFF, PROCESS_TOKEN, alive, deletable,
                                         drain_keeper, hand_over, has_exited, is_dead, job_id,
                                         keeper_pid, shutdown_keeper)
from deepspeed_ext.keeper.commits import (CommitGate, CommitRun, commit_job, commits_to_finish,
                                          drain_commits, join_finishing_commits)
from deepspeed_ext.keeper.job_checks import JobRefused, check_job, inside
from deepspeed_ext.keeper.lock import lock_node
from deepspeed_ext.keeper.log import keeper_log, logger
from deepspeed_ext.keeper.paths import (SocketPathTooLong, check_keeper_socket_path,  # noqa: F401
                                      keeper_socket_path, node_directory)
from deepspeed_ext.keeper.persist import (HANG_PERSIST_ENV, copied_marker, persist_frame,
                                          persist_share, run_persist_job, write_image_subset)
from deepspeed_ext.keeper.protocol import (CONNECTION_TIMEOUT_S, LOCK_NAME, LOG_NAME,
                                           MAX_MESSAGE_BYTES, SOCKET_NAME, SUN_PATH_MAX,
                                           KeeperError, peer_credentials, read_line, request,
                                           socket_path)
from deepspeed_ext.keeper.server import (RECENT_JOB_IDS, Keeper, leave, main, serve,
                                         serve_connection)
