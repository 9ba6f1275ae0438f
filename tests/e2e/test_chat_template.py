"""`actor_rollout_ref.model.custom_chat_template` (verl's) replaces the tokenizer's template: the
prompts are rendered with it, and the tokenizer the trainer exports carries it. A template that
does not render is a ConfigError naming the key, before any data is read."""

import pytest

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import DENSE_REWARD, _config

# the demo tokenizer is character-level over digits, "+-*= " and its role tokens
TEMPLATE = ("{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} <|assistant|>{% endif %}")


def _body(rank, world_size, assets, run_root):
    from trainer.configlib import ConfigError
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    own = PPOTrainer(_config(assets, run_root, "own"), ctx)
    custom = PPOTrainer(_config(assets, run_root, "custom", f"actor_rollout_ref.model.custom_chat_template={TEMPLATE!r}"),
                        ctx)
    texts = [t.tokenizer.decode(t.train_ds[0]["input_ids"], skip_special_tokens=False) for t in (own, custom)]
    question = texts[0].removeprefix("<|user|>").removesuffix("<|assistant|>")
    assert texts[0] == f"<|user|>{question}<|assistant|>"  # the tokenizer's own template
    assert texts[1] == f"<|user|> {question} <|assistant|>", texts  # the custom one, spaces and all
    assert custom.tokenizer.chat_template == TEMPLATE  # what export_hf saves with the weights
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.custom_chat_template does not render a chat"):
        PPOTrainer(_config(assets, run_root, "bad", "actor_rollout_ref.model.custom_chat_template='{% for m in messages %}'"),
                   ctx)


def test_custom_chat_template_renders_the_prompts(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)
