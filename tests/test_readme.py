"""The README documents every flag the trainer accepts and the two commands."""

import os

from megatron.training.arguments import build_parser

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_lists_every_flag():
    text = open(README).read()
    missing = [opt for action in build_parser()._actions for opt in action.option_strings
               if opt.startswith("--") and opt != "--help" and f"`{opt}`" not in text]
    assert not missing, f"flags missing from README.md: {missing}"


def test_readme_starts_with_the_two_commands():
    head = open(README).read().split("\n## ")[0]
    assert "bash scripts/quickstart.sh" in head and "bash scripts/test.sh" in head
