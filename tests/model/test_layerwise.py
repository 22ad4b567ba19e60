"""Layer-by-layer execution equals the model's own forward, family by family.

Every tiny family (and a few variants that take other code paths) runs piecewise with left and
right padding on sequences longer than the sliding window (16 tokens in the tiny configs); the
logits must equal the model's own within ``ATOL`` in fp32 (measured: bit for bit), and a block
trained piecewise must get the model's own gradient. Models the code cannot run exactly are
refused when the stack or the block map is built.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSeq2SeqLM, LlamaForCausalLM, PreTrainedModel

from fedcybgd.client.updates.fo import block_loss
from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import EMBED, HEAD, BlockMap, UnsupportedModelError
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import TINY_CONFIGS, build_tiny, load_model, load_tokenizer
from fedcybgd.tasks.objective import label_loss

ATOL = 1e-5  # fp32 logits; the pieces run the model's own kernels, so the gap measured is 0
# fp32 gradients of scale ~1: with transformers 5.24 the model's own backward sums in another
# order than the piecewise one, up to 7e-7 apart (was 0); a wrong mask or input is ~1e-1 off
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
LENGTH = 40  # longer than every tiny sliding window (16)
ROW_LENGTHS = (LENGTH, 29, 11)
VOCAB = 1024  # the tokenizer's 49,152 would make the head most of each test's time

# Variants that take code paths the registry's configs do not.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen2 with sliding layers from max_window_layers up: a mask per attention type.
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                    max_window_layers=2)),
    # OPT-350m's shape: input/output projections around the layers, no final norm.
    "opt-350m-style": ("opt", dict(word_embed_proj_dim=32, do_layer_norm_before=False)),
    # A softcap small enough to bend the tiny model's logits (~1), so leaving it out shows.
    "gemma2-softcap": ("gemma2", dict(final_logit_softcapping=0.5)),
}
NAMES = sorted(TINY_CONFIGS) + sorted(VARIANTS)


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer("tiny-llama")


@functools.cache
def _model(name: str) -> PreTrainedModel:
    family, overrides = VARIANTS.get(name, (name, {}))
    model = build_tiny(family, _tokenizer(), vocab_size=VOCAB, **overrides).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@functools.cache
def _stack(name: str) -> LayerStack:
    return LayerStack(_model(name))


def padded_batch(side: str, vocab: int, seed: int = 0) -> Batch:
    """Rows of ``ROW_LENGTHS`` real tokens padded to ``LENGTH`` on ``side``."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(ROW_LENGTHS)
    ids = torch.randint(5, vocab, (rows, LENGTH), generator=generator)
    mask = torch.zeros(rows, LENGTH, dtype=torch.long)
    for row, length in enumerate(ROW_LENGTHS):
        if side == "right":
            mask[row, :length] = 1
        else:
            mask[row, LENGTH - length:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    last = torch.tensor([length - 1 if side == "right" else LENGTH - 1 for length in ROW_LENGTHS])
    targets = torch.randint(5, vocab, (rows,), generator=generator)
    return Batch(ids, mask, last, targets, torch.zeros(rows, dtype=torch.long),
                 torch.tensor([5, 6]))


def sliding_window(model: PreTrainedModel) -> int | None:
    """The model's sliding window if any layer uses one."""
    config = model.config
    types = getattr(config, "layer_types", None) or []
    uses = "sliding_attention" in types or model.config.model_type == "mistral"
    return getattr(config, "sliding_window", None) if uses else None


# ------------------------------------------------------------------------- logits


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", NAMES)
def test_piecewise_logits_equal_the_models_own(name, side):
    # Prepare
    model, stack = _model(name), _stack(name)
    batch = padded_batch(side, VOCAB)
    window = sliding_window(model)
    assert window is None or window < LENGTH  # the window really cuts the longest row
    # Execute
    with torch.no_grad():
        expected = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = stack.all_logits(batch.input_ids, batch.attention_mask)
        at_last = stack.forward_logits(batch.input_ids, batch.attention_mask, batch.last_index)
    # Assert: every real token, and the gathered rows the rules use
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=ATOL)
    rows = torch.arange(len(ROW_LENGTHS))
    torch.testing.assert_close(at_last, expected[rows, batch.last_index], rtol=0, atol=ATOL)


def test_old_shared_inputs_would_differ_on_alternating_families():
    # Prepare: what the previous runner did, layer 0's inputs for every layer
    stack = _stack("gemma3")
    batch = padded_batch("right", VOCAB)
    # Execute
    with torch.no_grad():
        hidden = stack.embed(batch.input_ids, batch.attention_mask)
        shared = hidden.__class__(
            hidden.states, [hidden.args[0]] * stack.num_layers,
            dict.fromkeys(range(stack.num_layers), hidden.kwargs[0]),
        )
        own = stack.head(stack.final_hidden(stack.run(hidden, 0, stack.num_layers).states))
        old = stack.head(stack.final_hidden(stack.run(shared, 0, stack.num_layers).states))
    # Assert: local and global layers get other rotary tables and masks
    sliding, full = hidden.kwargs[0], hidden.kwargs[2]
    assert not torch.equal(sliding["position_embeddings"][0], full["position_embeddings"][0])
    assert not torch.equal(sliding["attention_mask"], full["attention_mask"])
    assert float((own - old).abs().max()) > 1e-2


# ------------------------------------------------------------------------- gradients


# Both padding sides on a middle block; in the alternating tiny families layers 1 and 2 are of
# different attention types.
@pytest.mark.parametrize(("block", "side"), [
    (EMBED, "right"), ("layer.1", "right"), ("layer.1", "left"), ("layer.2", "left"),
    (HEAD, "right"),
])
@pytest.mark.parametrize("name", NAMES)
def test_block_gradient_equals_the_models_own(name, block, side):
    # Prepare: only the block's parameters require grad, as in the rules
    model, stack = _model(name), _stack(name)
    blocks = BlockMap(model, layers_per_block=1)
    params = blocks.parameters(model, block)
    batch = padded_batch(side, VOCAB, seed=1)
    rows = torch.arange(len(ROW_LENGTHS))
    try:
        for p in params:
            p.requires_grad_(True)
        # Execute: the model's own forward, then the fo rule's piecewise loss
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        expected = torch.autograd.grad(label_loss(logits[rows, batch.last_index], batch), params)
        loss = block_loss(stack, batch, blocks.lowest_layer([block]))
        got = torch.autograd.grad(loss, params)
    finally:
        for p in params:
            p.requires_grad_(False)
    # Assert
    assert any(float(g.abs().max()) > 0 for g in expected)
    for name_, a, b in zip(blocks.info(block).param_names, got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name_)


# ------------------------------------------------------------------------- mechanics


def test_embed_runs_no_decoder_layer_and_puts_the_layers_back():
    # Prepare
    model = copy.deepcopy(_model("gemma2"))
    stack = LayerStack(model)
    layers = list(stack.layers)
    calls = [0] * stack.num_layers
    handles = [
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(layers)
    ]
    batch = padded_batch("right", VOCAB)
    # Execute
    hidden = stack.embed(batch.input_ids, batch.attention_mask)
    for handle in handles:
        handle.remove()
    # Assert: inputs for every layer, no layer ran, the real layers are back in place
    assert calls == [0] * stack.num_layers
    assert len(hidden.args) == stack.num_layers and sorted(hidden.kwargs) == [0, 1, 2, 3]
    assert all(a is b for a, b in zip(stack.layers, layers, strict=True))
    assert all(a is b for a, b in zip(model.model.layers, layers, strict=True))


def test_probe_leaves_mode_and_rng_alone():
    # Prepare
    model = build_tiny("gemma3", _tokenizer(), vocab_size=VOCAB)
    model.train()
    model.model.layers[1].eval()  # a mixed state is put back as it was, module by module
    modes = [m.training for m in model.modules()]
    state = torch.random.get_rng_state()
    # Execute
    stack = LayerStack(model)
    # Assert
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.random.get_rng_state(), state)
    assert stack.num_layers == 4


def test_placeholder_hidden_refuses_to_run_layers():
    stack = _stack("llama")
    placeholder = stack.embed(torch.ones(1, 4, dtype=torch.long),
                              torch.ones(1, 4, dtype=torch.long))
    empty = placeholder.__class__(placeholder.states, (), {})
    with pytest.raises(ValueError, match="no inputs recorded for decoder layer 0"):
        stack.run(empty, 0, 1)


def test_probe_catches_a_missing_logit_transform():
    # Prepare: a stack that forgets Gemma2's final softcapping
    model = _model("gemma2-softcap")
    stack = LayerStack(model, verify=False)
    stack.head = model.get_output_embeddings()
    # Execute / Assert
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM.*differ"):
        stack.verify()


def test_head_with_a_frozen_weight_copy_keeps_the_logit_transform():
    # Prepare: a softcapped tied head and a copy of its weight
    stack = _stack("gemma2-softcap")
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    copy_ = stack.model.get_output_embeddings().weight.detach().clone()
    # Execute
    with torch.no_grad():
        live = stack.head_logits(rows)
        frozen = stack.head_logits(rows, copy_)
        raw = rows @ copy_.T
    # Assert: same logits both ways, and the softcap (0.5) really bent them
    torch.testing.assert_close(frozen, live, rtol=0, atol=ATOL)
    assert float(frozen.abs().max()) <= 0.5 < float(raw.abs().max())


# ------------------------------------------------------------------------- refusals


def test_encoder_decoder_is_refused_by_name():
    # Prepare
    config = AutoConfig.for_model("t5", vocab_size=128, d_model=32, d_ff=64, d_kv=8,
                                  num_layers=2, num_heads=4)
    model = AutoModelForSeq2SeqLM.from_config(config)
    # Execute / Assert
    for build in (LayerStack, BlockMap):
        with pytest.raises(UnsupportedModelError,
                           match=r"T5ForConditionalGeneration.*encoder-decoder"):
            build(model)


def test_model_without_a_layer_list_is_refused_by_name():
    # Prepare: the same decoder layers, held in an nn.Sequential instead of a ModuleList
    model = copy.deepcopy(_model("llama"))
    model.model.layers = nn.Sequential(*model.model.layers)  # type: ignore[assignment]
    # Execute / Assert
    for build in (LayerStack, BlockMap):
        with pytest.raises(UnsupportedModelError,
                           match=r"LlamaForCausalLM \(model_type 'llama'\).*no nn.ModuleList"):
            build(model)


class _ScaledLlama(LlamaForCausalLM):
    """A causal LM whose forward does something to the logits this package does not know."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0 + 1.0
        return out


def test_family_with_an_unknown_forward_is_refused_by_name():
    # Prepare
    model = _ScaledLlama(_model("llama").config).eval()
    # Execute / Assert
    with pytest.raises(UnsupportedModelError,
                       match=r"_ScaledLlama \(model_type 'llama'\): piecewise logits differ"):
        LayerStack(model)


# ------------------------------------------------------------------------- block map


@pytest.mark.parametrize("name", NAMES)
def test_blocks_cover_every_parameter_once(name):
    # Prepare
    model = _model(name)
    flags = [p.requires_grad for p in model.parameters()]
    # Execute
    blocks = BlockMap(model, layers_per_block=2)
    # Assert: a partition of the (deduplicated) parameters; requires_grad left as it was
    owned = [n for info in blocks.blocks.values() for n in info.param_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert sum(info.numel for info in blocks.blocks.values()) == sum(
        p.numel() for p in model.parameters())
    assert blocks.names[0] == EMBED and blocks.names[-1] == HEAD
    assert [p.requires_grad for p in model.parameters()] == flags
    head_weight = model.get_output_embeddings().weight
    tied = head_weight is model.get_input_embeddings().weight
    assert blocks.tied == tied
    head_name = next(n for n, p in model.named_parameters() if p is head_weight)
    assert blocks.block_of(head_name) == (EMBED if tied else HEAD)


def test_block_map_built_without_grad_still_finds_the_embeddings():
    model = _model("gpt2")
    with torch.inference_mode():
        blocks = BlockMap(model)
    assert blocks.info(EMBED).param_names == ("transformer.wte.weight", "transformer.wpe.weight")


def test_opt_projections_go_to_embed_and_head():
    model = _model("opt-350m-style")
    blocks = BlockMap(model)
    assert blocks.info(EMBED).param_names == (
        "model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight",
        "model.decoder.project_in.weight",
    )
    assert blocks.info(HEAD).param_names == ("model.decoder.project_out.weight",)
    assert blocks.tied  # the head is the (narrow) token embedding, owned by embed


def test_scaled_tied_embedding_is_one_embed_tensor():
    model = _model("gemma3")
    blocks = BlockMap(model)
    assert blocks.tied
    assert blocks.info(EMBED).param_names == ("model.embed_tokens.weight",)
    assert blocks.info(HEAD).param_names == ("model.norm.weight",)
    # The embedding scale is a buffer: applied by the model, never sent or trained.
    assert "model.embed_tokens.embed_scale" in dict(model.named_buffers())


# ------------------------------------------------------------------------- registry


def test_tiny_families_are_seeded_and_load_by_name():
    a = build_tiny("gemma3", _tokenizer()).state_dict()
    b = load_model("tiny-gemma3").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert type(load_model("tiny-gpt-neox")).__name__ == "GPTNeoXForCausalLM"


# ------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_piecewise_logits_equal_the_models_own():
    # Prepare: a real prompt, right- and left-padded rows
    model = load_model("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    texts = ["Review: a gorgeous, witty, seductive movie.\nSentiment:", "Review: dull.\nSentiment:"]
    stack = LayerStack(model)
    for side in ("right", "left"):
        tokenizer.padding_side = side
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        # Execute
        with torch.no_grad():
            expected = model(**enc).logits
            got = stack.all_logits(enc["input_ids"], enc["attention_mask"])
        # Assert
        real = enc["attention_mask"].bool()
        torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
