"""The life of a MoC save directory: claims, ``latest`` and job attempts, the catalog of
its checkpoints (scan, resolve, verify), retention and set-aside, readers' pins, the
commit without a collective and the reader. Builds on :mod:`deepspeed_ext.format`.

Modules: :mod:`.locking`, :mod:`.claims`, :mod:`.catalog`, :mod:`.latest`, :mod:`.pins`,
:mod:`.verify`, :mod:`.retention`, :mod:`.prepare`, :mod:`.commit`, :mod:`.reader`.

May import: :mod:`deepspeed_ext.runtime`, :mod:`deepspeed_ext.policy` and
:mod:`deepspeed_ext.format`; nothing above (``tests/test_layering.py`` checks it).
"""
