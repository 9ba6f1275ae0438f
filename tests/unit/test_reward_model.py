"""Reward-model scoring: a HF *ForSequenceClassification checkpoint scored at the last token of the actor's
sequence, or of the chat rendered with the reward model's own tokenizer (verl's input_tokenizer)."""

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


OTHER_SPECIALS = ("[PAD]", "[S]", "[/S]", "[Q]", "[A]", "[UNK]")
OTHER_CHARS = tuple(reversed("0123456789+-*= "))  # the demo's characters, other ids
OTHER_TEMPLATE = ("[S]{% for m in messages %}{% if m['role'] == 'user' %}[Q]{% else %}[A]{% endif %}"
                  "{{ m['content'] }}{% endfor %}[/S]")


def other_tokenizer(chat_template: str | None = OTHER_TEMPLATE):
    """A character-level tokenizer like the demo's, with other special tokens, other ids for the
    characters and another chat template: a reward model trained with its own vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(OTHER_SPECIALS + OTHER_CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(OTHER_SPECIALS))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", bos_token="[S]",
                                               eos_token="[/S]", unk_token="[UNK]", clean_up_tokenization_spaces=False)
    tok.chat_template = chat_template
    return tok



def check_dumped_scores(dumped: list[dict], hf, tokenizer, atol: float) -> None:
    """Each dumped sample's score equals `hf`'s (a *ForSequenceClassification) score of the chat
    rendered with `tokenizer`'s template from the dumped prompt and response, for the responses
    whose text is all of their tokens but a final EOS (the demo tokenizer spells a text one token a
    character); those must be at least half of them, and the scores must vary."""
    plain = [d for d in dumped if d["response_length"] == len(d["output"]) + (d["finish_reason"] == "stop")]
    assert len(plain) >= len(dumped) // 2 and len({d["score"] for d in dumped}) > 8, dumped
    with torch.no_grad():
        for d in plain:
            chat = [{"role": "user", "content": d["input"]}, {"role": "assistant", "content": d["output"]}]
            ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False,
                            return_tensors="pt")["input_ids"]
            assert d["score"] == pytest.approx(float(hf(input_ids=ids).logits[0, 0]), abs=atol), d

ACTOR = "/models/actor"  # the actor's model path these tests give reward_model_inputs


def _rm_config(path, input_tokenizer, max_length=None, override_config=None):
    """A reward-model section; input_tokenizer "actor": verl's default, the actor's model path."""
    from trainer.config import RewardModelConfig, RewardModelModelConfig

    src = ACTOR if input_tokenizer == "actor" else input_tokenizer
    model = RewardModelModelConfig(path=str(path), input_tokenizer=src, override_config=override_config or {})
    return RewardModelConfig(enable=True, model=model, max_length=max_length)


def llama_reward_model(path, vocab_size, seed=0):
    """A tiny random Llama reward model (num_labels 1) saved to `path`; returns the HF model."""
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    hf.save_pretrained(path)
    return hf


def test_the_reward_model_reads_the_chat_rendered_with_its_own_template(tmp_path):
    """verl's default (input_tokenizer: the actor's): each response is decoded with the actor's
    tokenizer, its EOS text dropped, appended to the prompt's messages as the assistant turn, and
    the chat rendered with the reward model's own template and vocabulary. The ids are written out
    by hand from the other tokenizer's vocabulary; max_length cuts them on the right."""
    from data.demo import build_demo_tokenizer
    from trainer.setup import reward_model_inputs

    actor = build_demo_tokenizer()
    other = other_tokenizer()
    llama_reward_model(tmp_path / "rm", len(other))
    other.save_pretrained(tmp_path / "rm")
    inputs = reward_model_inputs(_rm_config(tmp_path / "rm", "actor"), actor, ACTOR)
    prompts = [[{"role": "user", "content": "12+3="}], [{"role": "user", "content": "7+8="}]]
    responses = [actor("15")["input_ids"] + [actor.eos_token_id], actor("1 5")["input_ids"]]  # stopped, cut off
    ids = {t: i for i, t in enumerate(OTHER_SPECIALS + OTHER_CHARS)}
    spell = lambda text: [ids[c] for c in text]  # noqa: E731
    s, e, q, a = ids["[S]"], ids["[/S]"], ids["[Q]"], ids["[A]"]
    expected = [[s, q, *spell("12+3="), a, *spell("15"), e], [s, q, *spell("7+8="), a, *spell("1 5"), e]]
    assert inputs(prompts, responses) == expected
    assert expected[0] == [1, 3, 19, 18, 10, 17, 7, 4, 19, 15, 2]  # the same by hand: [S] [Q] 1 2 + 3 = [A] 1 5 [/S]
    cut = reward_model_inputs(_rm_config(tmp_path / "rm", "actor", max_length=6), actor, ACTOR)
    assert cut(prompts, responses) == [x[:6] for x in expected]
    with pytest.raises(TypeError, match="row 1: the prompt is a str, not a list of chat messages"):
        inputs([prompts[0], "7+8="], responses)


@pytest.mark.parametrize("packed", [True, False])
def test_scores_of_a_reward_model_with_its_own_vocabulary_equal_hf(tmp_path, packed):
    """A Llama reward model with another vocabulary than the (Qwen2-shaped demo) actor's: its score
    of each rendered chat equals transformers' LlamaForSequenceClassification on the text that
    transformers' own template call renders."""
    from data.demo import build_demo_tokenizer
    from models import Transformer
    from trainer.setup import reward_model_inputs

    actor = build_demo_tokenizer()
    other = other_tokenizer()
    hf = llama_reward_model(tmp_path / "rm", len(other), seed=1)
    other.save_pretrained(tmp_path / "rm")
    inputs = reward_model_inputs(_rm_config(tmp_path / "rm", "actor"), actor, ACTOR)
    rm = Transformer.from_pretrained(tmp_path / "rm", head="value")
    chats = [("12+3=", "15"), ("7+8=", "1 5 "), ("40+2=", "42")]
    prompts = [[{"role": "user", "content": p}] for p, _ in chats]
    responses = [actor(r)["input_ids"] + [actor.eos_token_id] for _, r in chats]
    seqs = inputs(prompts, responses)
    with torch.no_grad():
        got = last_token_scores(rm, build_micro_batch(seqs, [[] for _ in seqs], "cpu", packed))
        ref = []
        for prompt, (_, response) in zip(prompts, chats):
            text = other.apply_chat_template(prompt + [{"role": "assistant", "content": response}], tokenize=False)
            ids = other(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            ref.append(hf(input_ids=ids).logits[0, 0])
    assert torch.allclose(got, torch.stack(ref), atol=1e-5), (got, ref)


def test_a_reward_model_needs_a_score_head(tmp_path):
    """A *ForSequenceClassification directory has a score head and is accepted; a causal LM has none
    (a value head would start at zero and score every response 0) and is refused naming the option."""
    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import reward_model_inputs

    actor_tok = build_demo_tokenizer()
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    assert reward_model_inputs(_rm_config(tmp_path / "rm", None), actor_tok, ACTOR) is None
    with pytest.raises(UserError, match=r"reward_model.model.path .*lm' has no score head"):
        reward_model_inputs(_rm_config(tmp_path / "lm", None), actor_tok, ACTOR)


def test_a_reward_model_is_read_with_its_override_config(tmp_path):
    """A reward model whose config.json has a rope type meshppo refuses (dynamic) is checked with its
    own `override_config`, which replaces it (`rope_scaling: null`), as the model is built: the check
    read config.json without it and stopped the run."""
    from data.demo import build_demo_tokenizer
    from models.checkpoint import CheckpointFileError
    from trainer.setup import reward_model_inputs

    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    actor_tok = build_demo_tokenizer()
    with pytest.raises(CheckpointFileError, match="dynamic"):
        reward_model_inputs(_rm_config(tmp_path / "rm", None), actor_tok, ACTOR)
    assert reward_model_inputs(_rm_config(tmp_path / "rm", None, override_config={"rope_scaling": None}),
                               actor_tok, ACTOR) is None


def test_a_reward_model_rendering_its_own_chats_needs_a_tokenizer_with_a_template(tmp_path):
    """With input_tokenizer set (verl's default) the reward model's directory must hold a tokenizer
    with a chat template that fits its embedding; an explicit input_tokenizer must be a tokenizer
    directory. Each is refused before any model loads, naming the option and the way out."""
    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import reward_model_inputs

    actor = build_demo_tokenizer()
    llama_reward_model(tmp_path / "bare", len(other_tokenizer()))
    with pytest.raises(UserError, match=r"'.*bare' holds no tokenizer .*set input_tokenizer=null"):
        reward_model_inputs(_rm_config(tmp_path / "bare", "actor"), actor, ACTOR)
    llama_reward_model(tmp_path / "plain", len(other_tokenizer()))
    other_tokenizer(chat_template=None).save_pretrained(tmp_path / "plain")
    with pytest.raises(UserError, match="its tokenizer has no chat template"):
        reward_model_inputs(_rm_config(tmp_path / "plain", "actor"), actor, ACTOR)
    llama_reward_model(tmp_path / "small", len(other_tokenizer()) - 1)
    other_tokenizer().save_pretrained(tmp_path / "small")
    with pytest.raises(UserError, match=f"its tokenizer has {len(other_tokenizer())} token ids but the model embeds "
                                        f"{len(other_tokenizer()) - 1}"):
        reward_model_inputs(_rm_config(tmp_path / "small", "actor"), actor, ACTOR)
    llama_reward_model(tmp_path / "rm", len(other_tokenizer()))
    other_tokenizer().save_pretrained(tmp_path / "rm")
    with pytest.raises(UserError, match=r"input_tokenizer '.*nowhere' is not a directory holding a tokenizer"):
        reward_model_inputs(_rm_config(tmp_path / "rm", str(tmp_path / "nowhere")), actor, ACTOR)
    build_demo_tokenizer(tmp_path / "actor_tok")
    assert reward_model_inputs(_rm_config(tmp_path / "rm", str(tmp_path / "actor_tok")), actor, ACTOR) is not None


def test_a_reward_model_must_read_the_actors_token_ids(tmp_path):
    """With input_tokenizer=null the reward model is given the actor's token ids as they are: a
    directory saved with the actor's tokenizer is accepted; one whose embedding has fewer ids than
    the actor's tokenizer, or whose own tokenizer maps the ids to other text (two characters
    swapped), is refused before any model loads."""
    from tokenizers import Tokenizer, models

    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import reward_model_inputs

    actor_tok = build_demo_tokenizer()
    n = len(actor_tok)

    def rm_dir(name, vocab_size, tokenizer=None):
        cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
        transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    check = lambda path: reward_model_inputs(_rm_config(path, None), actor_tok, ACTOR)  # noqa: E731
    assert check(rm_dir("same", n, build_demo_tokenizer())) is None
    with pytest.raises(UserError, match=rf"embeds {n - 1} token ids but the actor's tokenizer \(data.tokenizer\) has {n}"):
        check(rm_dir("small", n - 1))
    vocab = actor_tok.get_vocab()
    a, b = "1", "2"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    other = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")))
    assert other.get_vocab() != actor_tok.get_vocab() and len(other) == n
    with pytest.raises(UserError, match="has a tokenizer other than the actor's"):
        check(rm_dir("other", n, other))


def test_a_reward_models_vocabulary_is_checked_by_the_tokenizers_largest_id(tmp_path):
    """The reward model's checks counted len(tokenizer), the actor's check its largest id + 1: a tokenizer
    whose ids leave a gap (len n, largest id n + 2) passed against a reward model embedding n + 1 ids,
    and its id n + 2 would have been out of the embedding. One rule now (`tokenizer_size`), for the
    actor's tokenizer read as it is and for the reward model's own."""
    from tokenizers import Tokenizer, models

    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import reward_model_inputs, tokenizer_size

    demo = build_demo_tokenizer()
    n = len(demo)
    vocab = demo.get_vocab()
    last = max(vocab, key=vocab.get)
    vocab[last] = n + 2  # a gap below the largest id
    gapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token=demo.unk_token)), unk_token=demo.unk_token)
    gapped.chat_template = demo.chat_template
    assert len(gapped) == n and tokenizer_size(gapped) == n + 3
    rm = tmp_path / "rm"
    llama_reward_model(rm, vocab_size=n + 1)
    with pytest.raises(UserError, match=rf"embeds {n + 1} token ids but the actor's tokenizer \(data.tokenizer\) "
                                        rf"has {n + 3}"):
        reward_model_inputs(_rm_config(rm, None), gapped, ACTOR)
    gapped.save_pretrained(rm)
    with pytest.raises(UserError, match=rf"its tokenizer has {n + 3} token ids but the model embeds {n + 1}"):
        reward_model_inputs(_rm_config(rm, "actor"), demo, ACTOR)
