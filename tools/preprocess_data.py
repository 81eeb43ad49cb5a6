#!/usr/bin/env python
"""Tokenize text, JSONL or source files into Megatron ``.bin``/``.idx`` datasets.

A thin wrapper so the tool runs from a checkout without installing; the logic is
``megatron.data.preprocess`` (also installed as ``moc-preprocess-data``). See
``python tools/preprocess_data.py --help``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess import main  # noqa: E402  (needs the path above)

if __name__ == "__main__":
    sys.exit(main())
