"""In-memory redundancy of snapshots across nodes: placement, XOR parity, rebuild plans.

Pure functions and plain dataclasses (no I/O, no collectives); :mod:`deepspeed_ext.peers`
moves the bytes. Two modes (``--moc-redundancy``):

* ``replicate``: every rank's snapshot is copied to the rank with the same local rank on
  each of the next ``--moc-replicas`` nodes (node n's copies go to nodes n+1 .. n+R, mod
  the node count), so they are always outside the original's failure domain (its node).
* ``erasure``: nodes form groups of ``D + 1`` (``--moc-ec-data`` D plus one parity:
  ``--moc-ec-parity 1``, XOR). Within a group, the ranks with the same local rank form a
  *stripe* of D + 1 positions. Each position's snapshot image is cut into D chunks of
  ``c`` bytes (c: the largest image of the stripe over D, rounded up; short chunks are
  zero-padded). Position ``i`` holds the parity::

      P_i = XOR over k = 1..D of chunk k-1 of position (i + k) mod (D + 1)

  Every chunk of every position is in exactly one parity, never held by its own
  position, and the other chunks of that parity lie on the remaining positions. So any
  one position (one node of the group) can be lost: chunk m of position j is
  ``P_i XOR`` (the other D - 1 chunks of P_i) with ``i = (j - m - 1) mod (D + 1)``.
  Each rank holds ``c ~ size / D`` extra bytes per protected snapshot (replicate: R x size).

XOR is done with ``torch.bitwise_xor`` on uint8 tensors; no coding library is needed for
one parity. More parity pieces would need Reed-Solomon, which is refused with a clear error.
"""

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

MODES = ("none", "replicate", "erasure")


@dataclass(frozen=True)
class RedundancySpec:
    """What redundancy the snapshots get; built from the ``--moc-*`` flags."""

    mode: str = "none"
    """``none``, ``replicate`` or ``erasure`` (``--moc-redundancy``)."""
    replicas: int = 1
    """Peer nodes that hold a copy of each node's snapshots (``--moc-replicas``)."""
    ec_data: int = 2
    """Data nodes per erasure group (``--moc-ec-data``)."""
    ec_parity: int = 1
    """Parity pieces per erasure group; only 1 (XOR) is supported (``--moc-ec-parity``)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--moc-redundancy must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if self.replicas < 1:
            raise ValueError(f"--moc-replicas must be >= 1, got {self.replicas}")
        if self.ec_data < 1:
            raise ValueError(f"--moc-ec-data must be >= 1, got {self.ec_data}")
        if self.ec_parity != 1:
            raise ValueError(f"--moc-ec-parity {self.ec_parity} is not supported: only one "
                             "parity piece per group (XOR); use --moc-ec-parity 1, or "
                             "--moc-redundancy replicate with --moc-replicas N to survive "
                             "N lost nodes")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        if self.mode == "replicate":
            return f"replicate ({self.replicas} replica{'s' if self.replicas > 1 else ''})"
        if self.mode == "erasure":
            return f"erasure ({self.ec_data} data + {self.ec_parity} XOR parity)"
        return "none"


@dataclass(frozen=True)
class Topology:
    """Ranks grouped into nodes: rank r is on node ``r // per_node``."""

    world: int
    per_node: int

    def __post_init__(self):
        if self.world < 1 or self.per_node < 1:
            raise ValueError(f"world ({self.world}) and ranks per node ({self.per_node}) "
                             "must be >= 1")
        if self.world % self.per_node:
            raise ValueError(f"{self.world} ranks do not split into nodes of "
                             f"{self.per_node} (--moc-ranks-per-node)")

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_of(self, rank: int) -> int:
        return rank % self.per_node

    def rank_at(self, node: int, local: int) -> int:
        return (node % self.nodes) * self.per_node + local


def check_layout(spec: RedundancySpec, topo: Topology) -> None:
    """Refuse a redundancy the node layout cannot give.

    Raises:
        ValueError: naming the flag to change.
    """
    if spec.mode == "replicate" and spec.replicas > topo.nodes - 1:
        raise ValueError(f"--moc-replicas {spec.replicas} needs at least {spec.replicas + 1} "
                         f"nodes, the job has {topo.nodes} ({topo.world} ranks, "
                         f"{topo.per_node} per node; --moc-ranks-per-node)")
    if spec.mode == "erasure":
        group = spec.ec_data + spec.ec_parity
        if topo.nodes % group:
            raise ValueError(f"--moc-redundancy erasure with --moc-ec-data {spec.ec_data} and "
                             f"--moc-ec-parity {spec.ec_parity} groups nodes by {group}; the "
                             f"job has {topo.nodes} node(s) ({topo.world} ranks, "
                             f"{topo.per_node} per node; --moc-ranks-per-node)")


# ----------------------------------------------------------------------------- replicate

def replica_targets(rank: int, topo: Topology, replicas: int) -> List[int]:
    """The ranks that hold copies of ``rank``'s snapshots, nearest node first."""
    node, local = topo.node_of(rank), topo.local_of(rank)
    return [topo.rank_at(node + k, local) for k in range(1, replicas + 1)]


def replica_sources(rank: int, topo: Topology, replicas: int) -> List[int]:
    """The ranks whose snapshots ``rank`` holds copies of; ``replica_sources(r)[k]`` sends
    to ``r`` in the same round ``k`` in which ``r`` sends to ``replica_targets(r)[k]``."""
    node, local = topo.node_of(rank), topo.local_of(rank)
    return [topo.rank_at(node - k, local) for k in range(1, replicas + 1)]


# ------------------------------------------------------------------------------- erasure

def stripe_of(rank: int, topo: Topology, data: int) -> List[int]:
    """The ranks of ``rank``'s stripe (same local rank, one per node of its group of
    ``data + 1`` nodes), by position."""
    group = data + 1
    first = topo.node_of(rank) // group * group
    return [topo.rank_at(first + j, topo.local_of(rank)) for j in range(group)]


def chunk_size(sizes: Iterable[int], data: int) -> int:
    """Bytes per chunk for images of ``sizes``: the largest over ``data``, rounded up
    (at least 1, so that empty images still have a well-formed parity)."""
    return max(1, -(-max(sizes, default=0) // data))


def chunk_span(size: int, chunk: int, m: int) -> Tuple[int, int]:
    """``[start, stop)`` of chunk ``m`` inside an image of ``size`` bytes (may be empty)."""
    start = min(size, m * chunk)
    return start, min(size, start + chunk)


def parity_inputs(position: int, data: int) -> List[Tuple[int, int]]:
    """``(position, chunk index)`` of the chunks XOR-ed into ``position``'s parity."""
    group = data + 1
    return [((position + k) % group, k - 1) for k in range(1, data + 1)]


def parity_holder(position: int, m: int, data: int) -> int:
    """The position whose parity contains chunk ``m`` of ``position``."""
    return (position - m - 1) % (data + 1)


def padded_chunk(image: torch.Tensor, chunk: int, m: int) -> torch.Tensor:
    """Chunk ``m`` of a flat uint8 ``image``, zero-padded to ``chunk`` bytes (a view when
    no padding is needed)."""
    start, stop = chunk_span(image.numel(), chunk, m)
    if stop - start == chunk:
        return image[start:stop]
    out = torch.zeros(chunk, dtype=torch.uint8)
    out[:stop - start] = image[start:stop]
    return out


def xor_into(acc: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``acc ^= piece`` in place (both uint8, same length); returns ``acc``."""
    if acc.numel() != piece.numel():
        raise ValueError(f"XOR of pieces of {acc.numel()} and {piece.numel()} bytes")
    torch.bitwise_xor(acc, piece, out=acc)
    return acc


def encode_parity(images: Sequence[torch.Tensor], position: int, data: int) -> torch.Tensor:
    """The parity ``position`` holds, from the stripe's images (by position). Reference
    implementation for tests and offline use; the transport builds it piece by piece."""
    chunk = chunk_size([im.numel() for im in images], data)
    parity = torch.zeros(chunk, dtype=torch.uint8)
    for src, m in parity_inputs(position, data):
        xor_into(parity, padded_chunk(images[src], chunk, m))
    return parity


def decode_image(lost: int, size: int, parities: Dict[int, torch.Tensor],
                 images: Dict[int, torch.Tensor], data: int) -> torch.Tensor:
    """Rebuild the ``size``-byte image of position ``lost`` from the other positions'
    parities and images (both by position; ``lost`` must be in neither)."""
    if not parities:
        raise ValueError(f"no parity to rebuild position {lost} from")
    chunk = next(iter(parities.values())).numel()
    if size > data * chunk:
        raise ValueError(f"an image of {size} bytes does not fit {data} chunks of {chunk}")
    out = torch.empty(size, dtype=torch.uint8)
    for m in range(data):
        start, stop = chunk_span(size, chunk, m)
        if start == stop:
            continue
        holder = parity_holder(lost, m, data)
        acc = parities[holder].clone()
        for src, n in parity_inputs(holder, data):
            if src != lost:
                xor_into(acc, padded_chunk(images[src], chunk, n))
        out[start:stop] = acc[:stop - start]
    return out


# ------------------------------------------------------------------------- rebuild plans

@dataclass(frozen=True)
class Holdings:
    """What survives in memory, as every rank reported it at recovery."""

    own: Dict[int, FrozenSet[int]]
    """rank -> steps of its own complete snapshots (with the current layout)."""
    replicas: Dict[int, Dict[int, FrozenSet[int]]] = field(default_factory=dict)
    """holder rank -> {source rank -> steps of complete copies it holds}."""
    parities: Dict[int, FrozenSet[int]] = field(default_factory=dict)
    """holder rank -> steps of complete parities it holds."""


@dataclass(frozen=True)
class Transfer:
    """One piece sent from ``src`` to ``dst`` during a rebuild.

    ``kind``: ``meta`` (the lost snapshot's metadata, from a holder that has it),
    ``replica`` (the whole image), ``parity`` (``src``'s parity) or ``chunk`` (chunk
    ``chunk`` of ``src``'s own image); ``part`` is the lost image's chunk being rebuilt.
    """

    src: int
    dst: int
    step: int
    kind: str
    part: int = 0
    chunk: int = 0
    source: int = -1
    """For ``replica``/``meta`` from a replica: the rank whose snapshot it is (== dst)."""


@dataclass(frozen=True)
class RebuildPlan:
    """The step every rank recovers at, and the transfers that rebuild the missing ones."""

    step: Optional[int]
    """None: no step can be had from memory, even with the peers' help."""
    rebuilt: Tuple[int, ...] = ()
    """Ranks whose snapshot of ``step`` is rebuilt from peers."""
    transfers: Tuple[Transfer, ...] = ()
    """In the order every rank performs them (each rank does its own sends and receives)."""
    why: str = ""
    """When ``step`` is None, or older than a rank's newest own step: the reason."""


def _replica_sources_of(rank: int, step: int, holdings: Holdings, topo: Topology) -> List[int]:
    return sorted(h for h, held in holdings.replicas.items()
                  if topo.node_of(h) != topo.node_of(rank) and step in held.get(rank, ()))


def _erasure_transfers(rank: int, step: int, holdings: Holdings, topo: Topology,
                       data: int) -> Optional[List[Transfer]]:
    stripe = stripe_of(rank, topo, data)
    lost = stripe.index(rank)
    transfers: List[Transfer] = []
    for m in range(data):
        holder = parity_holder(lost, m, data)
        if step not in holdings.parities.get(stripe[holder], ()):
            return None
        if m == 0:
            transfers.append(Transfer(stripe[holder], rank, step, "meta"))
        transfers.append(Transfer(stripe[holder], rank, step, "parity", part=m))
        for pos, n in parity_inputs(holder, data):
            if pos == lost:
                continue
            if step not in holdings.own.get(stripe[pos], ()):
                return None
            transfers.append(Transfer(stripe[pos], rank, step, "chunk", part=m, chunk=n))
    return transfers


def rebuild_transfers(rank: int, step: int, holdings: Holdings, topo: Topology,
                      spec: RedundancySpec) -> Optional[List[Transfer]]:
    """The transfers that give ``rank`` its snapshot of ``step`` ([] when it has it), or
    None when the surviving memory cannot."""
    if step in holdings.own.get(rank, ()):
        return []
    if spec.mode == "replicate":
        holders = _replica_sources_of(rank, step, holdings, topo)
        if not holders:
            return None
        return [Transfer(holders[0], rank, step, "meta", source=rank),
                Transfer(holders[0], rank, step, "replica", source=rank)]
    if spec.mode == "erasure":
        return _erasure_transfers(rank, step, holdings, topo, spec.ec_data)
    return None


def plan_rebuild(holdings: Holdings, topo: Topology, spec: RedundancySpec) -> RebuildPlan:
    """The newest step every rank can recover from memory, its own or rebuilt from peers.

    Ranks whose own memory holds the step need nothing; the others get it by copy
    (``replicate``) or decoding (``erasure``). When no step works, ``why`` names the
    ranks without memory and what redundancy would have needed.
    """
    candidates = set().union(*holdings.own.values()) if holdings.own else set()
    for held in holdings.replicas.values():
        for steps in held.values():
            candidates |= steps
    for steps in holdings.parities.values():
        candidates |= steps
    for step in sorted(candidates, reverse=True):
        transfers: List[Transfer] = []
        rebuilt = []
        for rank in range(topo.world):
            got = rebuild_transfers(rank, step, holdings, topo, spec)
            if got is None:
                break
            if got:
                rebuilt.append(rank)
                transfers.extend(got)
        else:
            why = ""
            newest = max((max(s) for s in holdings.own.values() if s), default=None)
            if newest is not None and newest > step:
                why = f"step {newest} is not held or protected on every rank"
            return RebuildPlan(step, tuple(rebuilt), tuple(transfers), why)
    return RebuildPlan(None, why=_why_not(holdings, topo, spec))


def _why_not(holdings: Holdings, topo: Topology, spec: RedundancySpec) -> str:
    empty = [r for r in range(topo.world) if not holdings.own.get(r)]
    nodes = sorted({topo.node_of(r) for r in empty})
    if not empty:
        return "the ranks hold no step in common"
    lost = (f"rank(s) {empty} (node(s) {nodes}) have no snapshot in memory")
    if not spec.enabled:
        return f"{lost} and --moc-redundancy is none"
    if spec.mode == "replicate":
        return (f"{lost}, and no surviving node holds a complete copy of them at a step "
                f"every rank has (replicate, {spec.replicas} replica(s): more nodes were "
                f"lost than it covers, or the copies were not complete yet)")
    return (f"{lost}, and their stripes cannot be decoded at a step every rank has "
            f"(erasure, {spec.ec_data} data + 1 parity: covers one lost node per group of "
            f"{spec.ec_data + 1}, or the parities were not complete yet)")


def extra_bytes(spec: RedundancySpec, image_bytes: int, kept: int) -> int:
    """Host memory a rank needs for the peers' redundancy it holds, ``kept`` steps deep.

    For ``erasure`` the parity follows the stripe's largest image; ``image_bytes`` is
    this rank's, which under ZeRO is the same (within a partition's rounding) for the
    ranks of one stripe (same local rank on every node).
    """
    if spec.mode == "replicate":
        return kept * spec.replicas * image_bytes
    if spec.mode == "erasure":
        return kept * chunk_size([image_bytes], spec.ec_data)
    return 0


def extra_own_slots(spec: RedundancySpec, interval: int) -> int:
    """Snapshot slots a rank needs for its own snapshots beyond the usual ones (the
    newest, the one being persisted, the one being written): one when erasure coding
    protects only every ``interval``-th snapshot (``--moc-redundancy-interval`` above 1).

    Decoding a lost node's protected snapshot needs the survivors' own images of that
    same step beside the parities; without a slot kept for it, the snapshots after it
    took the survivors' copies and the rebuild went to storage instead.
    """
    return 1 if spec.enabled and spec.mode == "erasure" and interval > 1 else 0
