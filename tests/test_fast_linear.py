"""Weight layout: column-major storage changes memory layout, not values; the setting is checked."""

import pytest
import torch
from torch import nn

from moaspec.errors import MoaspecError
from moaspec.nn.fast_linear import column_major, layout_of, use_layout, weight_in_layout
from moaspec.nn.layout_names import requested_layout


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


def test_use_layout_relays_every_linear_once_and_keeps_outputs():
    net = _net()
    x = torch.randn(4, 16)
    before = net(x)
    use_layout(net, "column")
    assert net[0].weight.stride() == (1, 32) and net[1].weight.stride() == (1, 16)
    assert net[2].weight is net[0].weight and layout_of(net) == "column"
    torch.testing.assert_close(net(x), before, rtol=1e-6, atol=1e-6)
    use_layout(net, "row")  # and back, as a calibration that measured both layouts does
    assert net[0].weight.stride() == (16, 1) and layout_of(net) == "row"
    torch.testing.assert_close(net(x), before, rtol=1e-6, atol=1e-6)


def test_row_layout_of_a_row_major_module_copies_nothing():
    net = _net()
    storages = [p.data_ptr() for p in net.parameters()]
    use_layout(net, "row")
    assert [p.data_ptr() for p in net.parameters()] == storages
    weight = torch.randn(8, 4)
    assert weight_in_layout(weight, "row").stride() == (4, 1)
    assert weight_in_layout(weight, "column").stride() == (1, 8)


def test_the_setting_fixes_the_layout(monkeypatch):
    monkeypatch.delenv("MOASPEC_WEIGHT_LAYOUT", raising=False)
    assert requested_layout() is None  # the machine calibration chooses
    monkeypatch.setenv("MOASPEC_WEIGHT_LAYOUT", "Column")
    assert requested_layout() == "column"


def test_an_unknown_layout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MOASPEC_WEIGHT_LAYOUT", "diagonal")
    with pytest.raises(MoaspecError, match="MOASPEC_WEIGHT_LAYOUT must be one of row, column"):
        requested_layout()
    with pytest.raises(MoaspecError, match="weight layout must be one of row, column"):
        use_layout(_net(), "diagonal")
