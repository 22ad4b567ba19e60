"""A node that trains through ExecuTorch (node config ``trainer = "executorch"``): the same
protocol, the same result as an eager node, and a clear refusal for what the program lacks.

The test marked ``executorch`` runs in ``.venv-executorch`` (``make test`` runs it there).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedcybgd.client.updates.fo_program import program_inputs, unsupported
from fedcybgd.config import ConfigError, NodeConfig
from fedcybgd.data.prompts import collate
from fedcybgd.model.block_programs import IGNORE
from tests.tasks.test_task_lm import write_books


def test_what_the_program_does_not_cover_is_named():
    assert unsupported("fo", "lm", False, "float32", "cpu", False) is None
    assert "lezo" in unsupported("lezo", "lm", False, "float32", "cpu", False)
    assert "classification" in unsupported("fo", "classification", False, "float32", "cpu",
                                           False)
    assert "example" in unsupported("fo", "lm", True, "float32", "cpu", False)
    assert "int8" in unsupported("fo", "lm", False, "int8", "cpu", False)
    assert "cuda" in unsupported("fo", "lm", False, "float32", "cuda", False)
    assert "fo-recompute" in unsupported("fo", "lm", False, "float32", "cpu", True)
    assert NodeConfig.from_node_config({"trainer": "executorch"}).trainer == "executorch"
    with pytest.raises(ConfigError, match="trainer"):
        NodeConfig.from_node_config({"trainer": "tflite"})


def test_a_batch_becomes_the_programs_fixed_inputs_with_the_same_scored_tokens():
    from fedcybgd.data.prompts import EncodedExamples

    windows = [[5, 6, 7, 8], [9, 10, 11]]
    encoded = EncodedExamples(input_ids=windows, labels=[-1, -1], class_token_ids=(),
                              pad_token_id=0,
                              score_positions=[list(range(len(w) - 1)) for w in windows],
                              targets=[w[1:] for w in windows])
    batch = collate(encoded)
    ids, mask, targets = program_inputs(batch, rows=3, seq=6)
    assert ids.shape == (3, 6) and targets.shape == (3, 5)
    assert ids[0, :4].tolist() == [5, 6, 7, 8] and mask[1].tolist() == [1, 1, 1, 0, 0, 0]
    assert targets[0].tolist() == [6, 7, 8, IGNORE, IGNORE]
    assert targets[1].tolist() == [10, 11, IGNORE, IGNORE, IGNORE]
    assert mask[2].tolist() == [1, 0, 0, 0, 0, 0] and (targets[2] == IGNORE).all()
    assert int((targets != IGNORE).sum()) == batch.num_scored
    with pytest.raises(ValueError, match="does not fit"):
        program_inputs(batch, rows=1, seq=6)


def _final(config: dict, tmp_path: Path, trainers: list[str]) -> tuple[dict, list[dict]]:
    from fedcybgd.harness.loopback import run_in_process

    _, rows = run_in_process(config, len(trainers), tmp_path,
                                   node_config=lambda i: {"trainer": trainers[i]})
    final = tmp_path / "run" / "final" / "model.safetensors"
    return load_file(final), rows


@pytest.mark.executorch
def test_a_federation_with_an_executorch_node_ends_where_the_all_eager_one_does(
        tiny_run_config, tmp_path):
    # Prepare: an lm run of two nodes, exact codecs both ways (the comparison is of training)
    folder = write_books(tmp_path / "books", books=8, lines=12)
    config = {**tiny_run_config, "task": "lm", "dataset": str(folder), "max-seq-len": 32,
              "eval-examples": 6, "num-server-rounds": 2, "upload-codec": "fp32",
              "download-codec": "fp32"}

    # Execute: all eager; then node 0 trains through ExecuTorch
    eager, eager_rows = _final(copy.deepcopy(config), tmp_path / "eager", ["eager", "eager"])
    mixed, mixed_rows = _final(copy.deepcopy(config), tmp_path / "mixed",
                               ["executorch", "eager"])

    # Assert: both trained every round; the models agree within 1e-3 of what training changed
    from fedcybgd.model.loading import load_model

    base = dict(load_model("tiny-llama").named_parameters())
    assert [r["round"] for r in mixed_rows] == [0, 1, 2]
    assert all(r["train_loss"] is not None for r in mixed_rows[1:])
    for a, b in zip(eager_rows[1:], mixed_rows[1:], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    changed = {n for n in eager if not torch.equal(eager[n], base[n].detach())}
    assert changed and changed == {n for n in mixed if not torch.equal(mixed[n],
                                                                       base[n].detach())}
    diff = sum(float((mixed[n] - eager[n]).norm() ** 2) for n in changed) ** 0.5
    size = sum(float((eager[n] - base[n]).norm() ** 2) for n in changed) ** 0.5
    assert diff <= 1e-3 * size, (diff, size)
    assert any((tmp_path / "mixed" / "cache-0").rglob("*.pte"))  # node 0 exported its programs
    assert not any((tmp_path / "mixed" / "cache-1").rglob("*.pte"))
