"""The split protocol's field checks at their bounds (a mutation audit found them free to move):
token ids one past the vocabulary, path indices one past the tree, booleans posing as integers,
a non-boolean `closed`, context rows that do not match the verified tokens."""

from __future__ import annotations

import pytest
import torch

from moaspec.split import protocol as wire
from moaspec.split.protocol import ProtocolError

VOCAB = 10


def test_integers_are_integers_in_their_range_never_booleans() -> None:
    assert wire.get_int({"seq": 3}, "seq", 0, 3) == 3
    for bad in (True, 4, -1, 1.0, "1"):
        with pytest.raises(ProtocolError, match="'seq' must be an integer in"):
            wire.get_int({"seq": bad}, "seq", 0, 3)


def test_token_ids_stop_one_below_the_vocabulary() -> None:
    assert wire.get_ids({"ids": [0, VOCAB - 1]}, "ids", VOCAB, 1, 4) == [0, VOCAB - 1]
    for bad in ([VOCAB], [-1], [True], [1, 2, 3, 4, 5], []):
        with pytest.raises(ProtocolError):
            wire.get_ids({"ids": bad}, "ids", VOCAB, 1, 4)


def reply(**fields) -> dict:
    context = {"keys": wire.encode_tensor(torch.zeros(2, 3), "f32")}
    return {"path_node_idx": [0, 2], "next_token": VOCAB - 1, "context": context, **fields}


def test_a_verification_names_nodes_of_the_sent_tree_and_a_token_of_the_vocabulary() -> None:
    parsed = wire.parse_verification(reply(), VOCAB, num_nodes=3)
    assert parsed.path_node_idx == [0, 2] and parsed.next_token == VOCAB - 1 and not parsed.closed
    assert parsed.context["keys"].shape == (2, 3)
    bad_replies = {  # each differs from the accepted reply in one field
        "path_node_idx": reply(path_node_idx=[0, 3]),  # node 3 of a 3-node tree
        "next_token": reply(next_token=VOCAB),
        "closed": reply(closed="no"),
        "rows": reply(context={"keys": wire.encode_tensor(torch.zeros(3, 3), "f32")}),  # 3 rows for 2 tokens
    }
    for name, message in bad_replies.items():
        with pytest.raises(ProtocolError):
            wire.parse_verification(message, VOCAB, num_nodes=3)
