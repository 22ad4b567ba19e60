"""Sentence-pair classification: a task of one's own, in one file.

Rows hold a ``premise``, a ``hypothesis`` and a ``label``; the model reads both sentences in
one prompt and is scored, as in ``classification``, on the logit of each class's label word
right after it. Everything else (label words, the prompt around ``{text}``, splits, shares,
logit adjustment, evaluation) is the built-in classification task's, so the class only says
how a row becomes the text the prompt holds.

Selected by the run config (``pyproject.toml`` next to this file): ``plugin-modules =
"pair_task"`` makes the server (at start) and every client import this module, whose
decorator registers the task; ``task = "sentence-pair"`` selects it. It imports only shared
modules of fedcybgd (no client or server code), so both sides can import it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from fedcybgd.tasks import register_task
from fedcybgd.tasks.classification import ClassificationTask, check_text

PREMISE, HYPOTHESIS = "premise", "hypothesis"  # the row's fields


@register_task("sentence-pair")
class SentencePairTask(ClassificationTask):
    """Classification of a (premise, hypothesis) pair; the label field and words as usual."""

    name = "sentence-pair"

    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The pair joined into the text field, then the classification task's own checks
        (a missing or empty sentence is refused naming its row and field)."""
        if len(frame) == 0:
            return super().check(frame)
        premise = check_text(frame, PREMISE)
        hypothesis = check_text(frame, HYPOTHESIS)
        text = "Premise: " + premise + "\nHypothesis: " + hypothesis
        return super().check(frame.assign(**{self.run.text_field: text.to_numpy()}))

    def partition_column(self, method: str) -> Any:
        """Dirichlet shares over the label, as classification; no ``movie`` column here."""
        return self.run.partition_by or ("label" if method == "dirichlet" else None)
