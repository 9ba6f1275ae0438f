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
    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import _check_reward_model

    actor_tok = build_demo_tokenizer()
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    _check_reward_model(str(tmp_path / "rm"), actor_tok)
    with pytest.raises(UserError, match=r"reward_model.path .*lm' has no score head"):
        _check_reward_model(str(tmp_path / "lm"), actor_tok)


def test_a_reward_model_must_read_the_actors_token_ids(tmp_path):
    """The reward model is given the actor's token ids as they are: a directory saved with the actor's
    tokenizer is accepted; one whose embedding has fewer ids than the actor's tokenizer, or whose own
    tokenizer maps the ids to other text (two characters swapped), is refused before any model loads."""
    from tokenizers import Tokenizer, models

    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import _check_reward_model

    actor_tok = build_demo_tokenizer()
    n = len(actor_tok)

    def rm_dir(name, vocab_size, tokenizer=None):
        cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
        transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    _check_reward_model(rm_dir("same", n, build_demo_tokenizer()), actor_tok)
    with pytest.raises(UserError, match=rf"embeds {n - 1} token ids but the actor's tokenizer \(data.tokenizer\) has {n}"):
        _check_reward_model(rm_dir("small", n - 1), actor_tok)
    vocab = actor_tok.get_vocab()
    a, b = "1", "2"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    other = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")))
    assert other.get_vocab() != actor_tok.get_vocab() and len(other) == n
    with pytest.raises(UserError, match="has a tokenizer other than the actor's"):
        _check_reward_model(rm_dir("other", n, other), actor_tok)
