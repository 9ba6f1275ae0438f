"""A tool_agent row's `extra_info.tool_selection` (verl 0.9.1's per-row tools) in the trainer: 2 CPU
ranks, gloo, engine TP 1, so two engine replicas each generate half of the prompts, `n` = 2. Each
row's prompt shows only its selected tools' schemas; every sample's first turn is a scripted call to
`lookup`, which the tool answers where the row selects it (or selects nothing) and which is answered
as a call to an unknown tool, naming the row's tools, where it does not: in a training step and in
validation."""

import json
import os

from agent.tools import BaseTool, ToolResponse
from tests.dist_utils import run_distributed
from tests.e2e.test_multi_turn_trainer import SCHEMA, _assets, _scripted_step

CLOCK_SCHEMA = {**SCHEMA, "function": {**SCHEMA["function"], "name": "clock", "description": "the time"}}
# per row of the data; the rows are both the training set and the validation set
SELECTIONS = [["clock"], ["lookup"], None, ["clock", "lookup"]]


class Clock(BaseTool):
    """A second tool, which no scripted turn calls."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema or CLOCK_SCHEMA)

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="noon"), 0.0, {}


def _write_rows_and_tools(root):
    """`_assets`' model and reward file, with rows that select tools and a config of two tools."""
    _assets(root)
    with open(os.path.join(root, "train.jsonl"), "w") as f:
        for i, selection in enumerate(SELECTIONS):
            f.write(json.dumps({"data_source": "lookup", "prompt": [{"role": "user", "content": f"what is k{i}?"}],
                                "reward_model": {"ground_truth": "7"},
                                "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": f"s{i}"}}},
                                               "tool_selection": selection}}) + "\n")
    with open(os.path.join(root, "tools.yaml"), "w") as f:
        f.write("tools:\n  - class_name: tests.e2e.test_multi_turn_trainer.RankTool\n    config: {type: native}\n"
                "  - class_name: tests.e2e.test_tool_selection_trainer.Clock\n    config: {type: native}\n")


def _check_answers(tok, batch, call_ids, replicas):
    """Each sample's response is the scripted call, then the answer its row's selection calls for,
    from the rank of the replica that generated its prompt."""
    prompts = len(set(batch.uids))
    for i, response in enumerate(batch.responses):
        info = batch.extra_infos[i]
        selection = info["tool_selection"]
        if selection is None or "lookup" in selection:
            secret = info["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]
            text = f"secret {secret} for k from rank {batch.uids[i] * replicas // prompts}"
        else:
            text = f"Unknown function 'lookup'. Available tools: {selection}"
        # the call ended on <|im_end|>: the `\n` the template writes after it, then the tool message
        head = f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        answer = tok.decode(response[len(call_ids):], skip_special_tokens=False)
        assert response[:len(call_ids)] == call_ids and answer.startswith(head), (i, selection, answer)


def _body(rank, world_size, root):
    trainer, _, train, call_ids = _scripted_step(
        root, "run", "cpu", world_size, None, "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"data.val_files=[{root}/train.jsonl]", "data.max_response_length=200")
    tok = trainer.tokenizer
    for ds in (trainer.train_ds, trainer.val_ds):
        for it in ds:
            shown = [name for name in ("lookup", "clock") if f'"name": "{name}"' in tok.decode(it["input_ids"])]
            assert sorted(shown) == sorted(it["extra_info"]["tool_selection"] or ["lookup", "clock"]), shown
    assert len(train) == 2 * len(SELECTIONS)
    _check_answers(tok, train, call_ids, world_size)
    generate_all, validation = trainer._generate_all, []
    trainer._generate_all = lambda *a, **k: validation.append(generate_all(*a, **k)) or validation[-1]
    trainer.validate()
    assert len(validation) == 1 and len(validation[0]) == len(SELECTIONS)
    _check_answers(tok, validation[0], call_ids, world_size)


def test_tool_selection_in_training_and_validation_over_two_replicas(tmp_path):
    _write_rows_and_tools(str(tmp_path))
    run_distributed(_body, 2, str(tmp_path), timeout=600)
