"""Per-process tokenization state for ``tools/preprocess_data.py``.

Lives in an importable module (not in the tool script) so that multiprocessing can
pickle references to these functions however the tool itself was loaded.
"""

import numpy

from megatron.data.tokenizer import build_tokenizer

_STATE = {}


def init_worker(tokenizer_type, vocab_file, merge_file, vocab_size, append_eod, dtype_name):
    """Build this process's tokenizer (Pool initializer; also called in-process)."""
    _STATE["tokenizer"] = build_tokenizer(
        tokenizer_type, vocab_file, merge_file, vocab_size=vocab_size
    )
    _STATE["append_eod"] = bool(append_eod)
    _STATE["dtype"] = numpy.dtype(dtype_name)


def encode(text: str) -> numpy.ndarray:
    """Token ids of one document (plus eod when configured) in the output dtype."""
    tokenizer = _STATE["tokenizer"]
    ids = tokenizer.tokenize(text)
    if _STATE["append_eod"]:
        ids = ids + [tokenizer.eod]
    return numpy.asarray(ids, dtype=_STATE["dtype"])
