"""The rule of ``deepspeed_ext.runtime.groups``, checked two ways by ``test_groups.py``: the
project's code hands no CPU tensor or Python object to the training's device group.

* :func:`scan` reads the sources: every ``torch.distributed`` collective called by the
  project must name its group (``group=``, not None or the default group), unless the
  call site is in :data:`DEFAULT_GROUP_CALLS`;
* :func:`install_guard` wraps ``torch.distributed``'s collectives in a running job and
  records every call from the project's code that runs on the default group (no
  ``group``, None or ``dist.group.WORLD``) outside :data:`DEFAULT_GROUP_CALLS`. With
  ``deepspeed_ext.runtime.groups.separate_on_gloo`` set, the metadata group is a group of its
  own on CPU too, as on an NCCL job, so the two can be told apart.
"""

import ast
import os
import sys
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

PROJECT = ("deepspeed_ext", "megatron", "benchmarks", "tools", "pretrain_gpt_moe.py")
"""The project's code (paths relative to the repository); tests are not."""

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "barrier", "monitored_barrier", "gather", "scatter",
               "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "send_object_list", "recv_object_list", "new_group", "new_subgroups")
"""``torch.distributed`` functions that talk to other ranks (``new_group`` too: creating
a group is a collective, and every group of the project is made in ``groups.py``)."""

DEFAULT_GROUP_CALLS: Dict[Tuple[str, str, str], Tuple[int, str]] = {
    # -- device tensors: the training's own group is right ------------------------------
    ("megatron/training/step.py", "train_step", "all_reduce"):
        (1, "losses summed on engine.device"),
    ("megatron/training/step.py", "evaluate", "all_reduce"):
        (1, "validation loss on engine.device"),
    ("megatron/training/fault_tolerance.py", "FaultTolerance.after_step", "all_reduce"):
        (1, "the gate counts, on the model's device"),
    ("megatron/training/pipeline.py", "_loss_parts", "all_reduce"):
        (1, "the pipeline's losses on engine.device"),
    ("megatron/data/gpt_dataset.py", "_all_ranks_agree", "all_reduce"):
        (1, "on the current CUDA device when the backend is NCCL"),
    # -- the home of the project's groups -----------------------------------------------
    ("deepspeed_ext/runtime/groups.py", "init_metadata_group", "new_group"):
        (1, "the metadata group itself (every rank, at known points)"),
    ("deepspeed_ext/runtime/groups.py", "new_training_group", "new_group"):
        (1, "a group of device tensors on the training's backend (the MoE schedules')"),
    ("deepspeed_ext/runtime/groups.py", "new_host_group", "new_group"):
        (1, "a component's own gloo group (peers.py, two_level_bench's DCP uploads)"),
}
"""``(path, function's qualified name, collective) -> (calls there, why)``: the call
sites allowed on the default group. A new one needs an entry and a reason."""


def project_files(root: str = REPO) -> List[str]:
    """The project's Python sources, relative to ``root``."""
    out = []
    for top in PROJECT:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            out.append(top)
            continue
        for dirpath, dirnames, names in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.relpath(os.path.join(dirpath, n), root)
                    for n in sorted(names) if n.endswith(".py")]
    return out


def _is_dist(node: ast.AST, aliases: set) -> bool:
    """``dist`` (any name ``torch.distributed`` was imported as) or ``torch.distributed``."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _default_group(node: ast.AST, aliases: set) -> bool:
    """``None``, ``dist.group.WORLD`` or ``_get_default_group()``: the default group."""
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.Attribute) and node.attr == "WORLD":
        return True
    return isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
        node.func, "id", None)) == "_get_default_group"


def calls_on_default_group(source: str, path: str = "<source>") -> List[Tuple[str, str, int]]:
    """``(function's qualified name, collective, line)`` of every collective in
    ``source`` that names no group (or the default one); a collective imported by
    name (``from torch.distributed import all_reduce``) counts at its import."""
    tree = ast.parse(source, path)
    aliases = {"dist"}
    found: List[Tuple[str, str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [("<import>", a.name, node.lineno) for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}

    def visit(node: ast.AST, scope: List[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, scope + [child.name, "<locals>"])
            elif isinstance(child, ast.ClassDef):
                visit(child, scope + [child.name])
            else:
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                        and child.func.attr in COLLECTIVES and _is_dist(child.func.value, aliases)):
                    group = next((k.value for k in child.keywords if k.arg == "group"), None)
                    if group is None or _default_group(group, aliases):
                        name = ".".join(scope)
                        name = name[:-len(".<locals>")] if name.endswith(".<locals>") else name
                        found.append((name or "<module>", child.func.attr, child.lineno))
                visit(child, scope)

    visit(tree, [])
    return found


def scan(root: str = REPO) -> Dict[Tuple[str, str, str], List[int]]:
    """Every call site of the project on the default group: ``(path, function,
    collective) -> [lines]``."""
    out: Dict[Tuple[str, str, str], List[int]] = {}
    for path in project_files(root):
        with open(os.path.join(root, path)) as f:
            source = f.read()
        for function, collective, line in calls_on_default_group(source, path):
            out.setdefault((path, function, collective), []).append(line)
    return out


def violations(found: Dict[Tuple[str, str, str], List[int]]) -> List[str]:
    """What :func:`scan` found beyond :data:`DEFAULT_GROUP_CALLS`."""
    bad = []
    for key, lines in sorted(found.items()):
        allowed = DEFAULT_GROUP_CALLS.get(key, (0, ""))[0]
        if len(lines) > allowed:
            fix = ("make groups in deepspeed_ext.runtime.groups" if key[2].startswith("new_")
                   else "pass group=metadata_group() (deepspeed_ext.runtime.groups)")
            bad.append(f"{key[0]}:{','.join(map(str, lines))} {key[1]}: dist.{key[2]} on the "
                       f"default group ({len(lines)} call(s), {allowed} allowed): {fix}")
    return bad


# -- the guard, in a running job ---------------------------------------------------------

def _project_caller(frame) -> Tuple[str, str]:
    """``(path, qualified function)`` of the project code that called a wrapped
    collective, skipping wrappers (the monitor's collective clock); ``("", "")`` when the
    caller is not the project's (DeepSpeed, torch)."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        rel = os.path.relpath(path, REPO)
        if rel == os.path.join("megatron", "training", "monitor", "clock.py") and \
                frame.f_code.co_name == "timed":
            frame = frame.f_back
            continue
        if not rel.startswith("..") and not rel.startswith(".venv") and \
                any(rel == top or rel.startswith(top + os.sep) for top in PROJECT):
            return rel, getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        return "", ""
    return "", ""


def install_guard(record, seen: Optional[Dict[str, int]] = None) -> None:
    """Wrap ``torch.distributed``'s collectives: a call from the project's code on the
    default group, at a call site :data:`DEFAULT_GROUP_CALLS` does not allow, is passed
    to ``record(message)`` (and still runs: every rank reaches it, so raising would only
    hide the others). ``seen["own_group"]`` counts the project's calls on another group."""
    import functools

    import torch.distributed as dist

    def wrap(name, fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            path, function = _project_caller(sys._getframe(1))
            if path:
                group = kwargs.get("group")
                if group is None or group is dist.group.WORLD:
                    if (path, function, name) not in DEFAULT_GROUP_CALLS:
                        record(f"{path} {function}: dist.{name} on the default group")
                elif seen is not None:
                    seen["own_group"] = seen.get("own_group", 0) + 1
            return fn(*args, **kwargs)
        return guarded

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and name not in ("new_group", "new_subgroups"):
            setattr(dist, name, wrap(name, fn))
