"""The one error type for bad user input, shared by every layer of the trainer.

Every check of flags, YAML keys, data files and tokenizer files raises
:class:`ConfigError`; the entry point catches it on every rank, prints its one-line
message and exits with status 2 before any collective could hang. It lives here, below
``megatron.data``, ``megatron.model`` and ``megatron.training``, so that the data and
model layers can raise it without importing the training layer above them.
"""


class ConfigError(ValueError):
    """A problem with the user's input, fixable by changing one flag or file.

    Args:
        message: what is wrong, naming the flag (``--num-experts``) or the file.
    """

    exit_code = 2
