"""A layer is built without torch's default initialisation, since its weights are drawn or read right after: the
result must be exactly what drawing over default-initialised parameters gave, and torch's init functions must be
back in place afterwards."""

import pytest
import torch
from torch import nn

from ftlab.runtime.core.model_spec import ModelConfig, layer_kind, layer_specs
from ftlab.runtime.training import model
from ftlab.runtime.training.model_families import FAMILIES as HF_FAMILIES
from ftlab.runtime.training.model_families import hf_config

INIT_FUNCTIONS = ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_")


def _default_initialised(cfg: ModelConfig, index: int) -> nn.Module:
    """The layer as torch's constructors initialise it, with nothing switched off."""
    hf = hf_config(cfg)
    family = HF_FAMILIES[hf.model_type]
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return family.embedding(hf)
    if kind == "head":
        return family.head(hf)
    return family.block(hf, index - 1)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_layers_built_without_default_init_equal_drawn_over_default_init(family):
    cfg = ModelConfig(name=f"{family}-init", family=family, num_blocks=2, hidden=32, heads=4, vocab_size=40, seq_len=8)
    for spec in layer_specs(cfg):
        built = model.build_layer(cfg, spec.index, seed=11).state_dict()
        reference = _default_initialised(cfg, spec.index)
        model._initialise(cfg, reference, model._layer_generator(11, spec.index))
        expected = reference.state_dict()
        assert built.keys() == expected.keys()
        for key in expected:  # buffers (rotary frequencies) included
            assert torch.equal(built[key], expected[key].to(built[key].dtype)), (family, spec.index, key)


def test_torch_init_functions_are_restored_after_a_build():
    originals = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    model.build_layer(ModelConfig(), 1, seed=0)
    assert {name: getattr(nn.init, name) for name in INIT_FUNCTIONS} == originals
    weight = torch.zeros(4, 4)
    nn.init.ones_(weight)
    assert torch.equal(weight, torch.ones(4, 4))
