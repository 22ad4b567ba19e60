"""The real SmolLM2-135M: the block cut and a first-order step where quality is the point."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedcybgd.client.updates import TrainTask, get_rule
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.tasks import shares
from fedcybgd.tasks.objective import evaluate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model = load_model("smollm2-135m")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, load_tokenizer("smollm2-135m")


def test_smollm2_blocks_cover_the_model_once(smollm2):
    model, _ = smollm2
    blocks = BlockMap(model, layers_per_block=1)
    # 30 decoder layers + embed + head (final norm only: the LM head is tied to the embedding)
    assert len(blocks.names) == 32 and blocks.tied
    assert sum(b.numel for b in blocks.blocks.values()) == 134_515_008
    assert blocks.info("head").param_names == ("model.norm.weight",)


def test_first_order_steps_on_one_block_lower_the_label_loss(smollm2):
    # Prepare: 32 training examples, the top decoder layer as the block
    model, tokenizer = smollm2
    stack = LayerStack(model)
    blocks = BlockMap(model, layers_per_block=1)
    frame = shares.load_split("rotten-tomatoes", "train").head(32)
    fixed = list(itertools.islice(shares.batches(frame, tokenizer, 8, 64, seed=0), 4))
    before = evaluate(stack, fixed)
    start = blocks.get(model, "layer.29")
    task = TrainTask(model=model, stack=stack, blocks=blocks, block="layer.29",
                     batches=itertools.cycle(fixed), steps=8, lr=1e-4, weight_decay=0.0, seed=0)
    # Execute
    outcome = get_rule("fo").train(task)
    after = evaluate(stack, fixed)
    # Assert
    assert outcome.steps == 8 and outcome.skipped_steps == 0
    assert after.loss < before.loss - 0.05
    blocks.set(model, "layer.29", start)  # leave the shared fixture as it was
    assert torch.equal(blocks.get(model, "layer.29")["model.layers.29.mlp.up_proj.weight"],
                       start["model.layers.29.mlp.up_proj.weight"])


def test_client_reads_pretrained_blocks_from_the_model_files(smollm2):
    # Prepare
    from fedcybgd.client.runtime import ClientModel

    model, _ = smollm2
    client = ClientModel("smollm2-135m", layers_per_block=8)
    # Execute: the client keeps no copy; a reset reads the block back from disk
    on_disk = client.pretrained("layer.8-15")
    # Assert
    assert client._pristine == {}
    expected = BlockMap(model, 8).get(model, "layer.8-15")
    assert all(torch.equal(on_disk[name], expected[name]) for name in expected)


def test_first_order_sft_steps_lower_the_response_loss(smollm2):
    # Prepare: reviews as instructions with a one-word answer, through the chat template
    import pandas as pd

    from fedcybgd.config import RunConfig
    from fedcybgd.tasks import make_task

    model, tokenizer = smollm2
    stack = LayerStack(model)
    blocks = BlockMap(model, layers_per_block=1)
    reviews = shares.load_split("rotten-tomatoes", "train").head(32)
    task = make_task("sft", RunConfig(task="sft", partitioner="iid", max_new_tokens=3))
    frame = task.check(pd.DataFrame({
        "prompt": [f"Is this movie review positive or negative? Answer in one word.\n{t}"
                   for t in reviews["text"]],
        "response": ["positive" if y else "negative" for y in reviews["label"]]}))
    fixed = list(itertools.islice(shares.batches(frame, tokenizer, 8, 128, seed=0, task=task), 4))
    scored = frame.head(16)  # half the training rows: enough to see the loss fall
    before = task.evaluate(stack, tokenizer, scored, 16, 128)
    start = blocks.get(model, "layer.29")
    train = TrainTask(model=model, stack=stack, blocks=blocks, block="layer.29",
                      batches=itertools.cycle(fixed), steps=4, lr=1e-4, weight_decay=0.0, seed=0)
    # Execute
    outcome = get_rule("fo").train(train)
    after = task.evaluate(stack, tokenizer, scored, 16, 128)
    blocks.set(model, "layer.29", start)  # leave the shared fixture as it was
    # Assert: the loss on the response tokens falls; generations are scored
    assert outcome.steps == 4 and outcome.skipped_steps == 0
    assert after.loss < before.loss - 0.05, (before.loss, after.loss)
    assert set(after.metrics) == {"exact_match", "token_f1", "perplexity"}
    assert after.metrics["perplexity"] < before.metrics["perplexity"]


def _response_loss(stack, batches) -> float:
    """Mean loss per response token of sft ``batches`` (no grad)."""
    from fedcybgd.tasks.sequences import sequence_nll

    nll = tokens = 0.0
    with torch.no_grad():
        for batch in batches:
            total, count = sequence_nll(stack, batch)
            nll, tokens = nll + float(total.sum()), tokens + float(count.sum())
    return nll / tokens


def test_sft_training_on_the_builtin_tomi_lowers_the_held_out_response_loss(smollm2):
    # Prepare: the built-in ToMi task as dataset = "tomi" alone gives it (task = auto -> sft);
    # train on its train split, score validation stories the block never saw
    import importlib.metadata

    from fedcybgd.config import RunConfig
    from fedcybgd.tasks import build_task

    try:
        importlib.metadata.distribution("evals")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the 'evals' package (tomi's data) is not installed: make install")
    model, tokenizer = smollm2
    stack = LayerStack(model)
    blocks = BlockMap(model, layers_per_block=1)
    task = build_task(RunConfig(dataset="tomi", max_seq_len=160))
    assert task.name == "sft"
    held_out = list(itertools.islice(shares.batches(task.split("validation").head(32),
                                                  tokenizer, 16, 160, seed=0, shuffle=False,
                                                  task=task), 2))
    train = shares.batches(task.split("train"), tokenizer, 8, 160, seed=0, task=task)
    before = _response_loss(stack, held_out)
    start = blocks.get(model, "layer.29")
    # Execute
    outcome = get_rule("fo").train(TrainTask(
        model=model, stack=stack, blocks=blocks, block="layer.29", batches=train, steps=8,
        lr=1e-4, weight_decay=0.0, seed=0))
    after = _response_loss(stack, held_out)
    blocks.set(model, "layer.29", start)  # leave the shared fixture as it was
    # Assert: 64 training questions move the loss on 32 held-out ones by a clear margin
    assert outcome.steps == 8 and outcome.skipped_steps == 0
    assert after < before - 0.3, (before, after)
