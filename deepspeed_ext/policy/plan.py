"""Fully sharded write plan: which rank writes which piece of a checkpoint.

The model state is described as :class:`Piece` objects: named byte ranges, each with the
ranks that hold identical bytes. Replicated state (non-expert weights on every
data-parallel rank, expert weights on every rank of their expert-data-parallel group)
can be written by any holder; partitioned state (ZeRO optimizer shards) by its owner only.

Megatron-DeepSpeed lets rank 0 write all non-expert weights, so rank 0 sets the
checkpoint time. :func:`build_write_plan` instead spreads every replicated piece over its
holders, greedily, so that the busiest rank writes as little as possible (MoC paper,
Eq. 8), also when partial experts checkpointing leaves some ranks with more experts to
write than others.

Pure: no torch, no torch.distributed, no file I/O. Every rank can build the same plan
from the same piece list without communicating.
"""

from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from deepspeed_ext.policy.pec import ExpertId, partial_parts


@dataclass(frozen=True)
class Piece:
    """One byte range of the checkpoint to be written by exactly one rank.

    Attributes:
        key: unique name of the byte range.
        nbytes: its size in bytes.
        holders: ranks holding identical bytes; a single rank for partitioned (ZeRO) state.
        expert: ``(moe_layer, global_expert)`` for expert state, ``None`` otherwise.
        part: ``"w"`` (weights) or ``"o"`` (optimizer state), see
            :func:`deepspeed_ext.policy.pec.part_of_kind`; ``""`` when unknown, allowed only
            with the scope ``wo`` (both parts are left out alike).
    """

    key: str
    nbytes: int
    holders: Tuple[int, ...]
    expert: Optional[ExpertId] = None
    part: str = ""


@dataclass
class WritePlan:
    """The result of :func:`build_write_plan`.

    Attributes:
        writer: piece key -> the one rank that writes it.
        bytes_per_rank: bytes each rank writes, indexed by rank.
        skipped: keys of expert pieces PEC leaves out, sorted.
    """

    writer: Dict[str, int]
    bytes_per_rank: List[int]
    skipped: Tuple[str, ...] = field(default_factory=tuple)

    def keys_for(self, rank: int) -> List[str]:
        """The keys ``rank`` writes, sorted (the same order on every rank and every run)."""
        if not 0 <= rank < len(self.bytes_per_rank):
            raise ValueError(f"rank {rank} is not in [0, {len(self.bytes_per_rank)})")
        return sorted(key for key, writer in self.writer.items() if writer == rank)

    def max_over_mean(self) -> float:
        """Busiest rank's bytes over the mean: 1.0 is perfect balance (and an empty plan)."""
        total = sum(self.bytes_per_rank)
        if total == 0:
            return 1.0
        return max(self.bytes_per_rank) * len(self.bytes_per_rank) / total


def _check_pieces(pieces: Sequence[Piece], world_size: int) -> None:
    """Raise ValueError naming the key of the first malformed piece."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    seen = set()
    for piece in pieces:
        # Two pieces under one key would make two ranks write the same file name.
        if piece.key in seen:
            raise ValueError(f"duplicate piece key {piece.key!r}")
        seen.add(piece.key)
        if isinstance(piece.nbytes, bool) or not isinstance(piece.nbytes, int) or piece.nbytes < 0:
            raise ValueError(f"piece {piece.key!r} has bad nbytes {piece.nbytes!r}")
        # A piece nobody holds would silently be missing from the checkpoint.
        if not piece.holders:
            raise ValueError(f"piece {piece.key!r} has no holders")
        if len(set(piece.holders)) != len(piece.holders):
            raise ValueError(f"piece {piece.key!r} lists a holder twice: {piece.holders}")
        for rank in piece.holders:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ValueError(f"piece {piece.key!r} has holder {rank!r} outside "
                                 f"[0, {world_size})")


def _largest_first(pieces: Sequence[Piece]) -> List[Piece]:
    # A total order on unique keys: the plan does not depend on the input order.
    return sorted(pieces, key=lambda p: (-p.nbytes, p.key))


def build_write_plan(pieces: Sequence[Piece], world_size: int,
                     selected: Optional[Collection[ExpertId]] = None,
                     scope: str = "wo") -> WritePlan:
    """Assign every piece to be written to exactly one of its holders.

    Non-expert pieces are always written; an expert piece if ``selected`` is ``None`` or
    holds its expert, or if its part is outside ``scope`` (else its key goes to
    ``skipped``). Placement, in three
    rounds, each largest piece first (ties: key):

    1. pieces with one holder go to it (partitioned state has no choice);
    2. replicated expert pieces, onto the least-loaded holder (ties: lowest rank);
    3. replicated non-expert pieces, the same way.

    Expert pieces can only go to their expert-data-parallel group, non-expert ones to
    any rank; placing the flexible ones last lets them fill the ranks that PEC left
    with fewer experts to write.

    Args:
        pieces: every piece of the checkpoint, in any order.
        world_size: ranks, numbered ``0..world_size-1``.
        selected: experts PEC saves this time; ``None`` saves all.
        scope: which parts of an unselected expert are left out (``--moc-pec-scope``:
            ``wo`` both, ``w`` weights only, ``o`` optimizer state only).

    Returns:
        The plan; the same for the same pieces in any order.

    Raises:
        ValueError: a duplicate key, a piece with no holders, a holder twice or outside
            ``[0, world_size)``, negative ``nbytes`` (the message names the key), or an
            unknown ``scope``.
    """
    _check_pieces(pieces, world_size)
    written, skipped = _select_written(pieces, selected, scope)
    forced = [p for p in written if len(p.holders) == 1]
    expert = [p for p in written if len(p.holders) > 1 and p.expert is not None]
    dense = [p for p in written if len(p.holders) > 1 and p.expert is None]
    writer, load = _place((forced, expert, dense), world_size)
    return WritePlan(writer=writer, bytes_per_rank=load, skipped=tuple(sorted(skipped)))


def _select_written(pieces: Sequence[Piece], selected: Optional[Collection[ExpertId]],
                    scope: str) -> Tuple[List[Piece], List[str]]:
    """(the pieces to write, the keys of those PEC leaves out) under ``selected`` and
    ``scope`` (see :func:`build_write_plan`).

    Raises:
        ValueError: an unknown ``scope``, or an expert piece of unknown part under a
            one-part scope.
    """
    parts = partial_parts(scope)
    chosen = None if selected is None else {tuple(x) for x in selected}
    written, skipped = [], []
    for piece in pieces:
        # A piece of unknown part under a one-part scope would be written or left out
        # against what the expert index then records for it.
        if piece.expert is not None and scope != "wo" and piece.part not in ("w", "o"):
            raise ValueError(f"expert piece {piece.key!r} has part {piece.part!r}; a PEC "
                             f"scope of {scope!r} needs 'w' or 'o' on every expert piece")
        if (piece.expert is not None and chosen is not None and tuple(piece.expert) not in chosen
                and (piece.part in parts or not piece.part)):
            skipped.append(piece.key)
        else:
            written.append(piece)
    return written, skipped


def _place(rounds: Sequence[Sequence[Piece]],
           world_size: int) -> Tuple[Dict[str, int], List[int]]:
    """(writer of each key, bytes per rank): each round's pieces, largest first, onto
    their least-loaded holder (ties: lowest rank)."""
    writer: Dict[str, int] = {}
    load = [0] * world_size
    for group in rounds:
        for piece in _largest_first(group):
            rank = min(piece.holders, key=lambda r: (load[r], r))
            writer[piece.key] = rank
            load[rank] += piece.nbytes
    return writer, load


def split_piece(piece: Piece, chunk_bytes: int) -> List[Piece]:
    """Cut ``piece`` into chunks of ``chunk_bytes`` (the last one shorter) with its holders.

    Lets the plan balance a replicated tensor larger than one rank's fair share, which a
    single piece cannot be. Chunk ``i`` has key ``f"{piece.key}#{i}"`` and covers bytes
    ``[i * chunk_bytes, i * chunk_bytes + chunk.nbytes)`` of the original piece; a
    caller maps a chunk key back with :func:`parse_chunk_key`. A piece no larger than
    ``chunk_bytes`` gives one chunk, ``#0``, so every key of a split piece has the suffix.

    Raises:
        ValueError: ``chunk_bytes`` is not positive, or ``piece.nbytes`` is negative.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if piece.nbytes < 0:
        raise ValueError(f"piece {piece.key!r} has bad nbytes {piece.nbytes!r}")
    count = max(1, -(-piece.nbytes // chunk_bytes))
    return [Piece(key=f"{piece.key}#{i}",
                  nbytes=min(chunk_bytes, piece.nbytes - i * chunk_bytes),
                  holders=piece.holders, expert=piece.expert, part=piece.part)
            for i in range(count)]


def parse_chunk_key(key: str, chunk_bytes: int) -> Tuple[str, int]:
    """The original key and byte offset of a chunk made by :func:`split_piece`.

    Splits at the last ``#``, so original keys may contain ``#`` themselves.

    Raises:
        ValueError: ``key`` has no ``#<index>`` suffix.
    """
    base, sep, index = key.rpartition("#")
    if not sep or not (index.isascii() and index.isdigit()):
        raise ValueError(f"{key!r} is not a chunk key (<key>#<index>)")
    return base, int(index) * chunk_bytes
