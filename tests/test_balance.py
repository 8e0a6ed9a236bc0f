"""Checking a user's balance and the uniform split."""

import pytest

from tfpipe import balance


def test_uniform_split():
    assert balance.uniform(10, 4) == [3, 3, 2, 2]
    assert balance.uniform(3, 3) == [1, 1, 1]
    assert balance.uniform(5, 1) == [5]


def test_uniform_errors():
    with pytest.raises(ValueError, match="more than the 3 layers"):
        balance.uniform(3, 4)
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1"):
        balance.uniform(3, 0)


def test_check_errors():
    assert balance.check((1, 2), 3) == [1, 2]
    with pytest.raises(ValueError, match=r"sums to 4 but there are 3 layers"):
        balance.check([2, 2], 3)
    with pytest.raises(ValueError, match="at least one layer"):
        balance.check([3, 0], 3)
    with pytest.raises(TypeError, match="must be ints"):
        balance.check([1.5, 1.5], 3)
    with pytest.raises(TypeError, match="must be a list of ints"):
        balance.check(3, 3)
    with pytest.raises(ValueError, match="balance is empty"):
        balance.check([], 3)
