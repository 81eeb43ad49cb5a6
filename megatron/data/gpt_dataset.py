"""Train/valid/test GPT datasets through ``megatron.core.datasets``.

:func:`build_train_valid_test_datasets` validates the data flags, checks the
``.bin``/``.idx`` files on every rank, and then runs megatron.core's
``BlendedMegatronDatasetBuilder`` with ``GPTDataset``.

Distributed behaviour (megatron-core 0.16.1)
--------------------------------------------
``build()`` must be called on every rank of the default process group. For each
split, rank 0 builds the document/sample/shuffle index files into the cache directory
while the other ranks wait in ``torch.distributed.barrier()``; afterwards they load the
files rank 0 wrote (so all ranks must see the same cache directory, e.g. one machine
or a shared file system). An exception on rank 0 inside the builder therefore leaves
the other ranks blocked in that barrier until the process-group timeout. To keep that
from happening for bad user input, everything that can fail deterministically is
checked *before* the builder runs, on every rank, and the ranks agree on the result
with one small ``all_reduce`` so that all of them raise :class:`ConfigError` together:

* the ``--data-path`` prefixes have readable, consistent ``.bin``/``.idx`` files with at
  least one document and token ids below the tokenizer's vocabulary size;
* every split that will be drawn from has at least one non-empty document (an empty
  split makes ``GPTDataset`` loop forever computing its number of epochs);
* the cache directory can be created and written.

Rank 0 also deletes truncated ``.npy`` files from the cache directory before the
agreement (a run killed while writing them would otherwise crash the next one, because
megatron.core treats an existing file as a cache hit).

Without a process group everything runs in this process. megatron-core 0.16.1's
``BlendedDataset`` calls ``torch.distributed.get_rank()`` unguarded when its cache
misses, so for blends without a process group the blending indices (cheap to compute)
are built in memory and not cached.
"""

import copy
import logging
import math
import os
import re
from typing import Callable, List, Optional, Sequence, Tuple

import numpy
import torch

from megatron.data.compat import check_int, quiet_core_import
from megatron.errors import ConfigError

with quiet_core_import():
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# Token-id range check reads at most this many tokens per prefix (a prefix of the
# .bin file); enough to catch data preprocessed with a different tokenizer.
_TOKEN_CHECK_LIMIT = 1 << 25


# --------------------------------------------------------------------------- parsing


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def parse_data_path(data_path,
                    flag: str = "--data-path") -> Tuple[List[str], Optional[List[float]]]:
    """Parse Megatron's ``--data-path`` list (or that of ``flag``, e.g.
    ``--train-data-path``) into ``(prefixes, weights)``.

    Accepted forms: ``[prefix]``; ``[w1, prefix1, w2, prefix2, ...]`` (a weighted
    blend; weights are positive numbers, normalized later); ``[prefix1, prefix2, ...]``
    (a blend weighted by dataset size). A single weighted prefix drops its weight.
    A string is split on whitespace.
    """
    if data_path is None:
        raise ConfigError(f"{flag} is required (a preprocessed data prefix, without .bin/.idx)")
    if isinstance(data_path, str):
        items = data_path.split()
    else:
        items = [str(item) for item in data_path]
    if not items or any(not item.strip() for item in items):
        raise ConfigError(f"{flag} must list one or more data prefixes, got {data_path!r}")

    if len(items) == 1:
        return items, None

    numeric = [_as_float(item) is not None for item in items]
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights, prefixes = [], []
        for raw_weight, prefix in zip(items[0::2], items[1::2]):
            weight = float(raw_weight)
            if not math.isfinite(weight) or weight <= 0.0:
                raise ConfigError(
                    f"{flag}: weight {raw_weight!r} for {prefix} must be a positive number "
                    "(drop the prefix instead of giving it weight 0)"
                )
            weights.append(weight)
            prefixes.append(prefix)
        if len(prefixes) == 1:
            return prefixes, None
        return prefixes, weights
    if not any(numeric):
        return items, None
    raise ConfigError(
        f"{flag}: expected PREFIX, PREFIX PREFIX ..., or WEIGHT PREFIX WEIGHT PREFIX ...; "
        f"got {' '.join(items)!r}"
    )


_SPLIT_NUMBER = re.compile(r"^(\d+(\.\d*)?|\.\d+)$")


def parse_split(split) -> Tuple[str, List[float]]:
    """Validate ``--split`` (e.g. ``"969,30,1"``; ``,`` or ``/`` separated, 1-3 numbers).

    Returns the canonical ``"a,b,c"`` string handed to megatron.core and the
    normalized weights.
    """
    if split is None:
        raise ConfigError('--split is required, e.g. "969,30,1"')
    parts = [p.strip() for p in re.split(r"[,/]", str(split).strip())]
    if not 1 <= len(parts) <= 3 or not all(_SPLIT_NUMBER.match(p) for p in parts):
        raise ConfigError(
            f'--split must be 1 to 3 non-negative numbers like "969,30,1", got {split!r}'
        )
    parts += ["0"] * (3 - len(parts))
    values = [float(p) for p in parts]
    total = sum(values)
    if total <= 0.0:
        raise ConfigError(f"--split must have a positive entry, got {split!r}")
    return ",".join(parts), [v / total for v in values]


def get_split_sizes(args) -> List[int]:
    """Samples per split: ``[train, valid, test]``.

    train = train_iters * global_batch_size;
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size;
    test = eval_iters * global_batch_size.
    """
    train_iters = check_int(args.train_iters, "--train-iters", minimum=1)
    global_batch_size = check_int(args.global_batch_size, "--global-batch-size", minimum=1)
    micro_batch_size = check_int(args.micro_batch_size, "--micro-batch-size", minimum=1)
    eval_interval = check_int(args.eval_interval, "--eval-interval", minimum=1)
    eval_iters = check_int(args.eval_iters, "--eval-iters", minimum=0)
    if global_batch_size % micro_batch_size:
        raise ConfigError(
            f"--global-batch-size ({global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({micro_batch_size})"
        )
    return [
        train_iters * global_batch_size,
        (train_iters // eval_interval + 1) * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


def default_cache_path(prefixes: Sequence[str]) -> str:
    """``cache/`` next to the first data prefix."""
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")


# ------------------------------------------------------------------------ validation


def _check_prefix_files(prefix: str, flag: str = "--data-path") -> None:
    for path in (prefix + ".bin", prefix + ".idx"):
        if os.path.isfile(path):
            continue
        hint = ""
        if prefix.endswith((".bin", ".idx")):
            hint = f" (give the prefix without the extension: {prefix[:-4]})"
        elif os.path.isfile(prefix + "_text_document.bin"):
            hint = f" (did you mean {prefix}_text_document?)"
        raise ConfigError(f"{flag}: missing file {path}{hint}")
    for path in (prefix + ".bin", prefix + ".idx"):
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{flag}: cannot read {path}")


def _split_ranges(num_documents: int, split_matrix) -> List[Optional[Tuple[int, int]]]:
    """Document index ranges per split, rounded the way the megatron.core builder does."""
    ranges = []
    for bookends in split_matrix:
        if bookends is None:
            ranges.append(None)
        else:
            ranges.append(
                (
                    int(round(bookends[0] * float(num_documents))),
                    int(round(bookends[1] * float(num_documents))),
                )
            )
    return ranges


def _first_rank() -> bool:
    """Whether this process logs the data checks' warnings (rank 0, or no process group)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _described_bytes(dataset, lengths, itemsize: int, prefix: str, flag: str) -> int:
    """The ``.bin`` bytes ``prefix``'s ``.idx`` describes; ConfigError unless the ``.bin``
    has them (or upstream's one extra eod token per document)."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    count = int(lengths.shape[0])
    expected_bytes = int(dataset.index.sequence_pointers[-1]) + int(lengths[-1]) * itemsize
    actual_bytes = os.path.getsize(bin_path)
    # Megatron-DeepSpeed's tools/preprocess_data.py with --append-eod writes each
    # document's eod into the .bin but leaves it out of the .idx's sizes (and
    # pointers): upstream trains on the data so described, and so does this run.
    upstream_eod = actual_bytes - expected_bytes == count * itemsize
    if upstream_eod and _first_rank():
        logger.warning(f"{flag}: {idx_path} describes one token per document less than "
                       f"{bin_path} holds (Megatron-DeepSpeed's preprocess_data.py "
                       f"--append-eod records sizes without the eod); read as it "
                       f"describes, as upstream reads it")
    if expected_bytes != actual_bytes and not upstream_eod:
        raise ConfigError(
            f"{flag}: {bin_path} has {actual_bytes} bytes but {idx_path} describes "
            f"{expected_bytes}; the pair comes from different or interrupted preprocessing "
            "runs, preprocess the data again"
        )
    return expected_bytes


def _check_prefix_contents(prefix: str, tokenizer, split_matrix,
                           flag: str = "--data-path") -> None:
    """The index and data files of ``prefix`` (named by ``flag``) agree and fit the
    tokenizer; each split of ``split_matrix`` (None: the file is used whole) gets tokens."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    try:
        dataset = IndexedDataset(prefix, multimodal=False, mmap=True)
    except (AssertionError, ValueError, OSError, KeyError, IndexError) as err:
        raise ConfigError(
            f"{flag}: {idx_path} is not a readable Megatron index file ({err})"
        ) from None
    try:
        lengths = dataset.sequence_lengths
        count = int(lengths.shape[0])
        if count == 0:
            raise ConfigError(f"{flag}: {prefix} contains no documents")
        if split_matrix is None and int(numpy.sum(lengths, dtype=numpy.int64)) == 0:
            raise ConfigError(f"{flag}: {prefix} contains only empty documents (megatron.core "
                              "would loop forever on it)")
        itemsize = numpy.dtype(dataset.index.dtype).itemsize
        expected_bytes = _described_bytes(dataset, lengths, itemsize, prefix, flag)
        if expected_bytes:
            num_tokens = min(expected_bytes // itemsize, _TOKEN_CHECK_LIMIT)
            tokens = numpy.memmap(
                bin_path, dtype=dataset.index.dtype, mode="r", shape=(num_tokens,)
            )
            try:
                max_token = int(tokens.max()) if num_tokens else -1
            finally:
                del tokens
            if max_token >= tokenizer.vocab_size:
                raise ConfigError(
                    f"{flag}: {bin_path} contains token id {max_token}, but "
                    f"--tokenizer-type {getattr(tokenizer, 'tokenizer_type', '?')} has only "
                    f"{tokenizer.vocab_size} ids; was the data preprocessed with another tokenizer?"
                )
        for name, bounds in zip(SPLIT_NAMES, _split_ranges(count, split_matrix or ())):
            if bounds is None:
                continue
            begin, end = bounds
            if end <= begin or int(numpy.sum(lengths[begin:end], dtype=numpy.int64)) == 0:
                raise ConfigError(
                    f"--split: the {name} split of {prefix} gets no tokens (documents "
                    f"[{begin}, {end}) of {count}); add more documents or change --split "
                    "(megatron.core would loop forever on an empty split)"
                )
    finally:
        del dataset


def _prepare_cache_dir(path: str, explicit: bool) -> None:
    flag = "--data-cache-path"
    if not explicit:
        flag += " (default: cache/ next to the first --data-path prefix)"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag}: cannot create {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: {path} is not writable")


def _npy_is_complete(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            version = numpy.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = numpy.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = numpy.lib.format.read_array_header_2_0(f)
            data_start = f.tell()
        expected = data_start + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        return os.path.getsize(path) == expected
    except (OSError, ValueError, EOFError):
        return False


def _discard_truncated_cache_files(path: str) -> None:
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in sorted(names):
        if not name.endswith(".npy"):
            continue
        full = os.path.join(path, name)
        if os.path.isfile(full) and not _npy_is_complete(full):
            logger.warning("removing truncated dataset cache file %s (it will be rebuilt)", full)
            try:
                os.remove(full)
            except OSError:
                pass


def _all_ranks_agree(error: Optional[ConfigError]) -> None:
    """Raise ``error`` locally and make every other rank raise too (one all_reduce)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        device = torch.device("cpu")
        if torch.distributed.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        failed = torch.tensor([1 if error is not None else 0], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if error is None and int(failed.item()):
            raise ConfigError(
                "--data-path: the data checks failed on another rank (its error names the "
                "problem); not building datasets"
            )
    if error is not None:
        raise error


# --------------------------------------------------------------------------- builder


class _InMemoryBlendedDataset(BlendedDataset):
    """BlendedDataset whose indices are computed in memory when there is no process group.

    megatron-core 0.16.1 evaluates ``torch.distributed.get_rank()`` on a cache miss
    even without a process group (``ValueError``). The blending indices are cheap, so
    in that case they are computed with ``path_to_cache`` hidden from the base class.
    """

    def _build_indices(self):
        if torch.distributed.is_initialized() or not self.config.path_to_cache:
            return super()._build_indices()
        shared_config = self.config
        self.config = copy.copy(shared_config)
        self.config.path_to_cache = None
        blended_logger = logging.getLogger(BlendedDataset.__module__)
        quiet = _DropMessage("because path_to_cache is None")
        blended_logger.addFilter(quiet)
        try:
            return super()._build_indices()
        finally:
            blended_logger.removeFilter(quiet)
            self.config = shared_config


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


class _Builder(BlendedMegatronDatasetBuilder):
    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        if cls is BlendedDataset and not torch.distributed.is_initialized():
            cls = _InMemoryBlendedDataset
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def _validate(args, tokenizer):
    separate = separate_blends(args)
    if separate is None:
        prefixes, weights = parse_data_path(args.data_path)
        split, _ = parse_split(getattr(args, "split", "969,30,1"))
    else:
        prefixes = separate[0][0]
    sizes = get_split_sizes(args)
    seq_length = check_int(args.seq_length, "--seq-length", minimum=1)
    seed = check_int(args.seed, "--seed", minimum=0)
    if seed >= 2**32:
        raise ConfigError(f"--seed must be < 2**32, got {seed}")

    cache_arg = getattr(args, "data_cache_path", None)
    cache_path = os.path.abspath(cache_arg) if cache_arg else default_cache_path(prefixes)
    # Splits nobody will draw from (0 samples, e.g. --eval-iters 0) are not built:
    # a tiny corpus could give them no documents, on which megatron.core loops forever.
    if separate is None:
        for prefix in prefixes:
            _check_prefix_files(prefix)
        config = _gpt_config(args, seq_length, seed, cache_path, tokenizer,
                             blend=(prefixes, weights), split=split)
        config.split_matrix = [
            bookends if size > 0 else None for bookends, size in zip(config.split_matrix, sizes)
        ]
        for prefix in prefixes:
            _check_prefix_contents(prefix, tokenizer, config.split_matrix)
    else:
        used = [blend if size > 0 else None for blend, size in zip(separate, sizes)]
        for name, blend in zip(SPLIT_NAMES, used):
            for prefix in blend[0] if blend else ():
                _check_prefix_files(prefix, f"--{name}-data-path")
                _check_prefix_contents(prefix, tokenizer, None, f"--{name}-data-path")
        config = _gpt_config(args, seq_length, seed, cache_path, tokenizer,
                             blend_per_split=used)
        config.split_matrix = [(0.0, 1.0) if blend else None for blend in used]
    _prepare_cache_dir(cache_path, explicit=bool(cache_arg))
    return config, sizes


def separate_blends(args) -> Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]]:
    """Megatron-DeepSpeed's separate datasets: the ``(prefixes, weights)`` of
    ``--train-data-path``, ``--valid-data-path`` and ``--test-data-path`` (None for one not
    given), each used whole; None when the run reads ``--data-path`` and ``--split``."""
    paths = [getattr(args, f"{name}_data_path", None) for name in SPLIT_NAMES]
    if not paths[0]:
        return None
    return [parse_data_path(path, f"--{name}-data-path") if path else None
            for name, path in zip(SPLIT_NAMES, paths)]


def _gpt_config(args, seq_length, seed, cache_path, tokenizer, **source) -> GPTDatasetConfig:
    """megatron.core's dataset config; ``source``: ``blend`` and ``split``, or
    ``blend_per_split``."""
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        path_to_cache=cache_path,
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=False,
        mmap_bin_files=True,
        num_dataset_builder_threads=1,
        **source,
    )


def build_train_valid_test_datasets(
    args, tokenizer, is_built_on_rank: Optional[Callable[[], bool]] = None
):
    """Build ``(train, valid, test)`` GPT datasets from ``--data-path`` carved by
    ``--split``, or from ``--train-data-path``/``--valid-data-path``/``--test-data-path``
    each used whole; an entry is None for a split of ``--split`` weight 0, without its
    path, or of size 0.

    Args:
        args: namespace with ``data_path`` (or ``train_data_path`` and optionally
            ``valid_data_path``, ``test_data_path``), ``split``, ``seq_length``, ``seed``,
            ``micro_batch_size``, ``global_batch_size``, ``train_iters``,
            ``eval_interval``, ``eval_iters``, and optionally ``data_cache_path``,
            ``reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``.
        tokenizer: from :func:`megatron.data.tokenizer.build_tokenizer`.
        is_built_on_rank: megatron.core's per-rank switch; default: every rank builds
            (each data-parallel rank reads its own batches).

    Must be called on every rank when torch.distributed is initialized.

    Raises:
        ConfigError: on every rank, for bad flags or data files.
    """
    error, config, sizes = None, None, None
    try:
        config, sizes = _validate(args, tokenizer)
    except ConfigError as err:
        error = err
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if error is None and rank0:
        _discard_truncated_cache_files(config.path_to_cache)
    _all_ranks_agree(error)  # also orders the cache clean-up before any rank reads

    for name, bookends, size in zip(SPLIT_NAMES, config.split_matrix, sizes):
        if bookends is None and size > 0:
            if config.blend_per_split:
                logger.warning("no --%s-data-path: no %s dataset", name, name)
            else:
                logger.warning("--split gives the %s split weight 0: no %s dataset", name, name)

    builder = _Builder(GPTDataset, sizes, is_built_on_rank or (lambda: True), config)
    train, valid, test = builder.build()
    return train, valid, test
