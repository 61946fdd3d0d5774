"""The harness's statistics: percentiles interpolate between closest ranks (numpy's default),
NaN for no samples so a report prints "-", and a percentile that is not a whole number is
refused instead of rounded."""

from __future__ import annotations

import math

import pytest

from lmcache_loadback.harness.bench.common import fmt, median, percentile


def test_percentiles_interpolate_between_closest_ranks():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 50) == median(xs) == 3.0
    assert percentile(xs, 99) == pytest.approx(4.96)  # 4 + 0.96 * (5 - 4)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


def test_no_samples_read_nan_and_print_a_dash():
    assert math.isnan(percentile([], 99)) and math.isnan(median([]))
    assert fmt(percentile([], 99)) == "-"


@pytest.mark.parametrize("p", [99.9, -1, 101])
def test_a_percentile_outside_whole_0_to_100_is_refused(p):
    with pytest.raises(ValueError, match="whole number from 0 to 100"):
        percentile([1.0, 2.0], p)
