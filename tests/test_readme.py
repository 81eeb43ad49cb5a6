"""The docs: docs/flags.md documents every flag the trainer accepts; README.md starts with
the two commands and stays short; every relative link of README.md and docs/*.md points to
a file that exists."""

import glob
import os
import re

from megatron.training.arguments import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FLAGS = os.path.join(ROOT, "docs", "flags.md")
README_MAX_LINES = 260

# [text](target) and ![alt](target), the target up to a space or ")"; code spans removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def test_flags_page_lists_every_flag():
    text = open(FLAGS).read()
    missing = [opt for action in build_parser()._actions for opt in action.option_strings
               if opt.startswith("--") and opt != "--help" and f"`{opt}`" not in text]
    assert not missing, f"flags missing from docs/flags.md: {missing}"


def test_readme_starts_with_the_two_commands():
    head = open(README).read().split("\n## ")[0]
    assert "bash scripts/quickstart.sh" in head and "bash scripts/test.sh" in head


def test_readme_is_short():
    lines = len(open(README).read().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/")


def relative_links(path):
    """The relative link targets of a Markdown file, outside fenced code blocks and code spans."""
    targets, fenced = [], False
    for line in open(path).read().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor on the same page
            targets.append(target)
    return targets


def test_relative_links_point_to_files_that_exist():
    pages = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) > 1, "docs/*.md not found"
    broken = []
    for page in pages:
        for target in relative_links(page):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not broken, f"relative links to missing files: {broken}"
