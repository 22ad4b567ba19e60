"""``lezo`` and ``mezo`` through the block's forward ExecuTorch program: the same steps as the
eager rule (units, z, seed log), each loss from the runtime; a federation with such a node ends
where the all-eager one does.

The tests run in ``.venv-executorch`` (``make test`` runs them there; the SmolLM2 one, marked
``slow``, ``make test-slow``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedcybgd.client.updates.base import get_rule
from fedcybgd.client.updates.zo_program import ProgramLeZO, ProgramMeZO
from fedcybgd.data.prompts import EncodedExamples, collate
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.protocol import zeroth_order
from fedcybgd.rules import TrainTask
from tests.client.updates.test_fo_program import (
    assert_a_mixed_federation_ends_where_the_eager_one_does,
    program_round,
)
from tests.tasks.test_task_lm import write_books

ROWS, SEQ, STEPS = 2, 16, 4


def lm_batches(vocab: int, seed: int = 0) -> list:
    """``STEPS`` lm batches of one full window and one short one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        windows = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (SEQ, SEQ - 5)]
        out.append(collate(EncodedExamples(
            input_ids=windows, labels=[-1] * len(windows), class_token_ids=(), pad_token_id=0,
            score_positions=[list(range(len(w) - 1)) for w in windows],
            targets=[w[1:] for w in windows])))
    return out


@pytest.mark.executorch
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
@pytest.mark.parametrize(("program", "eager_name", "options"), [
    (ProgramLeZO, "lezo", {"lezo-density": 0.5}),
    (ProgramMeZO, "mezo", {"zo-step-cache-mb": 0.0}),  # the uncached path too
])
def test_zeroth_order_steps_through_the_forward_program_follow_the_eager_rule(
        family, program, eager_name, options, tmp_path):
    assert_program_follows_eager(family, 1, program, eager_name, options, tmp_path)


@pytest.mark.executorch
def test_lezo_on_a_tied_embedding_through_the_forward_program_follows_the_eager_rule(tmp_path):
    # tiny-llama's output projection is its input embedding: the perturbed embedding reaches
    # the head inside the program as in the model
    assert load_model("tiny-llama").config.tie_word_embeddings
    assert_program_follows_eager("tiny-llama", 0, ProgramLeZO, "lezo", {"lezo-density": 0.5},
                                 tmp_path)


def assert_program_follows_eager(family, index, program, eager_name, options, tmp_path) -> None:
    """``STEPS`` steps of ``program`` on block ``index`` (of two layers a block) follow the
    eager rule ``eager_name``'s."""
    from fedcybgd.model.layerwise import LayerStack

    # Prepare: the same model, block, batches and seed both ways
    model = load_model(family)
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = BlockMap(model, 2)
    block = blocks.names[index]
    twin = copy.deepcopy(model)
    start = {n: t.clone() for n, t in blocks.get(model, block).items()}
    batches = lm_batches(int(model.config.vocab_size))
    rule = program(tmp_path, family, "h", ROWS, SEQ)

    def task(m):
        return TrainTask(model=m, stack=LayerStack(m), blocks=blocks, block=block,
                         batches=iter(copy.deepcopy(batches)), steps=STEPS, lr=1e-2,
                         weight_decay=0.01, seed=11, options=dict(options))

    # Execute
    ours = rule.train(task(model))
    theirs = get_rule(eager_name).train(task(twin))

    # Assert: the same units and seeds each step, every step applied. The first projected
    # gradient (l+ - l-) / (2 eps), from the same weights, within 8 fp32 ulps of the loss over
    # eps (the runtime and eager PyTorch sum the loss in another order: measured up to 5 ulps,
    # 2.5e-3 of g); later ones, from weights that carry those differences, within 1e-2 of g
    # (measured up to 4e-3); the trained blocks within 1e-2 of the change; the node's log
    # replays to its own block bit for bit
    a, b = ours.step_log, theirs.step_log
    assert a is not None and b is not None and len(a.steps) == len(b.steps) == STEPS
    assert [(s.seed, s.units) for s in a.steps] == [(s.seed, s.units) for s in b.steps]
    ulp = float(np.spacing(np.float32(theirs.loss)))
    assert abs(a.steps[0].g - b.steps[0].g) <= 8 * ulp / a.eps, (a.steps[0], b.steps[0], ulp)
    for x, y in zip(a.steps, b.steps, strict=True):
        assert abs(x.g - y.g) <= 1e-2 * max(1.0, abs(y.g)), (x.g, y.g)
    assert abs(ours.loss - theirs.loss) <= 1e-5 * abs(theirs.loss)
    mine, eager = blocks.get(model, block), blocks.get(twin, block)
    diff = sum(float((mine[n] - eager[n]).norm() ** 2) for n in eager) ** 0.5
    size = sum(float((eager[n] - start[n]).norm() ** 2) for n in eager) ** 0.5
    assert size > 0 and diff <= 1e-2 * size, (diff, size)
    replayed = zeroth_order.replay(start, a, zeroth_order.unit_layout(blocks, block))
    assert all(torch.equal(replayed[n], mine[n]) for n in mine)


@pytest.mark.executorch
def test_a_lezo_federation_with_an_executorch_node_ends_where_the_all_eager_one_does(
        tiny_run_config, tmp_path):
    # Prepare: an lm run of two nodes training lezo, step logs up (the server replays them);
    # fo-recompute set, an option of another rule that the forward program does not mind
    folder = write_books(tmp_path / "books", books=8, lines=12)
    config = {**tiny_run_config, "task": "lm", "dataset": str(folder), "max-seq-len": 32,
              "eval-examples": 6, "num-server-rounds": 2, "update-rule": "lezo",
              "local-steps": 4, "lr": 1e-2, "upload-codec": "seedlog",
              "download-codec": "fp32", "fo-recompute": True}

    # Execute / Assert: all eager, then node 0 through ExecuTorch: trained every round through
    # step logs; the models agree within 1e-2 of what training changed (the projected gradients
    # carry the losses' last-bit differences over 2 eps: see the test above)
    assert_a_mixed_federation_ends_where_the_eager_one_does(config, tmp_path, 1e-2)
    assert any((tmp_path / "mixed" / "cache-0").rglob("*.forward.pte"))


@pytest.mark.executorch
@pytest.mark.slow
def test_a_smollm2_lezo_round_through_the_forward_program_fits_its_estimate_and_follows_eager(
        tmp_path):
    row = program_round(tmp_path, "lezo", 1e-5, 4)
    # Assert: the estimate a memory budget is held to within 5% of the round's peak; the same
    # units each step, the same mean loss within 1e-5; each g within 1e-2 of eager's (a loss
    # difference over 2 eps); the trained blocks within 1e-2 of the change
    assert abs(row["estimate_mb"] / row["peak_mb"] - 1) <= 0.05, row
    assert row["units"][0] == row["units"][1], row
    ours, theirs = row["losses"]
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), row
    assert all(abs(a - b) <= 1e-2 * max(1.0, abs(b)) for a, b in zip(*row["g"], strict=True))
    assert row["change"] > 0 and row["relative_difference"] <= 1e-2, row
