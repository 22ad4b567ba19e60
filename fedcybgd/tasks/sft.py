"""``sft``: instruction / chat fine-tuning, the loss on the response tokens only.

Rows are ``prompt-field`` + ``response-field`` texts, or (``messages-field`` set) chat lists of
``{"role", "content"}`` messages whose last one is the assistant's response. A tokenizer with a
chat template formats them with it (the prompt = every message but the last, with the generation
prompt; the response = what the full conversation adds to it, end-of-turn token included); one
without gets a plain template (``User: ...\\nAssistant:`` and `` {response}<eos>``). Truncation:
:mod:`fedcybgd.tasks.sequences` (the response is never cut silently).

Evaluation: response loss (mean over response tokens) and its perplexity; and greedy generation
of up to ``max-new-tokens`` tokens from each held-out prompt, scored against the reference
response by exact match (the ``accuracy`` of the run's records) and token F1, SQuAD-style
(lower case, punctuation and articles dropped, whitespace collapsed). Both come from one pass
over each prompt with the model's KV cache (:func:`score_and_generate`); a model without a cache
gets two passes (:func:`sequence_nll`, :func:`generate`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from fedcybgd.data.kinds import builtin_task
from fedcybgd.data.prompts import EncodedExamples, collate, leading_special_ids, pad_token_id
from fedcybgd.data.sources import DataError, where
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.classification import check_text
from fedcybgd.tasks.objective import EvalResult
from fedcybgd.tasks.sequences import Joined, Joiner, sequence_nll

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.model.layerwise import LayerStack

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")
SAMPLES = 3  # answers kept per evaluation (the first rows of the evaluation set)


def _messages(value: Any, frame: pd.DataFrame, position: int, field: str) -> Messages:
    """A checked chat list (DataError naming the row and field otherwise)."""
    if isinstance(value, np.ndarray):  # Parquet / Arrow lists arrive as arrays
        value = value.tolist()
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    at = f"{where(frame, position)}: field {field!r}"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise DataError(f"{at} is missing (a row without it, among rows that have it)")
    if not isinstance(value, list) or not value:
        raise DataError(f"{at} must be a non-empty list of messages, got {str(value)[:60]!r}")
    out: Messages = []
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ROLES:
            raise DataError(f"{at}, message {number}: needs 'role' (one of {ROLES}) and "
                            f"'content' (a text), got {str(message)[:80]!r}")
        out.append({"role": str(message["role"]), "content": str(message["content"])})
    if out[-1]["role"] != "assistant" or not out[-1]["content"].strip():
        raise DataError(f"{at}: the last message must be the assistant's (non-empty) response")
    if len(out) < 2:
        raise DataError(f"{at}: needs a prompt message before the assistant's response")
    return out


class ChatFormat:
    """Prompt and response token ids of a conversation, by chat template or plain text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._lead = leading_special_ids(tokenizer)
        eos = tokenizer.eos_token_id
        self._eos = [] if eos is None else [int(eos)]

    def _template(self, messages: Messages, generation: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=generation)
        ids: Any = out if isinstance(out, list) else out["input_ids"]  # type: ignore[index]
        return [int(i) for i in ids]

    @staticmethod
    def plain_prompt(messages: Messages) -> str:
        """``Role: content`` lines, then ``Assistant:``."""
        lines = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
        return "".join(lines) + "Assistant:"

    def prompt(self, messages: Messages) -> list[int]:
        """Ids of the conversation before its last message, ready for the response."""
        if self.chat:
            return self._template(messages[:-1], generation=True)
        return self._lead + self.tokenizer.encode(self.plain_prompt(messages[:-1]),
                                                  add_special_tokens=False)

    def split(self, messages: Messages) -> tuple[list[int], list[int]]:
        """``(prompt ids, response ids)`` of a conversation."""
        prompt = self.prompt(messages)
        if self.chat:
            full = self._template(messages, generation=False)
            if full[: len(prompt)] == prompt and len(full) > len(prompt):
                return prompt, full[len(prompt):]
            # A template whose prompt is not a prefix of the conversation: the response's own
            # tokens, as the template would not tell them apart.
        response = self.tokenizer.encode(" " + messages[-1]["content"].strip(),
                                         add_special_tokens=False) + self._eos
        return prompt, response


class SFTEncoder:
    """Conversations to ids with the loss on the response; ``cut`` counts the shortened."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> None:
        self.format = ChatFormat(tokenizer)
        self.join = Joiner(max_seq_len)
        self.pad_token_id = pad_token_id(tokenizer)

    @property
    def cut(self) -> int:
        """Examples shortened so far."""
        return self.join.cut

    def joined(self, items: Sequence[Any]) -> list[Joined]:
        """Each conversation's prompt and response ids, cut to fit ``max_seq_len``."""
        return [self.join(*self.format.split(messages)) for messages in items]

    def __call__(self, items: Sequence[Any]) -> EncodedExamples:
        return self.encoded(self.joined(items))

    def encoded(self, joined: Sequence[Joined]) -> EncodedExamples:
        """Joined conversations as a batch's examples."""
        return EncodedExamples(
            input_ids=[j.input_ids for j in joined], labels=[-1] * len(joined),
            class_token_ids=(), pad_token_id=self.pad_token_id,
            score_positions=[j.positions for j in joined], targets=[j.targets for j in joined])


@builtin_task("sft")
class SFTTask(Task):
    """See the module docstring."""

    name = "sft"

    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """A ``messages`` column of checked chat lists."""
        if len(frame) == 0:
            return frame.assign(messages=pd.Series(dtype=object))
        field = self.run.messages_field
        if field:
            if field not in frame.columns:
                raise DataError(f"{where(frame, 0)}: no field {field!r} (messages-field)")
            chats = [_messages(v, frame, i, field) for i, v in enumerate(frame[field].tolist())]
        else:
            if self.run.prompt_field not in frame.columns and "messages" in frame.columns:
                raise DataError(f"{where(frame, 0)}: no field {self.run.prompt_field!r} "
                                "(prompt-field); the rows have 'messages': set "
                                "messages-field = \"messages\"")
            prompts = check_text(frame, self.run.prompt_field).tolist()
            responses = check_text(frame, self.run.response_field).tolist()
            chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                     for p, r in zip(prompts, responses, strict=True)]
        out = frame.copy()
        out["messages"] = pd.Series(chats, index=frame.index, dtype=object)
        return out

    def examples(self, frame: pd.DataFrame) -> list[Any]:
        """The chat lists."""
        return list(frame["messages"])

    def max_scored_tokens(self, batch_size: int, max_seq_len: int) -> int:
        """Every response token is scored: at most all but a row's first token (an upper
        bound; short responses score far fewer)."""
        return batch_size * (max_seq_len - 1)

    def encoder(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> SFTEncoder:
        """An :class:`SFTEncoder`."""
        return SFTEncoder(tokenizer, max_seq_len)

    def evaluate(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
                 frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> EvalResult:
        """Response loss and perplexity; exact match and token F1 of greedy generations."""
        encode = self.encoder(tokenizer, max_seq_len)
        items = self.examples(frame)
        joined = encode.joined(items)
        # batches of prompts of about one length: a batch is padded to its longest prompt
        order = sorted(range(len(items)), key=lambda i: joined[i].positions[0])
        answers = [""] * len(items)
        nll = tokens = 0.0
        for start in range(0, len(items), batch_size):
            rows = order[start:start + batch_size]
            part = [joined[i] for i in rows]
            scored = score_and_generate(stack, tokenizer, part, self.run.max_new_tokens)
            if scored is None:  # a model without a KV cache: a forward each for both
                scored = self.score_and_generate_apart(stack, tokenizer, encode, part)
            total, count, texts = scored
            nll += float(total.sum())
            tokens += float(count.sum())
            for i, text in zip(rows, texts, strict=True):
                answers[i] = text
        exact = f1 = 0.0
        samples: list[dict[str, str]] = []
        for messages, text in zip(items, answers, strict=True):
            reference = messages[-1]["content"]
            exact += float(normalize_answer(text) == normalize_answer(reference))
            f1 += token_f1(text, reference)
            if len(samples) < SAMPLES:
                samples.append({"prompt": str(messages[-2]["content"]) if len(messages) > 1
                                else "", "reference": str(reference), "answer": text})
        self.warn_cut("evaluation", encode.cut, len(items), max_seq_len,
                      f"{encode.join.prompts_cut} prompts cut from the left, "
                      f"{encode.join.continuations_cut} responses cut at the end")
        loss = nll / max(tokens, 1.0)
        n = len(items)
        return EvalResult(loss, exact / n, n, {"exact_match": exact / n, "token_f1": f1 / n,
                                               "perplexity": math.exp(min(loss, 700.0))},
                          samples=tuple(samples))

    def score_and_generate_apart(
        self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase, encode: SFTEncoder,
        joined: list[Joined],
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """What :func:`score_and_generate` gives, in two passes over each prompt: a forward for
        the response loss (:func:`sequence_nll`) and ``model.generate`` for the answer."""
        total, count = sequence_nll(stack, collate(encode.encoded(joined), task=self))
        prompts = [j.input_ids[: j.positions[0] + 1] for j in joined]
        return total, count, generate(stack, tokenizer, prompts, self.run.max_new_tokens)


def _cache_name() -> str:
    """The keyword (and output field) of a model's KV cache: ``cache`` from transformers 5.2x
    on, ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of ``rows``, each ending at the last column."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - len(tokens):] = 1
    return ids, mask


@torch.no_grad()
def score_and_generate(
    stack: LayerStack, tokenizer: PreTrainedTokenizerBase, joined: list[Joined],
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """Response loss and greedy answer of each conversation from one pass over its prompt.

    The prompts (left-padded) are run once with the model's KV cache; from that cache the
    reference response is scored (teacher forced: ``([B], [B])`` summed negative log-likelihood
    and token count, as :func:`sequence_nll` gives) and, from a copy of it, up to
    ``max_new_tokens`` tokens are decoded greedily, stopping at the tokenizer's end-of-sequence
    token (as :func:`generate`). The prompt is the one the loss sees: when a conversation is
    longer than ``max-seq-len``, cut to leave its response room. ``None`` when the model keeps no
    KV cache (the caller then runs the two passes apart).
    """
    model: Any = stack.model
    device = next(model.parameters()).device
    pad = pad_token_id(tokenizer)
    prompts = [j.input_ids[: j.positions[0] + 1] for j in joined]
    ids, mask = _left_padded(prompts, pad)
    length = mask.sum(1)  # each prompt's own length: the next position
    rows = len(joined)
    name = _cache_name()
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                    position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(device),
                    use_cache=True, logits_to_keep=1)
        cache = getattr(out, name, None)
        if cache is None:
            return None
        first = out.logits[:, -1, :].float()  # predicts each response's first token
        decode_cache = copy.deepcopy(cache)

        # the reference responses, teacher forced after the prompts (right-padded)
        span = max(len(j.targets) for j in joined)
        targets = torch.full((rows, span), pad, dtype=torch.long)
        scored = torch.zeros((rows, span), dtype=torch.long)
        for row, j in enumerate(joined):
            targets[row, : len(j.targets)] = torch.tensor(j.targets, dtype=torch.long)
            scored[row, : len(j.targets)] = 1
        logits = first[:, None, :]
        if span > 1:
            rest = model(input_ids=targets[:, :-1].to(device),
                         attention_mask=torch.cat([mask, scored[:, :-1]], 1).to(device),
                         position_ids=(length[:, None] + torch.arange(span - 1)).to(device),
                         use_cache=True, **{name: cache})
            logits = torch.cat([logits, rest.logits.float()], 1)
        nll = F.cross_entropy(logits.reshape(rows * span, -1), targets.to(device).reshape(-1),
                              reduction="none").view(rows, span).double().cpu()
        total = (nll * scored).sum(1)
        count = scored.sum(1).double()

        # greedy decoding from the prompts' cache
        eos = tokenizer.eos_token_id
        done = torch.zeros(rows, dtype=torch.bool)
        attend = mask
        token = first.argmax(-1).cpu()
        answer = []
        for step in range(max_new_tokens):
            token = torch.where(done, torch.full_like(token, pad), token)
            answer.append(token)
            if eos is not None:
                done |= token == int(eos)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            attend = torch.cat([attend, torch.ones((rows, 1), dtype=torch.long)], 1)
            nxt = model(input_ids=token[:, None].to(device), attention_mask=attend.to(device),
                        position_ids=(length + step)[:, None].to(device),
                        use_cache=True, **{name: decode_cache})
            token = nxt.logits[:, -1, :].float().argmax(-1).cpu()
    finally:
        model.train(was_training)
    generated = torch.stack(answer, 1)
    texts = [str(tokenizer.decode(row, skip_special_tokens=True)).strip() for row in generated]
    return total, count, texts


@torch.no_grad()
def generate(stack: LayerStack, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
             max_new_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` (ids), decoded without special tokens.

    The model's own ``generate`` (with its KV cache: a forward per new token, not per prefix),
    on left-padded prompts; stops at the tokenizer's end-of-sequence token.
    """
    model: Any = stack.model
    ids, mask = _left_padded(prompts, pad_token_id(tokenizer))
    width = ids.shape[1]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             temperature=None, top_p=None, top_k=None,
                             pad_token_id=pad_token_id(tokenizer),
                             eos_token_id=tokenizer.eos_token_id)
    finally:
        model.train(was_training)
    return [str(tokenizer.decode(row[width:], skip_special_tokens=True)).strip() for row in out]


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation or articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 of two texts after :func:`normalize_answer`."""
    got, want = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not got or not want:
        return float(got == want)
    common = sum((Counter(got) & Counter(want)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)
