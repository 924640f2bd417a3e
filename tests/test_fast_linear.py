"""Weight layout: re-laying Linear weights out column-major changes storage, not values."""

import torch
from torch import nn

from moaspec.nn.fast_linear import (
    column_major,
    in_fastest_layout,
    linear_weights_by_shape,
    measure_column_major_shapes,
    use_column_major,
)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16), nn.Linear(16, 32, bias=False))
    net.register_buffer("scale", torch.ones(16))
    return net


def test_column_major_keeps_shape_and_values():
    weight = torch.randn(32, 16)
    relaid = column_major(weight)
    assert relaid.shape == (32, 16) and relaid.stride() == (1, 32)
    assert torch.equal(relaid, weight)


def test_weights_are_grouped_by_shape_and_tied_weights_counted_once():
    net = _net()
    net[2].weight = net[0].weight
    groups = linear_weights_by_shape(net)
    assert sorted(groups) == [(16, 32), (32, 16)]
    assert len(groups[(32, 16)]) == 1 and len(groups[(16, 32)]) == 1


def test_use_column_major_relays_only_the_named_shapes_and_keeps_outputs():
    net = _net()
    x = torch.randn(4, 16)
    before = net(x)
    use_column_major(net, {(32, 16)})
    assert net[0].weight.stride() == (1, 32) and net[2].weight.stride() == (1, 32)
    assert net[1].weight.stride() == (32, 1)
    torch.testing.assert_close(net(x), before, rtol=1e-6, atol=1e-6)


def test_nothing_relaid_leaves_every_tensor_in_place():
    net = _net()
    storages = [p.data_ptr() for p in net.parameters()]
    use_column_major(net, set())
    assert [p.data_ptr() for p in net.parameters()] == storages


def test_measurement_names_only_shapes_of_the_module():
    net = _net()
    assert measure_column_major_shapes(net, rows=2) <= set(linear_weights_by_shape(net))


def test_fastest_layout_of_one_weight_has_the_same_values():
    weight = torch.randn(64, 16)
    assert torch.equal(in_fastest_layout(weight), weight)
