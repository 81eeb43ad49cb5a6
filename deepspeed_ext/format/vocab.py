"""Tensors whose rows are a padded vocabulary: trimming or adding padding rows when a
checkpoint's padding differs from the loading model's.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` times
the tensor-parallel size, so one model has another number of vocabulary rows at another
tensor-parallel size (a 257-token vocabulary with a multiple of 8: 272 rows at T = 2, 264
at T = 1). The rows past the vocabulary hold no token: no input id selects them, and their
logits only enter the softmax. A load across paddings keeps the real rows (bit for bit,
weights and optimizer state) and trims padding rows or adds new ones; every other
dimension must match, and so must the number of real rows.

The library does not know which tensors these are: the model describes them as a
:class:`PaddedVocab` (the trainer: its word embedding, which is also its output layer),
and a checkpoint records the saving model's in its objects (:data:`OBJECTS_KEY`).
:func:`plan_rows` decides what a load does (a :class:`RowPlan`), :func:`fit_rows` does it
to a whole tensor. Pure functions, no I/O.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # the trainer's parser imports this module: --help must not load torch
    import torch

OBJECTS_KEY = "padded_vocab"
"""Key of the saving model's :meth:`PaddedVocab.to_record` in a checkpoint's objects."""


class VocabMismatch(ValueError):
    """A checkpoint's vocabulary rows cannot be fitted to the model's (the real
    vocabularies differ, or a tensor differs in more than its padding rows)."""


@dataclass(frozen=True)
class PaddedVocab:
    """Which tensors have a padded vocabulary as their first dimension, and how many of
    its rows hold a token."""

    names: Tuple[str, ...]
    """Global names of the tensors (the word embedding; an output layer not tied to it)."""
    rows: int
    """Their first dimension: the padded vocabulary size."""
    real_rows: int
    """Rows that hold a token (the tokenizer's vocabulary size); the rest is padding."""

    def __post_init__(self):
        if not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"padded vocabulary: names must be non-empty strings, got "
                             f"{self.names!r}")
        if not (type(self.rows) is int and type(self.real_rows) is int
                and 0 < self.real_rows <= self.rows):
            raise ValueError(f"padded vocabulary: need 0 < real_rows <= rows, got "
                             f"{self.real_rows!r} of {self.rows!r}")

    def to_record(self) -> Dict[str, Any]:
        """The JSON form kept in a checkpoint's objects."""
        return {"names": list(self.names), "rows": self.rows, "real_rows": self.real_rows}

    @staticmethod
    def from_record(record: Any) -> Optional["PaddedVocab"]:
        """What :meth:`to_record` returned; None for a checkpoint without the record.

        Raises:
            ValueError: a malformed record (a damaged checkpoint).
        """
        if record is None:
            return None
        if not isinstance(record, Mapping) or set(record) != {"names", "rows", "real_rows"} \
                or not isinstance(record["names"], list):
            raise ValueError(f"{OBJECTS_KEY}: expected {{names: [...], rows, real_rows}}, "
                             f"got {record!r}")
        return PaddedVocab(tuple(record["names"]), record["rows"], record["real_rows"])


@dataclass(frozen=True)
class RowPlan:
    """How a load fits a checkpoint's padded-vocabulary tensors to the model's rows."""

    names: Tuple[str, ...]
    """The tensors fitted (those of the model's :class:`PaddedVocab` the checkpoint holds)."""
    saved_rows: int
    """Their first dimension in the checkpoint."""
    rows: int
    """Their first dimension in the model."""
    real_rows: int
    """Rows holding a token (copied whatever the padding)."""

    @property
    def trimmed(self) -> int:
        """Padding rows of the checkpoint left out."""
        return max(0, self.saved_rows - self.rows)

    @property
    def added(self) -> int:
        """New padding rows (zeros: :func:`fit_rows`)."""
        return max(0, self.rows - self.saved_rows)

    def saved_shape(self, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The shape a tensor of the model's ``shape`` has in the checkpoint."""
        return (self.saved_rows,) + tuple(shape[1:])

    def describe(self) -> str:
        """One line saying what the load did (rank 0 logs it)."""
        what = (f"trimmed {self.trimmed} padding rows" if self.trimmed
                else f"added {self.added} zero padding rows")
        return (f"vocabulary padding {self.saved_rows} -> {self.rows} rows: {what} of "
                f"{', '.join(self.names)} (weights and optimizer state; its first "
                f"{self.real_rows} rows hold the tokens and are copied unchanged)")


def plan_rows(model: Optional[PaddedVocab], saved: Optional[PaddedVocab],
              saved_rows: Mapping[str, int]) -> Optional[RowPlan]:
    """What a load of a checkpoint into ``model`` does with the vocabulary rows.

    Args:
        model: the loading model's description; None: it describes none (nothing is
            fitted, and a tensor of another shape is refused as before).
        saved: the checkpoint's record (:data:`OBJECTS_KEY`); None: it has none.
        saved_rows: the first dimension of each of ``model.names`` the checkpoint holds.

    Returns:
        None when each of those tensors has ``model.rows`` rows in the checkpoint too;
        else the plan.

    Raises:
        VocabMismatch: the checkpoint records no vocabulary (which of its rows hold
            tokens is unknown), records another real vocabulary size, or its tensors
            disagree on their rows or with its record.
    """
    if model is None or all(rows == model.rows for rows in saved_rows.values()):
        return None
    counts = set(saved_rows.values())
    if len(counts) != 1:
        raise VocabMismatch(f"the checkpoint's vocabulary tensors have different row counts: "
                            f"{dict(sorted(saved_rows.items()))}")
    (rows,) = counts
    if saved is None:
        raise VocabMismatch(
            f"the checkpoint pads its vocabulary to {rows} rows and records no vocabulary "
            f"size (saved without it), so which rows hold tokens is unknown: it loads only "
            f"into {rows} rows (this model has {model.rows})")
    if saved.real_rows != model.real_rows:
        raise VocabMismatch(
            f"the checkpoint's vocabulary has {saved.real_rows} tokens ({saved.rows} rows "
            f"with padding), this model's has {model.real_rows} ({model.rows} rows): only "
            f"padding rows can be trimmed or added, so it needs the vocabulary it was saved "
            f"with")
    if saved.rows != rows:
        raise VocabMismatch(f"the checkpoint records {saved.rows} vocabulary rows and holds "
                            f"{rows}")
    return RowPlan(tuple(n for n in model.names if n in saved_rows), rows, model.rows,
                   model.real_rows)


def fit_rows(tensor: "torch.Tensor", rows: int) -> "torch.Tensor":
    """``tensor`` with ``rows`` rows: its first ``rows`` when it has more, else all of them
    followed by zero rows (a new tensor either way).

    New rows are zeros, in the weights and in Adam's moments alike. Megatron's own
    initialisation (a normal draw of ``--init-method-std``) would need the saving run's
    seed and random stream, which neither a load nor ``moc-ckpt consolidate`` has; zeros
    give the same tensors in both, whatever the engine held before the load (a reload in
    a running process would otherwise keep its old rows). A zero row's logit is exactly
    0, the mean of a freshly initialised row's, so the softmax sees about what a fresh
    padding row would give; a copy of the last row (what some converters write) would,
    for a checkpoint saved without padding, duplicate a real token's logit and take
    probability from that token. Zero moments start the new rows as Adam starts
    every parameter: with no history.
    """
    if rows <= tensor.shape[0]:
        return tensor[:rows].clone()
    out = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
    out[:tensor.shape[0]] = tensor
    return out
