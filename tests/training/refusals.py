"""What the trainer's argument checks say to a flag combination: shared by the tests of
the parallel layouts' refusals."""


def refusal(extra, world_size: int) -> str:
    """The ConfigError message ``validate_args`` gives the tiny config plus ``extra`` on
    ``world_size`` ranks ("" when it accepts them)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.errors import ConfigError
    args = parse_args(["--config", "configs/tiny.yaml", "--data-path", "unused", "--save", "x"]
                      + list(extra))
    try:
        validate_args(args, world_size=world_size)
    except ConfigError as err:
        return str(err)
    return ""
