"""What a snapshot holds and how its bytes are laid out, cached between snapshots
(:mod:`deepspeed_ext.two_level`): describing hundreds of fragments, their manifest
specs, the image layout and its copy plan took milliseconds of every save call.

Cached per state (the fragments, until a load replaces the tensors), per set of
snapshotted experts (which fragments, in the order of their sources: ZeRO's flat
partitions) and per layout (the image, its metadata entries, the copy plan and the id
under which its static metadata is published once)."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch

from deepspeed_ext.session import CheckpointSession
from deepspeed_ext.state import FP32

LAYOUT_CACHE = 16
"""Image layouts a rank keeps (one per set of snapshotted experts and object shapes)."""


def layout_signature(fragments, world: int) -> str:
    """Identifies the layout a snapshot can be restored into (same master-weight
    fragments, so the same with or without the optimizer's moments described)."""
    text = json.dumps([(f.key, f.length) for f in fragments if f.kind == FP32] + [world])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ExpertSetContent:
    """The fragments of one set of snapshotted experts, in the order of their sources."""

    tensors: Dict[str, torch.Tensor]
    """Fragment key -> tensor (never modified: the save call copies it before adding
    the objects' tensors)."""
    specs: Dict[str, Dict[str, Any]]
    """Fragment key -> manifest spec."""


@dataclass(frozen=True)
class CachedLayout:
    """One snapshot layout: the image, its metadata entries, its copy plan, its id."""

    image: Any
    """:class:`deepspeed_ext.format.image.ImageLayout`."""
    entries: List[Dict[str, Any]]
    """The image's records as the slot metadata holds them (shared, never modified)."""
    plan: Any
    """:class:`deepspeed_ext.format.copy_plan.CopyPlan` of the image."""
    layout_id: str
    """Names the static metadata (entries, specs) published once for this layout."""


class SnapshotLayouts:
    """This rank's fragments, their specs and image layouts, described once per state."""

    def __init__(self, session: CheckpointSession, world: int):
        self.session = session
        self.world = world
        self._specs: Dict[tuple, Dict[str, Any]] = {}
        self._described: Optional[tuple] = None
        """(state identity, fragments, signature, rows) of the last snapshot (:meth:`fragments`)."""
        self._contents: Dict[Optional[FrozenSet], ExpertSetContent] = {}
        """Snapshotted experts -> their fragments (:meth:`content`)."""
        self._layouts: Dict[tuple, CachedLayout] = {}
        """(experts, object keys/shapes/dtypes) -> layout (:meth:`layout`)."""

    def signature(self, fragments) -> str:
        """:func:`layout_signature` of ``fragments`` in this world."""
        return layout_signature(fragments, self.world)

    def forget(self) -> None:
        """Before a load, which may replace the optimizer state: the cached fragments
        would keep the old tensors alive (on a GPU, a second copy of the moments) until
        the next snapshot."""
        self._described = None
        self._contents.clear()
        self._layouts.clear()

    def fragments(self) -> Tuple[list, str, list]:
        """This rank's fragments (fp32 master and moments), their signature, and per
        fragment ``(key, tensor, expert, manifest spec)``; described again only when the
        tensors they point into changed (a load, a new optimizer state): describing
        hundreds of parameters took milliseconds of every save call. Keeping the
        fragments keeps the old tensors alive, which is what makes
        :func:`~deepspeed_ext.state.state_identity` notice their replacement."""
        from deepspeed_ext.state import describe_local_state, state_identity
        engine = self.session.engine
        identity = state_identity(engine)
        if self._described is None or not identity.same(self._described[0]):
            fragments = describe_local_state(engine, self.session.naming)
            rows = [(f.key, f.tensor, tuple(f.expert) if f.expert is not None else None,
                     self.spec(f)) for f in fragments]
            self._described = (identity, fragments, self.signature(fragments), rows)
            # The cached contents and plans point into the replaced tensors.
            self._contents.clear()
            self._layouts.clear()
        return self._described[1:]

    def content(self, rows, union: Optional[FrozenSet]) -> ExpertSetContent:
        """The fragments of ``rows`` (:meth:`fragments`) a snapshot of the experts
        ``union`` holds (None: no MoE, all of them), in source order, with their specs;
        built once per expert set."""
        from deepspeed_ext.format.copy_plan import source_order
        hit = self._contents.get(union)
        if hit is None:
            chosen = {key: (tensor, spec) for key, tensor, expert, spec in rows
                      if expert is None or union is None or expert in union}
            order = source_order({key: tensor for key, (tensor, _) in chosen.items()})
            hit = ExpertSetContent(tensors={key: chosen[key][0] for key in order},
                                   specs={key: chosen[key][1] for key in order})
            if len(self._contents) >= LAYOUT_CACHE:  # bounded: e.g. K's rotation of experts
                self._contents.clear()
            self._contents[union] = hit
        return hit

    def layout(self, union: Optional[FrozenSet], content: ExpertSetContent,
               tensors: Dict[str, torch.Tensor],
               object_tensors: Dict[str, torch.Tensor]) -> CachedLayout:
        """The layout of a snapshot of ``content`` (the expert set ``union``) plus the
        objects' tensors, ``tensors`` being both together: computed once per expert set
        and object shapes (the same every snapshot unless the experts or the objects'
        shapes change). The image keeps the fragments in source order, so that its copy
        plan is a few large copies per parameter group."""
        from deepspeed_ext.format.copy_plan import plan_copies
        from deepspeed_ext.format.image import layout_of
        key = (union, tuple((k, tuple(t.shape), t.dtype) for k, t in object_tensors.items()))
        hit = self._layouts.get(key)
        if hit is None:
            image = layout_of(tensors, keep_order=True)
            entries = [e.to_json() for e in image.entries]
            static = json.dumps([entries, content.specs], sort_keys=True,
                                separators=(",", ":"))
            hit = CachedLayout(image=image, entries=entries, plan=plan_copies(image, tensors),
                               layout_id=hashlib.sha256(static.encode()).hexdigest()[:24])
            if len(self._layouts) >= LAYOUT_CACHE:  # bounded: e.g. K's rotation of experts
                self._layouts.clear()
            self._layouts[key] = hit
        return hit

    def spec(self, frag) -> Dict[str, Any]:
        """The manifest spec of a fragment, built once per fragment (every snapshot needs
        hundreds of them, and they change only with the layout)."""
        from deepspeed_ext.format import assemble
        cache_key = (frag.key, frag.length, tuple(frag.shape), frag.tensor.dtype, frag.expert,
                     frag.split)
        spec = self._specs.get(cache_key)
        if spec is None:
            spec = self._specs[cache_key] = assemble.FragmentSpec(
                frag.name, frag.kind, frag.offset, frag.length, frag.shape,
                str(frag.tensor.dtype).rsplit(".", 1)[-1], frag.expert, frag.split).to_json()
        return spec
