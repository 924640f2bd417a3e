"""Prompts the library takes as token ids (api.prompt_token_ids): lists and tuples of Python's or
numpy's integers, numpy arrays and torch tensors of one sequence ([T], or [1, T] as a tokenizer's
`return_tensors` gives it); anything else a MoaspecError that says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moaspec.api import prompt_token_ids
from moaspec.errors import MoaspecError


class VocabOnly:
    vocab_size = 100
    tokenizer = None


@pytest.mark.parametrize("prompt", [
    [1, 2, 99], (1, 2, 99), [np.int64(1), np.int32(2), np.uint16(99)],  # an audit: numpy's integers were refused
    np.array([1, 2, 99]), np.array([[1, 2, 99]], dtype=np.int32), torch.tensor([1, 2, 99]), torch.tensor([[1, 2, 99]]),
])
def test_token_ids_in_every_usual_form_are_taken_as_python_ints(prompt) -> None:
    ids = prompt_token_ids(VocabOnly(), prompt)
    assert ids == [1, 2, 99] and all(type(t) is int for t in ids)


@pytest.mark.parametrize(("prompt", "message"), [
    ([1, 100], r"integers in \[0, 100\)"), ([1, -1], r"integers in \[0, 100\)"), ([1, True], "integers"),
    ([1, 2.0], "integers"), (np.array([1.0, 2.0]), "integers"), (torch.tensor([1.5]), "integers"),
    (np.array([True, False]), "integers"), (torch.tensor([[1, 2], [3, 4]]), r"one sequence, \[T\] or \[1, T\], got shape \[2, 2\]"),
    (np.zeros((1, 1, 3), dtype=np.int64), r"got shape \[1, 1, 3\]"),
])
def test_token_ids_that_are_not_one_sequence_of_integers_in_the_vocabulary_are_refused(prompt, message) -> None:
    with pytest.raises(MoaspecError, match=message):
        prompt_token_ids(VocabOnly(), prompt)
