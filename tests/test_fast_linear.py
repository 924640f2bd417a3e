"""Weight layout: column-major storage changes memory layout, not values; the setting is checked."""

import pytest
import torch
from torch import nn

from moaspec.errors import MoaspecError
from moaspec.nn.fast_linear import (
    column_major,
    use_column_major,
    use_configured_layout,
    weight_in_configured_layout,
    weight_layout,
)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16), nn.Linear(16, 32, bias=False))
    net[2].weight = net[0].weight  # tied
    return net


def test_column_major_keeps_shape_and_values():
    weight = torch.randn(32, 16)
    relaid = column_major(weight)
    assert relaid.shape == (32, 16) and relaid.stride() == (1, 32)
    assert torch.equal(relaid, weight)


def test_use_column_major_relays_every_linear_once_and_keeps_outputs():
    net = _net()
    x = torch.randn(4, 16)
    before = net(x)
    use_column_major(net)
    assert net[0].weight.stride() == (1, 32) and net[1].weight.stride() == (1, 16)
    assert net[2].weight is net[0].weight
    torch.testing.assert_close(net(x), before, rtol=1e-6, atol=1e-6)


def test_the_setting_picks_the_layout(monkeypatch):
    monkeypatch.delenv("MOASPEC_WEIGHT_LAYOUT", raising=False)
    assert weight_layout() == "row"
    net = _net()
    storages = [p.data_ptr() for p in net.parameters()]
    use_configured_layout(net)
    assert [p.data_ptr() for p in net.parameters()] == storages  # row: untouched
    weight = torch.randn(8, 4)
    assert weight_in_configured_layout(weight).stride() == (4, 1)
    monkeypatch.setenv("MOASPEC_WEIGHT_LAYOUT", "Column")
    assert weight_in_configured_layout(weight).stride() == (1, 8)
    assert use_configured_layout(net)[1].weight.stride() == (1, 16)


def test_an_unknown_layout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MOASPEC_WEIGHT_LAYOUT", "diagonal")
    with pytest.raises(MoaspecError, match="MOASPEC_WEIGHT_LAYOUT must be one of row, column"):
        weight_layout()
