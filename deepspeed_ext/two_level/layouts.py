"""What a snapshot holds and how its bytes are laid out, cached between snapshots
(:mod:`deepspeed_ext.two_level`): describing hundreds of fragments, their manifest
specs and the image layout took milliseconds of every save call."""

import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

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


class SnapshotLayouts:
    """This rank's fragments, their specs and image layouts, described once per state."""

    def __init__(self, session: CheckpointSession, world: int):
        self.session = session
        self.world = world
        self._specs: Dict[tuple, Dict[str, Any]] = {}
        self._described: Optional[tuple] = None
        """(state identity, fragments, signature, rows) of the last snapshot (:meth:`fragments`)."""
        self._layouts: Dict[tuple, tuple] = {}
        """(keys, shapes, dtypes) -> (image layout, metadata entries) (:meth:`layout`)."""

    def signature(self, fragments) -> str:
        """:func:`layout_signature` of ``fragments`` in this world."""
        return layout_signature(fragments, self.world)

    def forget(self) -> None:
        """Before a load, which may replace the optimizer state: the cached fragments
        would keep the old tensors alive (on a GPU, a second copy of the moments) until
        the next snapshot."""
        self._described = None

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
        return self._described[1:]

    def layout(self, tensors: Dict[str, torch.Tensor]) -> Tuple[Any, List[Dict[str, Any]]]:
        """The image layout of ``tensors`` and its metadata entries, computed once per
        set of keys, shapes and dtypes (the same every snapshot unless K's expert choice
        or the layout changes). The entries are shared by the snapshots' metadata and
        never modified."""
        from deepspeed_ext.format.image import layout_of
        key = tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items())
        hit = self._layouts.get(key)
        if hit is None:
            layout = layout_of(tensors)
            entries = [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                        "start": e.start, "nbytes": e.nbytes} for e in layout.entries]
            if len(self._layouts) >= LAYOUT_CACHE:  # bounded: e.g. K's rotation of experts
                self._layouts.clear()
            hit = self._layouts[key] = (layout, entries)
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
