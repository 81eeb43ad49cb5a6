"""Boundaries of :mod:`deepspeed_ext.store.locking` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import logging

from deepspeed_ext.store.locking import LOCK_FILE, locked_dir


def test_a_local_directory_is_locked_through_a_lock_file_it_creates(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deepspeed_ext.store.locking"):
        with locked_dir(str(tmp_path)):
            assert (tmp_path / LOCK_FILE).is_file()
    assert "cannot lock" not in caplog.text


def test_a_directory_that_cannot_be_locked_is_said_once(tmp_path, caplog):
    (tmp_path / LOCK_FILE).mkdir()   # not a file: no lock can be had
    with caplog.at_level(logging.WARNING, logger="deepspeed_ext.store.locking"):
        for _ in range(2):
            with locked_dir(str(tmp_path)):
                pass
    assert caplog.text.count("cannot lock") == 1
