"""``class-prior``: the class shares label-skew handling aims at, pooled from what nodes state."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.harness.loopback import LoopbackGrid, run_in_process
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.protocol.prior import ClassPriorSpec, check_counts, pooled_shares
from fedcybgd.strategies.node_keys import read_key
from fedcybgd.strategies.replies import MALFORMED, Dropped
from fedcybgd.tasks import shares
from fedcybgd.tasks.build import build_task


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


# --- the spec and the pooling ------------------------------------------------------------------


def test_spec_parses_modes_and_normalises_shares():
    # Execute
    explicit = ClassPriorSpec.parse(" 1, 3 ")

    # Assert
    assert ClassPriorSpec.parse("global").mode == "global"
    assert ClassPriorSpec.parse("Uniform").mode == "uniform"
    assert explicit.mode == "explicit" and explicit.shares == (0.25, 0.75)
    assert explicit.resolve(2, {}) == [0.25, 0.75]
    assert ClassPriorSpec.parse("uniform").resolve(2, {0: [1, 9]}) is None
    with pytest.raises(ValueError, match="the task has 3 classes"):
        explicit.resolve(3, {})


@pytest.mark.parametrize("text", ["globl", "0.5", "0.5,-0.5", "0.5,nan", "a,b", ""])
def test_a_bad_class_prior_is_refused_by_name(text):
    with pytest.raises(ConfigError, match="class-prior must be"):
        RunConfig.from_run_config({"class-prior": text})


def test_pooled_shares_weigh_nodes_by_size_but_cap_a_giant():
    # Prepare: three honest nodes and one that claims a billion negatives
    honest = {1: [30, 10], 2: [20, 20], 3: [10, 30]}

    # Execute
    fair = pooled_shares(2, honest)
    attacked = pooled_shares(2, {**honest, 4: [10**9, 0]})

    # Assert
    assert fair == pytest.approx([61 / 122, 61 / 122])  # Laplace-smoothed 60:60
    assert attacked is not None
    # the liar counts as 4 x the median total (40): 160 more negatives, not a billion
    assert attacked[0] == pytest.approx((60 + 160 + 1) / (280 + 2))
    assert pooled_shares(2, {}) is None
    assert pooled_shares(3, honest) is None  # no node stated three classes


@pytest.mark.parametrize("value", [[1], [1, -1], [1, True], [1.0, 2], [0, 0], "1,2",
                                   [1] * 5000, [1, 10**10]])
def test_unusable_class_counts_are_refused(value):
    with pytest.raises(ValueError, match="class counts"):
        check_counts(value)


def _key_reply(fields: dict[str, Any]) -> Message:
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND: 1})}),
                    dst_node_id=5, message_type=protocol.QUERY_NODE_KEY)
    return Message(RecordDict({protocol.IDENTITY: ConfigRecord(fields)}), reply_to=query)


def test_a_node_key_answer_may_state_class_counts_and_bad_ones_drop_it():
    # Execute
    key, _, counts = read_key(_key_reply({protocol.NODE_KEY: "3",
                                          protocol.CLASS_COUNTS: [7, 2]}))
    with pytest.raises(Dropped) as bad:
        read_key(_key_reply({protocol.NODE_KEY: "3", protocol.CLASS_COUNTS: [-1, 2]}))

    # Assert
    assert (key, counts) == ("3", [7, 2])
    assert bad.value.reason == MALFORMED and protocol.CLASS_COUNTS in bad.value.detail


# --- batches aimed at a prior ------------------------------------------------------------------


def test_batches_aim_at_the_target_prior(tokenizer):
    # Prepare: a node whose rows are 90% negative, a target of 40% negative
    frame = pd.DataFrame({"text": [f"review {i}" for i in range(20)],
                          "label": [1, 1] + [0] * 18})
    target = [0.4, 0.6]

    # Execute
    adjusted = next(shares.batches(frame, tokenizer, 4, 32, seed=0, logit_adjust=True,
                                 target_prior=target))
    stream = shares.batches(frame, tokenizer, 5, 32, seed=0, logit_adjust=True,
                          class_balance=True, target_prior=target)
    mixed = [next(stream) for _ in range(4)]

    # Assert: logit adjustment adds log(own share / target share) (+ a constant)
    own = np.array([19 / 22, 3 / 22])
    expected = np.log(own / np.array(target))
    got = adjusted.class_log_prior.numpy()
    assert got - got[0] == pytest.approx(expected - expected[0], abs=1e-6)
    # class-balanced batches mix the classes as the target does, and carry no adjustment
    assert [int(b.labels.sum()) for b in mixed] == [3, 3, 3, 3]  # 2 of 5 negative each
    prior = mixed[0].class_log_prior.numpy()
    assert prior[0] == pytest.approx(prior[1])


def test_a_prior_of_the_wrong_length_is_refused(tokenizer):
    frame = pd.DataFrame({"text": ["a", "b"], "label": [0, 1]})
    with pytest.raises(ValueError, match="class-prior needs 2"):
        shares.batches(frame, tokenizer, 2, 32, seed=0, logit_adjust=True,
                     target_prior=[0.2, 0.3, 0.5])


# --- through a run -----------------------------------------------------------------------------


def _sent_priors(grid: LoopbackGrid) -> list[list[float] | None]:
    return [m.content.config_records[protocol.CONFIG].get(protocol.CLASS_PRIOR)
            for m in grid.sent if m.metadata.message_type != protocol.QUERY_NODE_KEY]


@pytest.mark.parametrize("strategy", ["fedcybgd", "fedavg"])
def test_global_prior_pools_every_nodes_counts_into_each_instruction(tiny_run_config, strategy):
    # Prepare: 4 label-skewed nodes
    config = dict(tiny_run_config, **{"partitioner": "dirichlet", "num-server-rounds": 1,
                                      "class-prior": "global", "strategy": strategy,
                                      "fedavg-params": "lora"})
    run = RunConfig.from_run_config(config)
    task = build_task(run)
    counts = [shares.class_counts(task, shares.client_examples(task, "dirichlet", i, 4, 0.5, 0))
              for i in range(4)]
    from fedcybgd.server.app import RUNNERS

    # Execute
    grid = LoopbackGrid(client_app, 4, config)
    RUNNERS[strategy](grid, run)

    # Assert: every instruction carries the pooled shares of all four nodes
    priors = _sent_priors(grid)
    assert priors and all(p == priors[0] for p in priors)
    assert priors[0] == pytest.approx(pooled_shares(2, dict(enumerate(counts))))
    assert not math.isclose(priors[0][0], 0.5, abs_tol=0.01)  # the skew is real


def test_uniform_prior_sends_nothing_and_no_counts_leave_a_node(tiny_run_config, tmp_path):
    # Prepare
    config = dict(tiny_run_config, **{"partitioner": "dirichlet", "num-server-rounds": 1,
                                      "class-prior": "uniform", "clients-per-round": 1})
    from tests.client.test_client_paths import one_round

    # Execute
    strategy, _ = one_round(config, tmp_path / "cache", "lineage0")

    # Assert
    assert strategy.sampler.keys.keys  # the node told its key...
    assert strategy.sampler.keys.class_counts == {}  # ...and nothing of its labels
    assert all(protocol.CLASS_PRIOR not in m.content.config_records[protocol.CONFIG]
               for m in strategy.round.sent)


def test_a_node_refuses_an_instruction_with_a_prior_of_the_wrong_length(tiny_run_config,
                                                                        tmp_path):
    # Prepare: the server is tampered to send three shares for two classes
    config = dict(tiny_run_config, **{"num-server-rounds": 1, "clients-per-round": 1,
                                      "class-prior": "global"})
    from tests.client.test_client_paths import assert_refused, one_round

    def tamper(messages: list[Message]) -> None:
        messages[0].content[protocol.CONFIG][protocol.CLASS_PRIOR] = [0.2, 0.3, 0.5]

    # Execute
    _, reply = one_round(config, tmp_path / "cache", "lineage0", tamper=tamper)

    # Assert
    assert_refused(reply, "class-prior needs 2")


def test_explicit_shares_of_the_wrong_length_fail_at_start(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"class-prior": "0.2,0.3,0.5", "num-server-rounds": 1})
    with pytest.raises(ConfigError, match="the task has 2 classes"):
        run_in_process(config, 2, tmp_path / "run")


def test_stated_counts_survive_a_checkpoint(tiny_run_config):
    # Prepare: a strategy that has heard two nodes' counts
    from fedcybgd.core.checksum import content_checksum
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import load_model
    from fedcybgd.server.app import build_strategy

    run = RunConfig.from_run_config(dict(tiny_run_config, **{"class-prior": "global"}))
    model = load_model(run.model)
    weights = dict(model.named_parameters())

    def strategy() -> Any:
        return build_strategy(run, BlockMap(model, 1), weights, "l", content_checksum(weights))

    before = strategy()
    before.sampler.keys.class_counts = {11: [3, 1], 12: [1, 1]}

    # Execute
    after = strategy()
    after.load_state(before.state())

    # Assert: the resumed server sends the same prior
    assert after.sampler.keys.class_counts == {11: [3, 1], 12: [1, 1]}
    assert after.class_prior.resolve(2, after.sampler.keys.class_counts) == \
        pytest.approx([(4 + 1) / 8, (2 + 1) / 8])
