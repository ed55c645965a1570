"""The store's 4-bit unit kind on its own: a bitsandbytes weight placed in a flat buffer is the same bytes, views
back to the same dequantized weight, and the layout's size is what the plan counts; the multi-process store
refuses it at setup."""

import bitsandbytes.functional as F
import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.weights.packed4bit import Packed4bit, packed_4bit_nbytes
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.engine.weights.topology import Topology
from lightning_lazytrain.models.quantize import quantized_linear


def _layer(quant_type: str) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.LayerNorm(96), nn.Linear(96, 200))  # 19,200 weights: not a whole number of blocks
    layer[1] = quantized_linear(layer[1], quant_type, torch.float32)
    return layer


@pytest.mark.parametrize("stream_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_placed_4bit_weight_views_back_to_the_same_weight(quant_type, stream_dtype):
    layer = _layer(quant_type)
    weight = layer[1].weight
    dequantized = F.dequantize_4bit(weight.data, weight.quant_state).clone()
    codes = weight.data.clone()
    store = HostParamStore([("layer.0", [layer])], torch.float32, stream_dtype, pin=False)
    (unit,) = store.units
    (entry,) = [e for e in unit.unique if e.packed is not None]
    assert entry.packed.nbytes == packed_4bit_nbytes(96 * 200) == Packed4bit.of(weight).nbytes
    assert weight.data.untyped_storage().data_ptr() == unit.stream.untyped_storage().data_ptr(), "held once"
    assert weight.quant_state.absmax.untyped_storage().data_ptr() == unit.stream.untyped_storage().data_ptr()
    assert torch.equal(weight.data, codes)
    copy = unit.stream.clone()  # a device slot's copy of the unit
    view = entry.view_in(copy)
    assert view.data.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()
    assert torch.equal(F.dequantize_4bit(view.data, view.quant_state), dequantized)
    x = torch.randn(3, 96)
    with torch.no_grad():
        ref = layer[1](x)
        layer[1]._parameters["weight"] = view
        assert torch.equal(layer[1](x), ref), "bitsandbytes' Linear4bit runs the view as it runs the weight"


def test_the_multi_process_store_refuses_a_4bit_base_naming_the_fix():
    topology = Topology(rank=0, world_size=1, local_rank=0, local_world=1, node_rank=0, num_nodes=1)
    with pytest.raises(ValueError, match=r"Linear4bit\.weight is a bitsandbytes 4-bit weight.*devices=1"):
        SharedParamStore([("layer.0", [_layer("nf4")])], torch.float32, torch.bfloat16, pin=False, topology=topology)
