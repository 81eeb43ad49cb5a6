"""Boundaries of :mod:`deepspeed_ext.runtime.log` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/runtime``), in this process: a logger of the
test's own with the package's :class:`ConsoleFallback`."""

import logging
import sys
import uuid

from deepspeed_ext.runtime.log import (PACKAGE_LOGGER, ConsoleFallback, install_console,
                                       log_line, rank_zero_lines)


def _own_logger():
    """A logger no other handler reaches (it does not propagate), with a fallback."""
    logger = logging.getLogger(f"moc_test_{uuid.uuid4().hex[:8]}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    fallback = ConsoleFallback()
    logger.addHandler(fallback)
    return logger, fallback


def test_the_fallback_writes_each_line_to_stdout_while_no_other_handler_has_it(capsys):
    logger, _ = _own_logger()
    log_line(logger, "[moc] saved global_step10")
    assert capsys.readouterr().out == "[moc] saved global_step10\n"
    other = logging.NullHandler()
    logger.addHandler(other)
    log_line(logger, "[moc] saved global_step20")
    assert capsys.readouterr().out == ""
    logger.removeHandler(other)
    child = logger.getChild("part")   # a child propagating up to the fallback's logger
    log_line(child, "[moc] rank 0: WARNING: slow")
    assert capsys.readouterr().out == "[moc] rank 0: WARNING: slow\n"


def test_a_handler_above_a_propagating_logger_gets_the_line_instead(capsys):
    parent, _ = _own_logger()
    parent.removeHandler(parent.handlers[0])
    records = []
    catcher = logging.Handler()
    catcher.emit = records.append
    parent.addHandler(catcher)
    child = parent.getChild("part")
    child.addHandler(ConsoleFallback())
    log_line(child, "[moc] hello")
    assert capsys.readouterr().out == "" and [r.getMessage() for r in records] == ["[moc] hello"]


def test_rank_zero_lines_logs_with_its_prefix_at_the_lines_level(capsys):
    logger, _ = _own_logger()
    levels = []
    catcher = logging.Handler()
    catcher.emit = lambda record: levels.append((record.levelno, record.getMessage()))
    log = rank_zero_lines(logger)
    log("WARNING: retention failed")
    assert capsys.readouterr().out == "[moc] WARNING: retention failed\n"
    logger.addHandler(catcher)
    rank_zero_lines(logger, prefix="[x] ")("ok")
    assert levels == [(logging.INFO, "[x] ok")]


class _FakeDist:
    """What ``rank_zero_lines`` reads of an imported ``torch.distributed``."""

    def __init__(self, initialized, rank):
        self.is_available = lambda: True
        self.is_initialized = lambda: initialized
        self.get_rank = lambda: rank


def test_rank_zero_lines_are_dropped_on_other_ranks_only(capsys, monkeypatch):
    logger, _ = _own_logger()
    for initialized, rank, printed in ((True, 1, ""), (True, 0, "[moc] x\n"),
                                       (False, 1, "[moc] x\n")):   # no group: rank 0
        monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDist(initialized, rank))
        rank_zero_lines(logger)("x")
        assert capsys.readouterr().out == printed, (initialized, rank)


def test_the_fallback_prints_when_no_handler_up_to_the_root_has_the_line(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])   # pytest's capture too
    parent = logging.getLogger(f"moc_test_{uuid.uuid4().hex[:8]}")
    parent.setLevel(logging.INFO)
    parent.addHandler(ConsoleFallback())
    log_line(parent.getChild("part"), "[moc] up to the root")
    assert capsys.readouterr().out == "[moc] up to the root\n"


def test_a_stdout_that_fails_is_reported_by_logging_not_raised(monkeypatch):
    class Broken:
        def write(self, text):
            raise OSError("stdout closed")

        def flush(self):
            pass
    handled = []
    logger, fallback = _own_logger()
    monkeypatch.setattr(fallback, "handleError", handled.append)
    monkeypatch.setattr(sys, "stdout", Broken())
    log_line(logger, "[moc] lost")
    assert [record.getMessage() for record in handled] == ["[moc] lost"]


def test_install_console_sets_only_what_nobody_set(monkeypatch):
    package = logging.getLogger(PACKAGE_LOGGER)
    level = package.level
    monkeypatch.setattr(package, "handlers", [h for h in package.handlers
                                              if not isinstance(h, ConsoleFallback)])
    try:
        package.setLevel(logging.NOTSET)
        install_console()
        install_console()
        assert package.level == logging.INFO
        assert sum(isinstance(h, ConsoleFallback) for h in package.handlers) == 1
        package.setLevel(logging.WARNING)
        install_console()
        assert package.level == logging.WARNING
    finally:
        package.setLevel(level)
