"""Which of a failed run's process groups outlive its teardown, and what holds them: a
diagnostic for the in-job restart's one known rare failure.

A survivor leaving a failed round destroys its groups and frees the run's objects
(``in_job.free_run_objects``); only when a group object is gone does gloo close its
connections, and only then does a peer still blocked in a collective of that group get an
error and leave the round too. In about one of 40 seeded trials a peer stayed blocked in
round 0's ZeRO gradient all-reduce (docs/failures.md), so some reference kept a group
alive. ``ProcessGroupGloo.abort()`` does not close the connections either (measured: a
peer's ``recv`` waited out its full timeout), so the reference itself must be found.

Every survivor, in order: :func:`group_refs` before the run's groups are destroyed,
:func:`outlived` after its objects are freed, and one line with :func:`describe` when a
group outlived them. Best effort: the groups are listed through torch's private registry
of this process's groups (``distributed_c10d._world.pg_map``); when that is not there, no
group is watched and nothing is said.
"""

import gc
import weakref
from typing import List

MAX_REFERRERS = 4
"""At most this many holders named per surviving group."""


def group_refs() -> List[weakref.ref]:
    """Weak references to every process group this process has now (none when torch's
    registry cannot be read)."""
    import torch.distributed as dist
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    refs = []
    for group in groups:
        try:
            refs.append(weakref.ref(group))
        except TypeError:  # a group type without weak references: not watched
            continue
    return refs


def outlived(refs: List[weakref.ref]) -> list:
    """The groups of ``refs`` still alive."""
    return [group for group in (ref() for ref in refs) if group is not None]


def describe(groups: list) -> str:
    """The surviving ``groups`` and what holds each: the holder's type and, for a dict,
    the keys it keeps the group under (a module's globals name the variable)."""
    parts = []
    for group in groups:
        holders = []
        for holder in gc.get_referrers(group)[:MAX_REFERRERS]:
            if isinstance(holder, dict):
                keys = [str(k) for k, v in holder.items() if v is group][:2]
                holders.append(f"dict[{', '.join(keys)}]")
            elif type(holder).__name__ == "cell":  # a closure's variable: name its function
                owners = [f.__qualname__ for cells in gc.get_referrers(holder)
                          if isinstance(cells, tuple) for f in gc.get_referrers(cells)
                          if getattr(f, "__closure__", None) is cells][:2]
                holders.append(f"a closure of {', '.join(owners) or 'an unknown function'}")
            elif not isinstance(holder, list):  # this function's own list of groups
                holders.append(type(holder).__name__)
        size = group.size() if hasattr(group, "size") else "?"
        parts.append(f"a group of {size} rank(s) held by {', '.join(holders) or 'nothing traced'}")
    return "; ".join(parts)
