"""Multi-turn rollouts with tools in the trainer (2 CPU ranks, gloo, engine TP 2): verl's tool
agent loop fed by the real engine, whose first turn is replaced by a scripted tool call (a tiny
random model never writes one). Checked: each sample's response is its turns and the tool's
answer with the answer masked out, the tool ran on the first TP rank only (its answer names the
rank that ran it, and both ranks continue from rank 0's), the counts and the tools' rewards reach
the reward function as verl passes them, the metrics count the turns, and the step trains."""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from agent.interactions import BaseInteraction
from agent.tools import BaseTool, ToolResponse
from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the turns' count and the tools' rewards, plus under 0.001 from the text (so that a group's
    # samples differ and GRPO has advantages to train on)
    turns = extra_info["num_turns"] + sum(extra_info["tool_rewards"]) + len(extra_info["turn_scores"])
    return turns + 0.001 * (sum(map(ord, solution_str)) % 997) / 997
'''


class RankTool(BaseTool):
    """Answers with the row's secret and the rank that ran it; reward 0.5. Counts its calls."""

    executed = 0

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema or SCHEMA)

    async def create(self, instance_id=None, create_kwargs=None, **kwargs):
        self.secret = (create_kwargs or {})["secret"]
        return "one", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        RankTool.executed += 1
        return ToolResponse(text=f"secret {self.secret} for {parameters['key']} from rank {dist.get_rank()}"), 0.5, {}


class Judge(BaseInteraction):
    """Replies "again" (score 0.25) until the model has answered (after its tool call) more times than
    the row's `patience`, then ends the rollout (score 0.5); names the rank that ran it. Counts its
    replies."""

    replies = 0

    async def start_interaction(self, instance_id=None, patience=0, **kwargs):
        self.patience = getattr(self, "patience", {})
        self.patience[instance_id] = patience
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        Judge.replies += 1
        answers = sum(m["role"] == "assistant" for m in messages) - 1  # the first turn called the tool
        done = answers > self.patience[instance_id]
        return done, f"again, from rank {dist.get_rank()}", 0.5 if done else 0.25, {}


def _assets(root, hidden: int = 32):
    from models import ModelArgs, Transformer
    from models.checkpoint import save_pretrained
    from tests.byte_chat import build_byte_tokenizer

    model_dir = os.path.join(root, "model")
    tok = build_byte_tokenizer(model_dir)
    args = ModelArgs(model_type="qwen2", vocab_size=260, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, attention_bias=True,
                     tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    save_pretrained(Transformer.build(args, seed=0), model_dir)
    with open(os.path.join(root, "train.jsonl"), "w") as f:
        for i in range(4):
            row = {"data_source": "lookup", "prompt": [{"role": "user", "content": f"what is k{i}?"}],
                   "reward_model": {"ground_truth": "7"},
                   "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": f"s{i}"}}}}}
            if i == 3:
                row["agent_name"] = "single_turn_agent"
            else:
                row["extra_info"]["interaction_kwargs"] = {"name": "judge", "patience": i}
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(root, "tools.yaml"), "w") as f:
        f.write("tools:\n  - class_name: tests.e2e.test_multi_turn_trainer.RankTool\n    config: {type: native}\n")
    with open(os.path.join(root, "judge.yaml"), "w") as f:
        f.write("interaction:\n  - name: judge\n    class_name: tests.e2e.test_multi_turn_trainer.Judge\n")
    with open(os.path.join(root, "reward.py"), "w") as f:
        f.write(REWARD)


def _config(root, run, world_size, *overrides):
    """The tool agent's one-step demo config on `world_size` ranks, engine TP `world_size`."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config

    return load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.train_files=[{root}/train.jsonl]", "data.val_files=[]", f"actor_rollout_ref.model.path={root}/model",
        f"custom_reward_function.path={root}/reward.py", f"trainer.default_local_dir={root}/{run}",
        "trainer.resume_mode=disable", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "trainer.logger=[jsonl]", "trainer.export_hf_at_end=false", "data.max_prompt_length=512",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={world_size}", f"trainer.n_gpus_per_node={world_size}",
        "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
        f"{root}/tools.yaml", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", *overrides])


def _scripted_step(root, run, device, world_size, later_turn, *overrides):
    """One step of a trainer of the tool agent on `world_size` ranks (engine TP `world_size`) whose
    engine's turns are scripted: each sample's first turn calls the tool (`CALL`), a later one is
    `later_turn` (token ids), or the engine's own when None. Returns the trainer, the step's
    metrics, its rollouts, and the call's token ids."""
    from tests.byte_chat import IM_END
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(_config(root, run, world_size, *overrides), init_distributed(device))
    tok = trainer.tokenizer
    call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(IM_END)]
    prompts = {tuple(it["input_ids"]) for it in trainer.train_ds}
    engine_generate = trainer.engine.generate

    def rewrite(outs):
        for o in outs:  # a request from a prompt is a first turn
            first = tuple(o.prompt_token_ids) in prompts
            if first or later_turn is not None:
                o.token_ids = list(call_ids if first else later_turn)
                o.logprobs, o.finish_reason = [0.0] * len(o.token_ids), "stop"
        return outs

    def scripted(contexts, params, *args, on_finish=None, **kw):
        if on_finish is None:
            return rewrite(engine_generate(contexts, params, *args, **kw))
        return engine_generate(contexts, params, *args, on_finish=lambda outs, idle: on_finish(rewrite(outs), idle),
                               **kw)

    trainer.engine.generate = scripted
    batches = []
    generate_all = trainer._generate_all
    trainer._generate_all = lambda *a, **k: batches.append(generate_all(*a, **k)) or batches[-1]
    metrics = trainer.step()
    return trainer, metrics, batches[0], call_ids


def _body(rank, world_size, root, device="cpu", *overrides):
    """One step on `world_size` ranks (gloo with engine TP 2 on CPU; `tests/gpu` runs it on one GPU
    with `overrides`), the turns after the first the model's own."""
    trainer, metrics, full, call_ids = _scripted_step(root, "run", device, world_size, None,
                                                      "data.max_response_length=200", *overrides)
    tok = trainer.tokenizer
    # the tool agent's prompts were rendered with the tool's schema, as verl's tool agent renders them
    for it in trainer.train_ds:
        assert ('"name": "lookup"' in tok.decode(it["input_ids"])) == (it["agent_name"] == "tool_agent")
    assert len(full) == 8 and full.num_turns is not None
    mask = full.response_mask.cpu()
    for i, (prompt, response) in enumerate(zip(full.prompts, full.responses)):
        secret = full.extra_infos[i]["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]
        if secret == "s3":  # the single_turn_agent row: the call stays text, nothing runs
            assert response == call_ids and full.num_turns[i] == 2 and full.extra_infos[i]["tool_rewards"] == []
            assert mask[i, :len(response)].tolist() == [1.0] * len(response)
            continue
        answer = tok.decode(response[len(call_ids):], skip_special_tokens=False)
        # the call ended on <|im_end|>: the `\n` the template writes after it, then the tool message
        head = f"\n<|im_start|>user\n<tool_response>\nsecret {secret} for k from rank 0\n</tool_response><|im_end|>\n" \
               "<|im_start|>assistant\n"
        assert response[:len(call_ids)] == call_ids and answer.startswith(head), (rank, answer)
        inserted = len(tok(head, add_special_tokens=False)["input_ids"])
        cut = len(call_ids) + inserted
        assert mask[i, :len(response)].tolist() == [1.0] * len(call_ids) + [0.0] * inserted + \
            [1.0] * (len(response) - cut)
        assert len(response) > cut and full.num_turns[i] == 4
        assert full.extra_infos[i]["tool_rewards"] == [0.5] and full.extra_infos[i]["num_turns"] == 4
    # each row's score is num_turns + its tools' rewards (+ under 0.001): 4.5 for the tool rows, 2 for
    # the single-turn one; a count off by one turn or a missing reward moves the mean by 0.0625 or more
    assert abs(metrics["critic/score/mean"] - (6 * 4.5 + 2 * 2) / 8) < 0.001, metrics["critic/score/mean"]
    assert (metrics["num_turns/min"], metrics["num_turns/max"], metrics["num_turns/mean"]) == (2, 4, 3.5)
    # verl's agent-loop times over the samples: the single-turn rows waited for no tool
    for name in ("generate_sequences", "tool_calls"):
        lo, mean, hi = (metrics[f"timing_s/agent_loop/{name}/{s}"] for s in ("min", "mean", "max"))
        assert 0 <= lo <= mean <= hi <= metrics["timing_s/gen"], (name, lo, mean, hi)
    assert metrics["timing_s/agent_loop/tool_calls/min"] == 0 < metrics["timing_s/agent_loop/tool_calls/max"]
    # the 6 tool rows' calls ran once each, on the engine's first TP rank
    assert RankTool.executed == (6 if rank == 0 else 0), (rank, RankTool.executed)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert torch.isfinite(full.response_mask).all()


def test_multi_turn_tool_rollouts_in_the_trainer(tmp_path):
    _assets(str(tmp_path))
    run_distributed(_body, 2, str(tmp_path), timeout=600)


def _errors_body(rank, world_size, root):
    """Every way the switch, the rows and the tool config can disagree is a ConfigError naming the
    key (or the data row), raised while the trainer is built."""
    import pytest

    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")

    def build(*overrides):
        return PPOTrainer(load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{root}/train.jsonl]", "data.val_files=[]", f"actor_rollout_ref.model.path={root}/model",
            f"custom_reward_function.path={root}/reward.py", f"trainer.default_local_dir={root}/err",
            "trainer.resume_mode=disable", "data.max_prompt_length=512", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.n_gpus_per_node=1", *overrides]), ctx)

    on = "actor_rollout_ref.rollout.multi_turn.enable=true"
    with pytest.raises(ConfigError, match="data.train_files: 3 row.s. run the tool agent .*multi_turn.enable is false"):
        build("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    with pytest.raises(ConfigError, match="multi_turn.enable=true but no row of data.train_files runs the tool agent"):
        build(on)
    with pytest.raises(ConfigError, match="multi_turn.enable=true needs rollout.name=native"):
        build(on, "actor_rollout_ref.rollout.name=hf")
    with pytest.raises(ConfigError, match="multi_turn.tool_config_path: .*missing.yaml"):
        build(on, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={root}/missing.yaml")
    with open(os.path.join(root, "bad.jsonl"), "w") as f:
        f.write(json.dumps({"data_source": "lookup", "prompt": [{"role": "user", "content": "x"}],
                            "reward_model": {"ground_truth": "7"}, "agent_name": "react_agent"}) + "\n")
    from data.dataset import DatasetError

    with pytest.raises(DatasetError, match="bad.jsonl:1: field 'agent_name' is 'react_agent'"):
        build(on, f"data.train_files=[{root}/bad.jsonl]")
    bad_rows = {"text.jsonl": {"prompt": "what is k?"},
                "kwargs.jsonl": {"prompt": [{"role": "user", "content": "x"}], "extra_info": {"tools_kwargs": {"lookup": 1}}}}
    for name, row in bad_rows.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(json.dumps({"data_source": "lookup", "reward_model": {"ground_truth": "7"}, "agent_name": "tool_agent",
                                **row}) + "\n")
    with pytest.raises(DatasetError, match="text.jsonl:1: agent_name tool_agent .* must be chat messages"):
        build(on, f"data.train_files=[{root}/text.jsonl]")
    with pytest.raises(DatasetError, match="kwargs.jsonl:1: field 'extra_info.tools_kwargs' must map"):
        build(on, f"data.train_files=[{root}/kwargs.jsonl]")
    judge = f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={root}/judge.yaml"
    with pytest.raises(ConfigError, match="multi_turn.interaction_config_path: .*nothing.yaml"):
        build(on, f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={root}/nothing.yaml")
    with open(os.path.join(root, "nameless.jsonl"), "w") as f:
        f.write(json.dumps({"data_source": "lookup", "prompt": [{"role": "user", "content": "x"}],
                            "reward_model": {"ground_truth": "7"}, "agent_name": "tool_agent",
                            "extra_info": {"interaction_kwargs": {"name": "teacher"}}}) + "\n")
    with pytest.raises(ConfigError, match=r"nameless\.jsonl:1: extra_info\.interaction_kwargs must name one of "
                                          r".*\(\['judge'\]\) with 'name'; got \{'name': 'teacher'\}"):
        build(on, judge, f"data.train_files=[{root}/nameless.jsonl]")
    # a tokenizer whose chat template drops tool messages: refused naming it and the tool config, before the model
    from tests.byte_chat import CHAT_TEMPLATE, build_byte_tokenizer

    drops = build_byte_tokenizer()
    drops.chat_template = CHAT_TEMPLATE.replace("{% if m['role'] == 'tool' %}", "{% if m['role'] == 'tool' %}{#")\
        .replace("</tool_response><|im_end|>\n", "</tool_response><|im_end|>\n#}")
    drops.save_pretrained(os.path.join(root, "drops_tool"))
    tools = f"actor_rollout_ref.rollout.multi_turn.tool_config_path={root}/tools.yaml"
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.multi_turn\.tool_config_path='.*/tools\.yaml': "
                                          r"the turns append the tools' answers as 'tool' messages, rendered by the "
                                          r"chat template of the tokenizer '.*/drops_tool' .* but the chat template of "
                                          r"'.*drops_tool' renders a 'tool' message without its text"):
        build(on, tools, f"data.tokenizer={root}/drops_tool", "actor_rollout_ref.rollout.agent.default_agent_loop="
              "tool_agent")


def test_multi_turn_config_errors(tmp_path):
    _assets(str(tmp_path))
    run_distributed(_errors_body, 1, str(tmp_path), timeout=300)


def _interaction_body(rank, world_size, root):
    """Tools and interactions together, every turn scripted (the first calls the tool, the others
    answer "ok"): a row with patience p gets the tool's answer, then p "again" replies from the
    judge (user messages, masked out, ran on rank 0 only), then the judge ends it. The turn scores
    and counts reach the reward."""
    from tests.byte_chat import IM_END, build_byte_tokenizer

    tok = build_byte_tokenizer()
    ok_ids = tok("ok", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(IM_END)]
    trainer, metrics, full, call_ids = _scripted_step(
        root, "run_judge", "cpu", world_size, ok_ids, "data.max_response_length=400",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={root}/judge.yaml")
    tok = trainer.tokenizer
    from agent.tools import message_ids, system_prompt_ids

    system = system_prompt_ids(tok)
    newline = tok("\n", add_special_tokens=False)["input_ids"]  # the template's, after each turn's <|im_end|>
    expected_score = 0.0
    for i, response in enumerate(full.responses):
        info = full.extra_infos[i]
        secret = info["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]
        if secret == "s3":
            assert response == call_ids and full.num_turns[i] == 2 and info["turn_scores"] == []
            expected_score += 2
            continue
        patience = info["interaction_kwargs"]["patience"]
        answer = newline + message_ids(tok, [{"role": "tool", "content": f"secret {secret} for k from rank 0"}], system)
        again = newline + message_ids(tok, [{"role": "user", "content": "again, from rank 0"}], system)
        assert response == call_ids + answer + (ok_ids + again) * patience + ok_ids, (rank, secret)
        mask = full.response_mask[i, :len(response)].tolist()
        assert mask == [1.0] * len(call_ids) + [0.0] * len(answer) + ([1.0] * len(ok_ids) + [0.0] * len(again)) \
            * patience + [1.0] * len(ok_ids)
        assert info["turn_scores"] == [0.25] * patience + [0.5] and info["tool_rewards"] == [0.5]
        # model turns, tool answer, replies (the last, which ends the rollout, counted though not appended), 1
        assert full.num_turns[i] == 2 + patience + 1 + (patience + 1) + 1
        expected_score += full.num_turns[i] + 0.5 + len(info["turn_scores"])
    assert abs(metrics["critic/score/mean"] - expected_score / 8) < 0.001, (metrics["critic/score/mean"], expected_score)
    # 6 tool rows, each judged patience + 1 times (patience 0, 1, 2 over two samples each), on rank 0 only
    assert Judge.replies == (2 * (1 + 2 + 3) if rank == 0 else 0), (rank, Judge.replies)


def test_multi_turn_with_interactions_in_the_trainer(tmp_path):
    _assets(str(tmp_path))
    run_distributed(_interaction_body, 2, str(tmp_path), timeout=600)


class Unstartable(BaseInteraction):
    """An interaction whose session cannot start: a user's code failing on the first TP rank."""

    async def start_interaction(self, instance_id=None, **kwargs):
        raise KeyError("no session")


def _failing_interaction_body(rank, world_size, root):
    """`run` on 2 ranks (engine TP 2) with an interaction that raises: an input error, one line a
    rank and exit 1 (no traceback, which the launcher would restart); the rank that only waits for
    the first TP rank's interactions says the same error."""
    import contextlib
    import io

    from trainer.ppo_trainer import run

    with open(os.path.join(root, "unstartable.yaml"), "w") as f:
        f.write("interaction:\n  - name: judge\n    class_name: tests.e2e.test_multi_turn_trainer.Unstartable\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(_config(root, "run_unstartable", world_size,
                           f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={root}/unstartable.yaml"))
    error = "interaction 'judge' (Unstartable).start_interaction failed: KeyError: 'no session'"
    said = error if rank == 0 else f"(on the engine's first TP rank, which runs the tools and interactions) {error}"
    assert code == 1 and err.getvalue().splitlines()[-1] == f"meshppo: error (rank {rank}): {said}", err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_a_failing_interaction_is_an_input_error_on_every_rank(tmp_path):
    _assets(str(tmp_path))
    run_distributed(_failing_interaction_body, 2, str(tmp_path), timeout=600)


class UnstartableOnRank0(BaseInteraction):
    """An interaction whose sessions cannot start on rank 0 alone: one engine replica's rollout fails."""

    async def start_interaction(self, instance_id=None, **kwargs):
        if dist.get_rank() == 0:
            raise KeyError("no session")
        return instance_id


class Cancelled(BaseInteraction):
    """An interaction whose session start raises asyncio.CancelledError (a BaseException, no Exception)."""

    async def start_interaction(self, instance_id=None, **kwargs):
        import asyncio

        raise asyncio.CancelledError()


def _replica_error_body(rank, world_size, root, interaction, tp):
    """`run` on 2 ranks with an interaction of `interaction`'s class: every rank stops with one line naming the
    error, the ranks that did not hit it too (another engine replica's, TP 1; the first TP rank's, TP 2)."""
    import contextlib
    import io

    from trainer.ppo_trainer import run

    path = os.path.join(root, f"{interaction}.yaml")
    if rank == 0:
        with open(path, "w") as f:
            f.write(f"interaction:\n  - name: judge\n    class_name: tests.e2e.test_multi_turn_trainer.{interaction}\n")
    dist.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(_config(root, f"run_{interaction}", world_size,
                           f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}",
                           f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"))
    last = err.getvalue().splitlines()[-1]
    cause = "CancelledError: " if interaction == "Cancelled" else "KeyError: 'no session'"
    error = f"interaction 'judge' ({interaction}).start_interaction failed: {cause}"
    where = ("" if rank == 0 else "(on engine replica 0) " if tp == 1 else
             "(on the engine's first TP rank, which runs the tools and interactions) ")
    assert code == 1 and last.startswith(f"meshppo: error (rank {rank}): {where}") and error in last, err.getvalue()
    assert "Traceback" not in err.getvalue()


@pytest.mark.parametrize("interaction,tp", [("UnstartableOnRank0", 1), ("Cancelled", 2)])
def test_a_failing_replica_or_cancelled_call_stops_every_rank(tmp_path, interaction, tp):
    """One engine replica's rollout failing (TP 1: rank 0's interaction) left the other replica's ranks in the
    gather of the outputs; a call raising asyncio.CancelledError at TP 2 escaped the TP group's agreement."""
    _assets(str(tmp_path))
    run_distributed(_replica_error_body, 2, str(tmp_path), interaction, tp, timeout=300)
