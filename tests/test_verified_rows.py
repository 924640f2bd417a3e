"""The per-token rows a llama.cpp target keeps for its drafter (targets/llamacpp_features.VerifiedRows):
written, grown, truncated and read back as written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moaspec.targets.llamacpp_features import VerifiedRows


def test_rows_read_back_as_written_through_growth_truncation_and_gaps() -> None:
    rng = np.random.default_rng(0)
    rows = VerifiedRows()
    first = rng.standard_normal((200, 2, 3), dtype=np.float32)
    rows.write(0, first)
    second = torch.randn(100, 2, 3)  # the float prefill's rows are torch's: converted
    rows.write(200, second)  # past the first buffer's 256 rows: grown, the first rows kept
    assert rows.valid == 300
    np.testing.assert_array_equal(rows.read(0, 200), first)
    np.testing.assert_array_equal(rows.read(200, 300), second.numpy())
    rows.truncate(150)
    rows.write(160, first[:5])  # past a gap: ignored
    rows.write(151, first[:5])  # past a gap of one position too (a mutation audit's)
    assert rows.valid == 150
    rows.truncate(400)  # beyond the valid rows: the rows after them were never written (an audit's)
    assert rows.valid == 150
    rows.write(150, first[:5])
    assert rows.valid == 155
    np.testing.assert_array_equal(rows.read(145, 155), np.concatenate([first[145:150], first[:5]]))


def test_rows_of_another_shape_start_again_from_the_first_position_only() -> None:
    rows = VerifiedRows()
    rows.write(0, np.ones((4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="at position 2"):
        rows.write(2, np.ones((4, 5), dtype=np.float32))  # positions 0-1 would be left unwritten
    rows.write(0, np.full((2, 5), 7.0, dtype=np.float32))
    assert rows.valid == 2
    np.testing.assert_array_equal(rows.read(0, 2), np.full((2, 5), 7.0))
