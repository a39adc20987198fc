"""``LogitRows``: a decode's logits by slot, backed by the one array the device wrote."""

from __future__ import annotations

import numpy as np
import pytest

from qaic_core.execution import LogitRows


def test_rows_of_the_listed_slots_only_in_their_order() -> None:
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows = LogitRows(matrix, [2, 0])
    assert list(rows) == [2, 0] and len(rows) == 2
    np.testing.assert_array_equal(rows[2], matrix[2])
    assert 1 not in rows
    with pytest.raises(KeyError):
        rows[1]
    assert dict(rows).keys() == {0, 2}


def test_take_stacks_the_rows_asked_for_as_a_copy() -> None:
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    taken = LogitRows(matrix, [0, 2, 3]).take(np.array([3, 0]))
    np.testing.assert_array_equal(taken, matrix[[3, 0]])
    taken[0, 0] = -1.0
    assert matrix[3, 0] == 9.0
