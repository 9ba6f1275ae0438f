"""Reward-model scoring: a HF *ForSequenceClassification checkpoint scored at the last response token."""

import pytest
import torch

from models import Transformer
from trainer.forward import build_micro_batch, last_token_scores

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("packed", [True, False])
def test_last_token_score_equals_hf_sequence_classification(tmp_path, packed):
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path / "rm")
    rm = Transformer.from_pretrained(tmp_path / "rm", head="value")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[14, 15], [16, 17, 18, 19], [20]]
    with torch.no_grad():
        got = last_token_scores(rm, build_micro_batch(prompts, responses, "cpu", packed))
        ref = torch.stack([hf(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])
    assert torch.allclose(got, ref, atol=1e-5)


def test_a_reward_model_needs_a_score_head(tmp_path):
    """A *ForSequenceClassification directory has a score head and is accepted; a causal LM has none
    (a value head would start at zero and score every response 0) and is refused naming the option."""
    from trainer.errors import UserError
    from trainer.setup import _check_reward_model

    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    _check_reward_model(str(tmp_path / "rm"))
    with pytest.raises(UserError, match=r"reward_model.path .*lm' has no score head"):
        _check_reward_model(str(tmp_path / "lm"))
