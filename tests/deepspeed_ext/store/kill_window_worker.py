"""A node keeper with seeded faults in its persist/commit steps (test_kill_window).

``python kill_window_worker.py SEED KILL_AT -- <keeper arguments>``: before every call of
the commit steps below it sleeps a random moment (up to 20 ms, from ``SEED``), widening
the races between the keeper, the training side and readers; ``KILL_AT`` is
``step:when:n`` (or ``-``): SIGKILL this keeper ``when`` (``before``/``after``) the n-th
call of that step.
"""

import os
import random
import signal
import sys


def main() -> int:
    seed, kill_at = int(sys.argv[1]), sys.argv[2]
    from deepspeed_ext import keeper
    from deepspeed_ext.store import commit, retention
    rng = random.Random(seed)
    target = kill_at.split(":") if kill_at != "-" else None
    calls = {}

    def faulty(module, name):
        real = getattr(module, name)

        def step(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            due = target is not None and target[0] == name and int(target[2]) == calls[name]
            import time
            time.sleep(rng.uniform(0, 0.02))
            if due and target[1] == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if due:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        setattr(module, name, step)

    # Each where the committer looks it up: commit.py imports its steps by name.
    for module, name in ((commit, "write_report"), (commit, "write_manifest"),
                         (commit, "advance_latest"), (commit, "retain_unless_superseded"),
                         (retention, "remove_checkpoint")):
        faulty(module, name)
    return keeper.main(sys.argv[sys.argv.index("--") + 1:])


if __name__ == "__main__":
    sys.exit(main())
