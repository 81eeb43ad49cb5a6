"""deepspeed_ext.runtime.retry: the polls, sleeps and timeout of the library's waits,
on a fake clock (no real sleeping, no timed assertion)."""

import pytest

from deepspeed_ext.runtime.retry import Backoff, poll_until


class FakeTime:
    """A clock that only moves when slept on; records every sleep."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def _answers(*results):
    calls = []

    def attempt():
        calls.append(None)
        return results[len(calls) - 1]
    return attempt, calls


def test_the_delays_double_from_first_up_to_max():
    delays = Backoff(first_s=0.05, max_s=1.0).delays()
    assert [next(delays) for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    # a first delay above the cap is slept once as given (the committer's poll_s)
    delays = Backoff(first_s=0.5, max_s=0.2).delays()
    assert [next(delays) for _ in range(3)] == [0.5, 0.2, 0.2]


def test_it_returns_the_first_answer_and_sleeps_only_between_polls():
    t = FakeTime()
    attempt, calls = _answers(None, None, [], "late")
    result = poll_until(attempt, 60.0, Backoff(0.01, 0.2), lambda: "timeout",
                        sleep=t.sleep, clock=t.clock)
    assert result == []  # an empty answer is an answer (None alone means "not yet")
    assert len(calls) == 3 and t.sleeps == [0.01, 0.02]


def test_false_is_an_answer():
    t = FakeTime()
    assert poll_until(lambda: False, 1.0, Backoff(0.01, 0.2), lambda: True,
                      sleep=t.sleep, clock=t.clock) is False
    assert t.sleeps == []


def test_after_the_deadline_it_polls_once_more_then_times_out():
    t = FakeTime()
    calls = []

    def attempt():
        calls.append(t.now)
        return None

    result = poll_until(attempt, 1.0, Backoff(0.25, 0.5), lambda: ("timed out", t.now),
                        sleep=t.sleep, clock=t.clock)
    # polls at 100, 100.25, 100.75, 101.25: the last one is past the deadline (101)
    assert calls == [100.0, 100.25, 100.75, 101.25]
    assert t.sleeps == [0.25, 0.5, 0.5]
    assert result == ("timed out", 101.25)


def test_a_zero_timeout_still_polls_once():
    t = FakeTime()
    attempt, calls = _answers(None)
    assert poll_until(attempt, 0.0, Backoff(0.01, 0.2), lambda: "timeout",
                      sleep=t.sleep, clock=t.clock) == "timeout"
    assert len(calls) == 1 and t.sleeps == []


def test_errors_of_the_attempt_and_of_the_timeout_reach_the_caller_unchanged():
    t = FakeTime()

    def failing():
        raise KeyError("claim lost")

    with pytest.raises(KeyError, match="claim lost"):
        poll_until(failing, 60.0, Backoff(0.01, 0.2), lambda: None, sleep=t.sleep, clock=t.clock)
    assert t.sleeps == []  # no retry after an exception: the attempt decides what to retry

    def give_up():
        raise TimeoutError("no report from rank(s) 1")

    with pytest.raises(TimeoutError, match="rank"):
        poll_until(lambda: None, 0.5, Backoff(0.1, 0.2), give_up, sleep=t.sleep, clock=t.clock)
