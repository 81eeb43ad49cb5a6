"""The commands, repository paths and flags the docs show, read as a user reads them (for
tests/test_readme.py, which checks them, and tests/test_doc_commands.py, which runs some).

Pages: README.md, docs/*.md and benchmarks/README.md. A *command* is a line of a fenced
``bash`` block (``\\`` continuations joined, the ``#`` comment dropped), or an inline code
span that starts with a program (``python``, ``bash``, ``source``, ``pip``, ``deepspeed``,
``torchrun`` or a ``moc-*`` console script, after any ``NAME=value``) and has arguments.

The docs' placeholders, one convention for every page:

- an ALL-CAPS word (``DATA``, ``CONFIG``, ``NODES``, ``PREFIX``, ``DIR``, ``FILE``...) or a
  ``<name>`` is a value the user supplies, taken as written;
- ``...`` stands for more flags the user supplies, or for a flag's value;
- ``[x]`` marks ``x`` optional: it is checked as if given; ``[flags...]`` is any flags;
- a path is the user's (never checked) unless it starts with one of the repository's
  directories (:data:`REPO_DIRS`) or names a file at the repository root: then it must
  exist. A ``--config`` that is the user's file (``my.yaml``) is left out of the parse.
"""

import glob
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, List

from tests.launch import REPO

REPO_DIRS = ("benchmarks", "configs", "deepspeed_ext", "docs", "examples", "experiments",
             "megatron", "scripts", "tests", "tools")
ELIDED = "..."
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^>]+>)$")
# Programs an inline code span may start with to count as a command.
PROGRAMS = ("python", "python3", "bash", "source", "pip", "deepspeed", "torchrun")
SEPARATORS = (";", "&&", "||", "|")
FENCE_LANGUAGES = ("bash", "sh", "shell")


@dataclass(frozen=True)
class Command:
    """A command as a page shows it: ``text`` has its continuations joined, its comment
    dropped and its whitespace collapsed (the key of the coverage registry)."""
    page: str
    line: int
    text: str
    fenced: bool

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass
class Step:
    """One simple command of a list or pipeline: ``NAME=value`` words, the program and its
    arguments (optional brackets removed; ``...`` kept as :data:`ELIDED`)."""
    program: str
    args: List[str]
    env: Dict[str, str] = field(default_factory=dict)


def doc_pages() -> List[str]:
    """The pages, relative to the repository root."""
    pages = ["README.md", *sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))),
             os.path.join(REPO, "benchmarks", "README.md")]
    return [os.path.relpath(os.path.join(REPO, p), REPO) for p in pages]


def _read(page: str) -> List[str]:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read().splitlines()


def _blocks(page: str):
    """(line number, line, fence language or None outside fences) for every line."""
    language = None
    for number, line in enumerate(_read(page), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            language = None if language is not None else (stripped[3:].strip() or "text")
            continue
        yield number, line, language


def _drop_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` that starts a word)."""
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0]


def fenced_commands(page: str) -> List[Command]:
    out, pending, start = [], "", 0
    for number, line, language in _blocks(page):
        if language not in FENCE_LANGUAGES:
            continue
        text = _drop_comment(line).rstrip()
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text = " ".join((pending + text).split())
        pending = ""
        if text:
            out.append(Command(page, start, text, fenced=True))
    return out


def code_spans(page: str):
    """(line number, span) for each inline code span outside fences."""
    for number, line, language in _blocks(page):
        if language is None:
            for span in re.findall(r"`([^`\n]+)`", line):
                yield number, span


def inline_commands(page: str) -> List[Command]:
    out = []
    for number, span in code_spans(page):
        words = span.split()
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if len(words) >= 2 and (words[0] in PROGRAMS or re.match(r"^moc-[a-z-]+$", words[0])):
            out.append(Command(page, number, " ".join(span.split()), fenced=False))
    return out


def commands() -> List[Command]:
    """Every command of every page, in page order."""
    return [c for page in doc_pages() for c in fenced_commands(page) + inline_commands(page)]


def _tokens(text: str) -> List[str]:
    text = re.sub(r"<([^<>\s]+)>", r"PLACEHOLDER_\1", text)  # <save> -> one word
    text = re.sub(r"(?<!\S)\d*(?:>>|>&|&>|>|<)\s*\S+", " ", text)  # redirections
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    return list(lexer)


def _unbracket(token: str) -> str:
    """``[--flag`` -> ``--flag``, ``value]]`` -> ``value``; ``.[gpu]`` stays."""
    token = token.lstrip("[")
    return token if "[" in token else token.rstrip("]")


def steps(text: str) -> List[Step]:
    """The simple commands of ``text``, in order."""
    out, words = [], []
    for token in _tokens(text) + [";"]:
        if token not in SEPARATORS:
            word = _unbracket(token)
            if word and not (word.endswith(ELIDED) and word != ELIDED):  # flags... FLAGS...
                words.append(word)
            continue
        env = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        while words and words[0] == ELIDED:  # MOC_PRINT_ARGS=1 ... bash ...
            words.pop(0)
        if words:
            out.append(Step(words[0], words[1:], env))
        words = []
    return out


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.match(word)) or word.startswith("PLACEHOLDER_") or word == ELIDED


def repo_path(word: str):
    """The repository path ``word`` names (``configs/x.yaml``, ``a.py:12``,
    ``tests/t.py::test_x``, ``--config=configs/x.yaml``), or None."""
    word = word.split("=", 1)[-1].strip(".,;:()\"'")
    word = re.sub(r"(::\S*|:\d+|#\S*)$", "", word)
    if not word or any(c in word for c in "<>*{}$") or "PLACEHOLDER_" in word:
        return None
    top = word.split("/", 1)[0]
    if top in REPO_DIRS and "/" in word:
        return word
    if "/" not in word and os.path.splitext(word)[1] in (".py", ".toml", ".md", ".ini") \
            and word in os.listdir(REPO):
        return word
    return None


def named_paths(page: str):
    """(line number, repository path) for each path of the repository ``page`` names:
    in its prose and code spans, and in its fenced commands."""
    for number, line, language in _blocks(page):
        if language is None:
            for word in re.findall(r"[A-Za-z0-9_./:~<>*{}$-]+", line):
                if repo_path(word):
                    yield number, repo_path(word)
    for command in fenced_commands(page):
        for word in command.text.split():
            if repo_path(word):
                yield command.line, repo_path(word)
