"""The bytes and metadata of a MoC checkpoint: what its files hold and how they reach
storage and come back, with no notion of a save directory's life (that is
:mod:`deepspeed_ext.store`, which builds on this package; nothing here imports it).

Modules, lowest first: :mod:`.errors`, :mod:`.fs` (local paths and URLs),
:mod:`.dtypes`, :mod:`.image` (a fragment file's byte layout), :mod:`.storage` (atomic
writes, checksums), :mod:`.fragment_reader` (ranged reads of safetensors files),
:mod:`.objects` (non-tensor state), :mod:`.naming`, :mod:`.manifest` (the data model,
parse, validate, read/write), :mod:`.assemble` (rank reports -> manifest),
:mod:`.expert_index`, and :mod:`.memsum` (the fast checksums of images held in memory,
recorded with their algorithm).

May import: :mod:`deepspeed_ext.runtime` and :mod:`deepspeed_ext.policy` (PEC parts and
scopes name what a manifest holds); never :mod:`deepspeed_ext.store` or anything above.
"""
