"""The ``.bin``/``.idx`` pairs ``tools/preprocess_data.py`` writes, one per JSON key:
megatron.core's ``IndexedDatasetBuilder`` writing to temporary names, renamed only when
complete (the old ``.idx`` removed first), so an interrupted run never leaves a
half-written pair that looks valid. Used in the preprocessing process only.
"""

import os
from typing import Dict

import numpy

from megatron.data.compat import quiet_core_import


def optimal_dtype(vocab_size: int) -> type:
    """The token dtype megatron.core picks for ``vocab_size`` (uint16 under 65500 ids,
    else int32)."""
    with quiet_core_import():
        from megatron.core.datasets.indexed_dataset import DType
    return DType.optimal_dtype(vocab_size)


class AtomicIndexedDataset:
    """An IndexedDatasetBuilder writing to temporary names, renamed on commit."""

    def __init__(self, prefix: str, dtype) -> None:
        with quiet_core_import():
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        suffix = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = self.bin_path + suffix, self.idx_path + suffix
        self.builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, ids) -> None:
        """Append one document's token ids."""
        self.builder.add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def commit(self) -> None:
        """Finalize the index, fsync both files, rename them into place, fsync the directory."""
        self.builder.finalize(self.tmp_idx)
        for path in (self.tmp_bin, self.tmp_idx):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        # Remove the old index first: between the two renames the pair is incomplete
        # (no .idx), never a new .bin with a stale .idx.
        if os.path.lexists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self.tmp_bin, self.bin_path)
        os.replace(self.tmp_idx, self.idx_path)
        try:
            fd = os.open(os.path.dirname(os.path.abspath(self.bin_path)), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def discard(self) -> None:
        """Close the builder and remove the temporary files."""
        try:
            self.builder.data_file.close()
        except Exception:
            pass
        for path in (self.tmp_bin, self.tmp_idx):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron naming: ``<output-prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_document"


class IndexedOutputs:
    """The datasets of one run, by key, each created on its first document."""

    def __init__(self, output_prefix: str, dtype) -> None:
        self.output_prefix = output_prefix
        self.dtype = dtype
        self.by_key: Dict[str, AtomicIndexedDataset] = {}

    def add(self, key: str, ids: numpy.ndarray) -> None:
        """Append one document's token ids to ``key``'s dataset."""
        if key not in self.by_key:
            self.by_key[key] = AtomicIndexedDataset(output_prefix_for(self.output_prefix, key),
                                                    self.dtype)
        self.by_key[key].add(ids)

    @property
    def tokens(self) -> int:
        """Tokens written so far, all keys together."""
        return sum(o.tokens for o in self.by_key.values())

    def commit(self) -> None:
        """Finalize and rename every dataset into place, in key order of creation."""
        for output in self.by_key.values():
            output.commit()

    def discard(self) -> None:
        """Remove every dataset's temporary files (after a failure)."""
        for output in self.by_key.values():
            output.discard()
