"""A refused client is told to come back when a place is likely free, not always in 1 s."""
from shardwise.worker.serving.retry_after import MAX_SECONDS, MIN_SECONDS, FinishRate, retry_after


def test_the_wait_grows_with_the_places_missing_and_shrinks_with_the_finish_rate():
    assert retry_after(10, 2.0) == 5
    assert retry_after(10, 20.0) == MIN_SECONDS          # half a second rounds up to the minimum
    assert retry_after(3, 0.5) == 6
    assert retry_after(1000, 0.1) == MAX_SECONDS         # never so long that a client gives up


def test_with_nothing_measured_yet_the_wait_is_the_minimum():
    assert retry_after(50, None) == MIN_SECONDS
    assert FinishRate().retry_after(50, now=100.0) == MIN_SECONDS


def test_the_rate_counts_recent_finishes_up_to_now():
    rate = FinishRate()
    for t in range(10):                                   # one finish a second for 10 s
        rate.record(100.0 + t)
    assert abs(rate.per_second(now=110.0) - 1.0) < 1e-9
    assert rate.retry_after(8, now=110.0) == 8
    # the queue then stalls behind long requests: the measured rate falls as time passes with no finish
    assert rate.per_second(now=200.0) < 0.2
    assert rate.retry_after(8, now=200.0) > 8
    # finishes older than two minutes say nothing of now
    assert rate.per_second(now=400.0) is None
