"""Pipeline mode: the schedules and their simulator, the stage message format, stages that
train by backprop across the cut (the full model's gradient) or by ZeroLock (each chunk its own
objective), and the process rig with one OS process per stage."""

from __future__ import annotations

import copy
import itertools
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from fedcybgd.client.pipeline.stage import Stage, StageConfig
from fedcybgd.config import RunConfig
from fedcybgd.harness.pipeline import PipelineError, PipelineSpec, run_in_process, run_pipeline
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.protocol import activations
from fedcybgd.protocol.activations import ActivationError
from fedcybgd.protocol.pipeline import stage_layers
from fedcybgd.server.pipeline.schedules import SCHEDULES, Op, in_flight, plan, simulate
from fedcybgd.server.verdict import RunFailed
from fedcybgd.tasks import shares
from fedcybgd.tasks.build import build_task
from fedcybgd.tasks.objective import batch_loss, scored_logits

M = 3  # micro-batches per step


# ------------------------------------------------------------------ schedules and simulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("stages", "mbs"), [(1, 1), (2, 4), (4, 3), (4, 8)])
def test_every_stage_runs_each_micro_batch_once(schedule, stages, mbs):
    for ops in plan(schedule, stages, mbs, steps=2):
        kinds = ("F", "L") if schedule == "zerolock" else ("F", "B")
        for kind in kinds:
            assert sorted(op.mb for op in ops if op.kind == kind) == list(range(2 * mbs))
        assert [op for op in ops if op.kind not in kinds] == [Op("S"), Op("S")]
        assert ops[-1] == Op("S")


def test_activations_kept_per_stage():
    assert [in_flight(o) for o in plan("gpipe", 4, 6)] == [6, 6, 6, 6]
    assert [in_flight(o) for o in plan("1f1b", 4, 6)] == [4, 3, 2, 1]
    assert [in_flight(o) for o in plan("1f1b", 4, 2)] == [2, 2, 2, 1]
    assert [in_flight(o) for o in plan("zerolock", 4, 6)] == [1, 1, 1, 1]


def test_simulated_makespans_match_the_closed_forms():
    k, m, f, b, loc = 4, 6, 1.0, 2.0, 1.5
    secs = {(s, kind): t for s in range(k) for kind, t in (("F", f), ("B", b), ("L", loc))}
    assert simulate(plan("gpipe", k, m), secs).makespan_s == pytest.approx((m + k - 1) * (f + b))
    assert simulate(plan("1f1b", k, m), secs).makespan_s == pytest.approx((m + k - 1) * (f + b))
    # early forwarding: stage k starts micro-batch 0 after k forwards, never waits again
    assert simulate(plan("zerolock", k, m), secs).makespan_s == pytest.approx(
        (k - 1) * f + m * (f + loc))
    # a transfer delays each hop once on the way up (and down for backprop)
    slow = simulate(plan("zerolock", k, m), secs, transfer_s=0.25)
    assert slow.makespan_s == pytest.approx((k - 1) * (f + 0.25) + m * (f + loc))


def test_simulator_refuses_a_deadlock_and_plan_refuses_unknowns():
    ops = [[Op("B", 0), Op("F", 0)], [Op("F", 0), Op("B", 0)]]  # stage 0 waits before it sends
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(ops, {})
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan("pipedream", 2, 2)
    with pytest.raises(ValueError, match="stages must be in"):
        stage_layers(4, 5)


# ------------------------------------------------------------------ the stage message
@pytest.fixture(scope="module")
def batches():
    tokenizer = load_tokenizer("tiny-llama")
    task = build_task(RunConfig())
    return list(itertools.islice(shares.batches(shares.load_split("rotten-tomatoes", "train"),
                                                tokenizer, 4, 32, seed=0, task=task), 2 * M))


def test_messages_round_trip(batches):
    batch = batches[0]
    states = torch.randn(len(batch), batch.input_ids.shape[1], 8)
    kind, mb, got, back = activations.decode(activations.encode("F", 5, states, batch), 8,
                                             1 << 20, task="the task")
    assert (kind, mb) == ("F", 5) and torch.equal(got, states)
    assert back is not None and back.task == "the task"
    assert torch.equal(back.input_ids, batch.input_ids) and torch.equal(back.labels, batch.labels)
    half = activations.decode(activations.encode("B", 2, states, dtype="bfloat16"), 8, 1 << 20)
    assert half[:2] == ("B", 2) and torch.equal(half[2], states.bfloat16().float())
    assert activations.peek(activations.encode("B", 7, states)) == ("B", 7)


def test_bad_messages_are_refused_by_name(batches):
    batch = batches[0]
    states = torch.randn(len(batch), batch.input_ids.shape[1], 8)
    good = activations.encode("F", 0, states, batch)
    with pytest.raises(ActivationError, match=r"shape .* expected \[batch, tokens, 16\]"):
        activations.decode(good, 16, 1 << 20)
    with pytest.raises(ActivationError, match="exceeds the limit"):
        activations.decode(good, 8, 100)
    with pytest.raises(ActivationError, match="non-finite"):
        activations.decode(activations.encode("B", 0, states * float("nan")), 8, 1 << 20)
    with pytest.raises(ActivationError, match="not a safetensors"):
        activations.decode(b"\x00" * 64, 8, 1 << 20)
    extra = save({"grad": states, "code": torch.zeros(1)}, metadata={"kind": "B", "mb": "0"})
    with pytest.raises(ActivationError, match="unexpected tensors"):
        activations.decode(extra, 8, 1 << 20)
    no_kind = save({"grad": states}, metadata={"kind": "X", "mb": "0"})
    with pytest.raises(ActivationError, match="'kind'"):
        activations.decode(no_kind, 8, 1 << 20)
    fields = {k: getattr(batch, k) for k in ("input_ids", "attention_mask", "last_index",
                                              "target_ids", "labels", "class_token_ids")}
    fields["last_index"] = fields["last_index"] + 1000
    far = save({"states": states, **fields}, metadata={"kind": "F", "mb": "0"})
    with pytest.raises(ActivationError, match="'last_index' points outside"):
        activations.decode(far, 8, 1 << 20)


# ------------------------------------------------------------------ stages in one process
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny-llama")


def _stages(model, schedule: str, count: int, lr: float = 1e-3) -> list[Stage]:
    return [Stage(copy.deepcopy(model), StageConfig(k, count, schedule, lr)) for k in range(count)]


def _gradients(stages: list[Stage]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        out.update(stage.gradients())
    return out


@pytest.fixture(scope="module")
def full_gradient(model, batches):
    """The whole model's mean gradient over the first step's micro-batches (decoder layers)."""
    ref = copy.deepcopy(model)
    stack = LayerStack(ref)
    for p in ref.parameters():
        p.requires_grad_(False)
    for layer in stack.layers:
        for p in layer.parameters():
            p.requires_grad_(True)
    for batch in batches[:M]:
        hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0,
                           stack.num_layers)
        (batch_loss(scored_logits(stack, hidden.states, batch), batch) / M).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_backprop_pipelines_give_the_whole_models_gradient(model, batches, full_gradient,
                                                           schedule, count):
    stages = _stages(model, schedule, count)
    moved = run_in_process(stages, batches, M, step=False)
    assert (moved > 0) == (count > 1)
    assert _close(_gradients(stages), full_gradient) < 1e-5
    assert [s.kept for s in stages] == [0] * count


def test_zerolock_on_one_stage_is_backprop_and_on_more_each_chunk_its_own(model, batches,
                                                                          full_gradient):
    one = _stages(model, "zerolock", 1)
    run_in_process(one, batches, M, step=False)
    assert _close(_gradients(one), full_gradient) < 1e-5
    two = _stages(model, "zerolock", 2)
    run_in_process(two, batches, M, step=False)
    grads = _gradients(two)
    upper = set(two[1].gradients())
    # the last stage's local objective is the true loss at the top: its gradient is the model's
    assert _close({n: grads[n] for n in upper}, {n: full_gradient[n] for n in upper}) < 1e-5
    # the lower stage follows its own head: not the model's gradient...
    lower = set(two[0].gradients())
    assert _close({n: grads[n] for n in lower}, {n: full_gradient[n] for n in lower}) > 1e-2
    # ...and nothing above it changes it (no signal travels down)
    other = _stages(model, "zerolock", 2)
    with torch.no_grad():
        for p in other[1].params:
            p.add_(torch.randn_like(p))
    run_in_process(other, batches, M, step=False)
    assert _close(other[0].gradients(), {n: grads[n] for n in lower}) == 0.0


def test_stages_step_on_the_mean_gradient_and_refuse_out_of_order_work(model, batches):
    stages = _stages(model, "1f1b", 2)
    before = {n: t.clone() for s in stages for n, t in s.chunk_state().items()}
    run_in_process(stages, batches, M, steps=2)
    after = {n: t for s in stages for n, t in s.chunk_state().items()}
    assert all(not torch.equal(before[n], after[n]) for n in before)
    stage = stages[1]
    with pytest.raises(ValueError, match="no forward pending a backward"):
        stage.backward(99)
    with pytest.raises(ValueError, match="from the states of the stage below"):
        stage.forward(0, batches[0])
    states = torch.zeros(4, batches[0].input_ids.shape[1], model.config.hidden_size)
    stage.forward(0, batches[0], states)
    with pytest.raises(ValueError, match="still in flight"):
        stage.step()


# ------------------------------------------------------------------ one process per stage
@pytest.mark.slow
def test_process_pipeline_trains_like_the_in_process_one(model, batches):
    spec = PipelineSpec(model="tiny-llama", stages=2, schedule="1f1b", micro_batches=M,
                        steps=2, batch_size=4, max_seq_len=32, lr=1e-3)
    result = run_pipeline(spec)
    reference = _stages(model, "1f1b", 2)
    run_in_process(reference, batches, M, steps=2)
    assert [r.max_kept for r in result.stages] == [2, 1]
    assert result.stages[0].bytes_up > 0 and result.stages[1].bytes_down > 0
    assert [r.ops["F"]["count"] for r in result.stages] == [2 * M, 2 * M]
    # the processes' last-stage losses are the in-process ones
    assert [v for _, v in result.stages[1].losses] == pytest.approx(
        [v for _, v in reference[1].losses], rel=1e-5)
    zerolock = run_pipeline(PipelineSpec(**{**spec.__dict__, "schedule": "zerolock"}))
    assert [r.max_kept for r in zerolock.stages] == [1, 1]
    assert zerolock.stages[1].bytes_down == 0 and zerolock.stages[1].messages_down == 0


def test_a_failing_stage_is_named():
    with pytest.raises(PipelineError, match="stage 0 failed: ValueError: unknown tiny model"):
        run_pipeline(PipelineSpec(model="tiny-nosuchfamily", stages=1, schedule="gpipe"))


# ------------------------------------------------------------------ on Flower's runtime
FLOWER = {"model": "tiny-llama", "strategy": "pipeline", "pipeline-stages": 2,
          "micro-batches": M, "batch-size": 4, "max-seq-len": 32, "num-server-rounds": 2,
          "lr": 1e-3, "eval-examples": 32, "partitioner": "iid"}


def _reference(model, config: dict, schedule: str, nodes: int) -> tuple[float, list[float]]:
    """The same training in one process on node 0's batches: final eval loss, step losses."""
    from fedcybgd.client.local_data import training_batches
    from fedcybgd.config import NodeConfig
    from fedcybgd.server.common import Evaluator

    run = RunConfig.from_run_config({**config, "pipeline-schedule": schedule})
    node = NodeConfig.from_node_config({"partition-id": 0, "num-partitions": nodes})
    steps = run.num_server_rounds
    batches = list(itertools.islice(training_batches(run, node, run.seed), M * steps))
    stages = [Stage(copy.deepcopy(model), StageConfig(k, 2, schedule, run.lr),
                    build_task(run)) for k in range(2)]
    run_in_process(stages, batches, M, steps)
    final = copy.deepcopy(model)
    final.load_state_dict({**stages[0].chunk_state(), **stages[1].chunk_state()}, strict=False)
    losses = [v for _, v in stages[1].losses]
    per_step = [sum(losses[i * M:(i + 1) * M]) / M for i in range(steps)]
    return Evaluator(run, LayerStack(final))().loss, per_step


RECOVERY = {**FLOWER, "pipeline-schedule": "gpipe", "num-server-rounds": 3,
            "round-timeout": 1.0}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A gpipe run on three nodes (two stages, one spare) without a failure."""
    from fedcybgd.harness.loopback import run_in_process as flower_run

    return flower_run(RECOVERY, 3, tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("schedule", ["gpipe", "zerolock"])
def test_flower_pipeline_trains_as_the_stages_do_in_one_process(model, tmp_path, clean_run,
                                                                schedule):
    from fedcybgd.harness.loopback import run_in_process as flower_run

    config = RECOVERY if schedule == "gpipe" else {**FLOWER, "pipeline-schedule": schedule}
    summary, rows = (clean_run if schedule == "gpipe" else
                     flower_run(config, 2, tmp_path))
    assert summary["status"] == "completed", summary
    want_loss, want_steps = _reference(model, config, schedule, 3 if schedule == "gpipe" else 2)
    # the ServerApp's messages carry the same activations (gradients) the stages exchange in
    # one process, so the model it assembles and evaluates is the same one
    assert summary["final_eval_loss"] == pytest.approx(want_loss, rel=1e-5)
    assert summary["final_eval_loss"] != pytest.approx(summary["initial_eval_loss"], rel=1e-4)
    assert [r["train_loss"] for r in rows[1:]] == pytest.approx(want_steps, rel=1e-5)
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rows[1:])


def test_a_stage_refuses_a_bad_instruction_by_name(tmp_path):
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedcybgd.client.pipeline.turn import handle

    context = Context(run_id=7, node_id=3, node_config={"cache-dir": str(tmp_path)},
                      state=RecordDict(), run_config={**FLOWER})
    bad = [({"stage": 5, "kind": "F", "step": 0, "final": False}, "'stage' = 5"),
           ({"stage": 0, "kind": "B", "step": 0, "final": False}, "has no backward"),
           ({"stage": 0, "kind": "F", "step": -1, "final": False}, "'step' = -1"),
           ({"stage": 0, "kind": "F", "step": 2, "final": False}, "(num-server-rounds)"),
           ({"stage": 1, "kind": "F", "step": 0, "final": False}, "no 'activations' record")]
    for fields, reason in bad:
        msg = Message(RecordDict({activations.PIPELINE: ConfigRecord(fields)}), dst_node_id=3,
                      message_type="train.pipeline")
        reply = handle(msg, context)
        status = reply.content.config_records[activations.PIPELINE]
        assert status["status"] == "refused" and reason in str(status["reason"]), status
    assert list(tmp_path.rglob("*.safetensors")) == []  # nothing kept from a refused message


@pytest.mark.slow
def test_pipeline_on_a_superlink_survives_a_killed_supernode(tmp_path):
    """Real runtime: a SuperLink and three SuperNodes, the run submitted as `flwr run` does,
    each message a fresh ClientApp process. Stage 1's SuperNode is killed (SIGKILL) while it
    works on its first message; the third node takes the stage over and the run completes."""
    import json
    import re

    from fedcybgd.deploy.commands import merge_config
    from fedcybgd.deploy.local import LocalDeployment

    out = tmp_path / "out"
    dep = LocalDeployment(tmp_path / "state", out / "logs", threads_per_process=1)
    try:
        dep.start_superlink()
        dep.start_supernodes(3)
        dep.wait_nodes(3)
        procs = {n: p for n, p in dep.procs.items() if n.startswith("supernode")}
        ids = {}
        for name, proc in procs.items():
            match = re.search(r"SuperNode ID: (\d+)", proc.log.read_text())
            assert match, proc.log.read_text()[-2000:]
            ids[name] = int(match.group(1))
        victim = sorted(ids, key=ids.__getitem__)[1]  # stage 1: the second-lowest id
        # the round-timeout bounds how long a live node may take on a message: each one is a
        # fresh ClientApp process, slow to start on a loaded machine (at 30 s a run beside a
        # full test suite once ended failed)
        config = {**FLOWER, "pipeline-schedule": "1f1b", "num-server-rounds": 1,
                  "eval-examples": 16, "round-timeout": 120.0}
        run_id = dep.submit(merge_config(config, f"output-dir='{out}'"))
        deadline = time.monotonic() + 300
        while "Start `flwr-clientapp` process" not in procs[victim].log.read_text():
            assert time.monotonic() < deadline, "stage 1 never received a message"
            time.sleep(0.2)
        dep.kill_process(victim)
        status = dep.wait_run(run_id, timeout=400)
        dep.save_run_log(run_id)
        assert status == "finished:completed", status
    finally:
        dep.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["stages"] == 2
    (recovery,) = summary["recoveries"]
    assert recovery["stage"] == 1 and recovery["failed_node"] == ids[victim]
    assert recovery["spare_node"] == max(ids.values())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[-1]["eval_loss"] == summary["final_eval_loss"]


class _DyingGrid:
    """A loopback grid on which ``node`` stops answering after its ``after``-th message."""

    @staticmethod
    def make(config: dict, nodes: int, root, node: int, after: int):
        from fedcybgd.client.app import app as client_app
        from fedcybgd.harness.loopback import LoopbackGrid

        class Grid(LoopbackGrid):
            seen = 0

            def push_messages(self, messages):
                messages = list(messages)
                for message in messages:
                    if message.metadata.dst_node_id == node:
                        Grid.seen += 1
                        if Grid.seen > after:
                            self.silent.add(node)
                return super().push_messages(messages)

        return Grid(client_app, nodes, {**config, "output-dir": str(root / "run")},
                    node_config=lambda i: {"cache-dir": str(root / f"cache-{i}")})


@pytest.mark.parametrize("every", [0, 1])
def test_a_vanished_stage_is_rebuilt_on_a_spare_node(tmp_path, clean_run, every):
    from fedcybgd.server.pipeline.runner import run_pipeline_server

    config = {**RECOVERY, "pipeline-checkpoint-every": every}
    clean = clean_run[0]
    # stage 1 is node 1002: it answers step 1's F and B and step 2's F, then goes silent
    grid = _DyingGrid.make(config, 3, tmp_path / "dying", node=1002, after=3)
    summary = run_pipeline_server(grid, RunConfig.from_run_config(grid.contexts[1001].run_config))
    assert summary["status"] == "completed", summary
    (recovery,) = summary["recoveries"]
    assert (recovery["stage"], recovery["failed_node"], recovery["spare_node"]) == (1, 1002, 1003)
    assert "round-timeout" in recovery["reason"]
    assert recovery["checkpoint_step"] == (1 if every else 0)
    # lost work: step 1's two messages without a checkpoint, step 2's forward with one
    assert recovery["replayed"] == (1 if every else 3)
    # the spare replayed what stage 1 had been sent: the same model as a run without failure
    assert summary["final_eval_loss"] == pytest.approx(clean["final_eval_loss"], rel=1e-6)


def test_with_no_spare_the_run_fails_naming_the_stage(tmp_path):
    from fedcybgd.server.pipeline.runner import run_pipeline_server

    config = {**FLOWER, "num-server-rounds": 2, "round-timeout": 1.0}
    grid = _DyingGrid.make(config, 2, tmp_path, node=1002, after=0)
    with pytest.raises(RunFailed, match="no spare node"):  # `fedcybgd run` exits non-zero
        run_pipeline_server(grid, RunConfig.from_run_config(grid.contexts[1001].run_config))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "stage 1" in summary["reason"] and "no spare node" in summary["reason"]
    assert not (tmp_path / "run" / "final").exists()


def test_a_stage_cannot_write_another_stages_layers(tmp_path):
    from flwr.app import ArrayRecord

    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.pipeline.runner import run_pipeline_server

    class Tampering(LoopbackGrid):
        """Node 1002 (stage 1) slips a tensor of layer 0 into its trained chunk."""

        def pull_messages(self, message_ids):
            replies = list(super().pull_messages(message_ids))
            for reply in replies:
                chunk = reply.content.array_records.get(activations.CHUNK)
                if chunk is not None and reply.metadata.src_node_id == 1002:
                    tensors = dict(chunk.to_torch_state_dict())
                    name = "model.layers.0.self_attn.q_proj.weight"
                    tensors[name] = torch.zeros(model_shape[name])
                    reply.content[activations.CHUNK] = ArrayRecord(tensors)
            return replies

    model_shape = {n: tuple(p.shape) for n, p in load_model("tiny-llama").named_parameters()}
    config = {**FLOWER, "num-server-rounds": 1, "output-dir": str(tmp_path / "run")}
    grid = Tampering(client_app, 2, config,
                     node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    with pytest.raises(RunFailed):
        run_pipeline_server(grid, RunConfig.from_run_config(config))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "stage 1" in summary["reason"] and "not the stage's" in summary["reason"]
    assert "model.layers.0.self_attn.q_proj.weight" in summary["reason"]


def test_a_pipeline_run_evaluates_saves_and_reports_like_any_run(model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from fedcybgd.cli import main
    from fedcybgd.harness.loopback import run_in_process as flower_run
    from fedcybgd.server.common import Evaluator

    # Prepare / Execute: three steps on two stages, evaluated after each
    config = {**FLOWER, "pipeline-schedule": "gpipe", "num-server-rounds": 3, "eval-every": 1}
    summary, rows = flower_run(config, 2, tmp_path)
    out = Path(summary["output_dir"])
    printed = capsys.readouterr().out

    # Assert: every step evaluated; after step 1, the model one step trains in one process
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["eval_loss"] is not None and r["eval_examples"] == 32 for r in rows)
    one_step, _ = _reference(model, {**config, "num-server-rounds": 1}, "gpipe", 2)
    assert rows[1]["eval_loss"] == pytest.approx(one_step, rel=1e-5)
    assert rows[3]["eval_loss"] == summary["final_eval_loss"] != rows[1]["eval_loss"]
    # each row's seconds are its own step's (they add up to less than the run), and the
    # stages' peak memory is reported
    assert sum(r["round_s"] for r in rows[1:]) <= summary["wall_s"]
    assert all(r["client_peak_mem_mb"] > 0 for r in rows[1:])
    # final/ is the trained model, loadable as any run's, with its card
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    again = Evaluator(RunConfig.from_run_config(config), LayerStack(final))()
    assert again.loss == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert "pipeline training over 2 nodes" in (out / "final" / "README.md").read_text()
    # progress lines and the closing table as for any run; report names the rule
    assert "round 3/3" in printed and "Pipeline on tiny-llama (pipeline-gpipe)" in printed
    assert (summary["update_rule"], summary["rounds_run"]) == ("pipeline-gpipe", 3)
    assert main(["report", str(out)]) == 0
    assert "pipeline-gpipe" in capsys.readouterr().out
    # and exported like any run's
    assert main(["export", str(out), "--gguf", str(tmp_path / "m.gguf"), "--type", "f32"]) == 0
    assert (tmp_path / "m.gguf").stat().st_size > 0


def test_nothing_of_a_finished_stage_stays_on_the_nodes(clean_run):
    summary, _ = clean_run
    root = Path(summary["output_dir"]).parent
    assert list(root.glob("cache-*/pipeline/run-*/stage-*/*")) == []


def test_zerolock_aux_layers_shape_the_lower_head_and_stay_frozen(model, batches):
    plain = _stages(model, "zerolock", 2)
    run_in_process(plain, batches, M, step=False)
    aux = [Stage(copy.deepcopy(model), StageConfig(k, 2, "zerolock", 1e-3, aux_layers=1))
           for k in range(2)]
    run_in_process(aux, batches, M, step=False)
    assert _close(aux[0].gradients(), plain[0].gradients()) > 1e-3  # another local objective
    assert _close(aux[1].gradients(), plain[1].gradients()) == 0.0  # the top: the true loss
    above = aux[0].stack.layers[aux[0].layers[1]]  # the first layer above stage 0's chunk
    assert all(p.grad is None for p in above.parameters())


def test_a_stage_sends_activations_in_the_configured_type(tmp_path):
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedcybgd.client.pipeline.turn import handle

    sizes = {}
    for dtype in ("float32", "bfloat16"):
        context = Context(run_id=1, node_id=1, node_config={"cache-dir": str(tmp_path / dtype)},
                          state=RecordDict(),
                          run_config={**FLOWER, "pipeline-activations": dtype})
        msg = Message(RecordDict({activations.PIPELINE: ConfigRecord(
            {"stage": 0, "kind": "F", "step": 0, "final": False})}), dst_node_id=1,
            message_type="train.pipeline")
        reply = handle(msg, context)
        record = reply.content.config_records[activations.ACTIVATIONS]
        assert sorted(record) == [f"mb.{i}" for i in range(M)]
        sizes[dtype] = sum(len(v) for v in record.values())
        _, _, states, _ = activations.decode(record["mb.0"], 64, 1 << 24)
        assert torch.equal(states, states.to(getattr(torch, dtype)).float())
    # the states dominate the message: half as many bytes, less the token ids and targets
    assert sizes["bfloat16"] < 0.6 * sizes["float32"]
