"""A rank of the trainer (``pretrain_gpt_moe.py ARGS...``) under the group guard of
``group_rules.py``: the metadata group is a group of its own, as on an NCCL job, and
every collective the project's code runs on the default group outside the allowed call
sites is appended to ``$MOC_GROUP_GUARD_OUT/rank<R>.txt``; at the end, ``rank<R>.json``
counts the project's collectives on a group of their own (the guard saw them)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

from tests.deepspeed_ext.runtime import group_rules  # noqa: E402


def main() -> int:
    out, rank = os.environ["MOC_GROUP_GUARD_OUT"], os.environ["RANK"]
    try:
        from deepspeed_ext.runtime import groups
        groups.separate_on_gloo = True  # as on NCCL: the default group is the device's
    except ImportError:  # a tree from before deepspeed_ext.runtime.groups: everything is default
        pass
    seen = {"own_group": 0}

    def record(message: str) -> None:
        with open(os.path.join(out, f"rank{rank}.txt"), "a") as f:
            f.write(message + "\n")

    group_rules.install_guard(record, seen)
    import pretrain_gpt_moe
    code = pretrain_gpt_moe.main(sys.argv[1:])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    return code


if __name__ == "__main__":
    code = main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(code)
