"""The report-file commit protocol, without processes."""

import threading
import time

import pytest

from deepspeed_ext.commit import (CommitError, remove_reports, report_name, wait_for_reports,
                                  write_report)


def test_waits_for_every_report_in_rank_order(tmp_path):
    def late():
        time.sleep(0.2)
        write_report(str(tmp_path), 1, {"who": 1})
    write_report(str(tmp_path), 0, {"who": 0})
    thread = threading.Thread(target=late)
    thread.start()
    assert wait_for_reports(str(tmp_path), 2, timeout_s=10) == [{"who": 0}, {"who": 1}]
    thread.join()
    remove_reports(str(tmp_path), 2)
    assert list(tmp_path.iterdir()) == []


def test_error_report_stops_the_wait_at_once(tmp_path):
    write_report(str(tmp_path), 1, None, error="OSError: disk full")
    start = time.monotonic()
    with pytest.raises(CommitError, match="rank 1: OSError: disk full"):
        wait_for_reports(str(tmp_path), 3, timeout_s=30)
    assert time.monotonic() - start < 5


def test_missing_reports_time_out_naming_the_ranks(tmp_path):
    write_report(str(tmp_path), 0, {})
    with pytest.raises(CommitError, match=r"rank\(s\) 1, 2 within"):
        wait_for_reports(str(tmp_path), 3, timeout_s=0.3)


def test_report_of_another_rank_or_garbage_is_refused(tmp_path):
    write_report(str(tmp_path), 0, {})
    (tmp_path / report_name(0)).replace(tmp_path / report_name(1))
    with pytest.raises(CommitError, match="not a report of rank 1"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)
    (tmp_path / report_name(1)).write_text("{not json")
    with pytest.raises(CommitError, match="unreadable"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)


def test_a_report_carries_payload_or_error():
    with pytest.raises(ValueError):
        write_report("/nonexistent", 0, None)
    with pytest.raises(ValueError):
        write_report("/nonexistent", 0, {}, error="x")
