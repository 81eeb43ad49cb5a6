"""The expert index of a checkpoint: for every expert of every MoE layer, the checkpoint
holding its newest version (built at save, read to plan the next save)."""

import os
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import (MANIFEST_FILE, ExpertVersion, Manifest,
                                           read_manifest_json)
from deepspeed_ext.format.naming import check_tag, expert_key, parse_expert_key
from deepspeed_ext.policy.pec import check_scope



def build_expert_index(previous: Optional[Manifest], saved_experts: Iterable[Tuple[int, int]],
                       step: int, tag: str, num_moe_layers: int,
                       num_experts: int, scope: str = "wo") -> Dict[str, ExpertVersion]:
    """The expert index of a new checkpoint (rank 0, before :func:`~deepspeed_ext.format.assemble.assemble_manifest`).

    Args:
        previous: manifest of the checkpoint this run's state descends from (the newest
            one saved by this run, or the one it resumed from); None for the first.
        saved_experts: ``(moe_layer, expert)`` pairs PEC selected: this checkpoint holds
            all their tensors.
        step, tag: of the new checkpoint.
        num_moe_layers, num_experts: the model's MoE layers and experts per layer.
        scope: the PEC variant (``--moc-pec-scope``); with ``w`` this checkpoint also
            holds every expert's optimizer state, with ``o`` every expert's weights.

    Returns:
        ``previous``'s index with the saved experts, and the parts saved for every
        expert, now pointing at ``(step, tag)``.

    Raises:
        ValueError: an expert out of range, ``previous`` newer than ``step`` or with
            experts beyond the model (a different model), or an expert that no
            checkpoint holds (the first checkpoint must save every expert; otherwise
            a restart would have no weights for it).
    """
    check_tag(tag)
    index: Dict[str, ExpertVersion] = {}
    if previous is not None:
        if previous.step > step:
            raise ValueError(f"previous checkpoint {previous.tag} is at step {previous.step}, "
                             f"after the new step {step}")
        index = {k: ExpertVersion(v.step, v.tag, v.optim_step, v.optim_tag)
                 for k, v in previous.expert_index.items()}
    valid = {expert_key(l, e) for l in range(num_moe_layers) for e in range(num_experts)}
    outside = sorted(set(index) - valid)
    if outside:
        raise ValueError(f"previous checkpoint {previous.tag} indexes experts {outside[:5]} "
                         f"outside {num_moe_layers} MoE layers x {num_experts} experts; "
                         f"it belongs to a different model")
    saved = set()
    for layer, expert in saved_experts:
        key = expert_key(layer, expert)
        if key not in valid:
            raise ValueError(f"saved expert {key} is outside {num_moe_layers} MoE layers x "
                             f"{num_experts} experts")
        saved.add(key)
        index[key] = ExpertVersion(step=step, tag=tag)
    _index_whole_part(index, saved, scope, (step, tag))
    missing = sorted(valid - set(index), key=parse_expert_key)
    if missing:
        raise ValueError(f"experts {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                         f"({len(missing)} in all) are saved in no checkpoint; the first "
                         f"checkpoint must hold every expert")
    return dict(sorted(index.items(), key=lambda kv: parse_expert_key(kv[0])))


def _index_whole_part(index: Dict[str, ExpertVersion], saved: Set[str], scope: str,
                      here: Tuple[int, str]) -> None:
    """Under a one-part PEC scope, point the part saved for every expert at ``here``.

    An expert never saved before stays absent: its other part exists nowhere, and the
    caller reports it as missing.
    """
    if check_scope(scope) == "wo":
        return
    for key, old in index.items():
        if key in saved:
            continue
        if scope == "w":  # weights partial: the optimizer state is always saved
            index[key] = ExpertVersion.of_parts(old.part("w"), here)
        else:             # optimizer state partial: the weights are always saved
            index[key] = ExpertVersion.of_parts(here, old.part("o"))


# ------------------------------------------------------------------ manifest on disk

def read_expert_versions(ckpt_dir: str) -> Tuple[int, Dict[Tuple[int, int], int]]:
    """``(step, {(layer, expert): step of its newest whole version})`` of one checkpoint
    (the older part's step when weights and optimizer state differ), from
    its manifest without the full type check of :func:`~deepspeed_ext.format.manifest.read_manifest` (which takes tens
    of milliseconds on large manifests). For deciding where to read from, not for
    loading: a load through :class:`deepspeed_ext.store.reader.CheckpointReader` checks all.

    Raises:
        CheckpointError: the manifest is missing, unreadable, or lacks these fields.
    """
    path = os.path.join(ckpt_dir, MANIFEST_FILE)
    try:
        data = read_manifest_json(ckpt_dir)
        return _int(data["step"]), {parse_expert_key(k): min(_int(v["step"]), _int(
                                        (v.get("optim") or v)["step"]))
                                    for k, v in data.get("expert_index", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            MemoryError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


def _int(value: Any) -> int:
    """A step read from JSON: ``int("7")`` and ``int(7.9)`` would pass a damaged one."""
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value

