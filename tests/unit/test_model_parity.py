"""meshppo's transformer against `transformers` on tiny random checkpoints (float32)."""

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _hf_model(kind: str, **overrides):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    common.update(overrides)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":  # Qwen3's heads are wider than hidden / heads (128 against 64-80 in its models)
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, **{"head_dim": 24, **common})
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases; give them values so the test sees them
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif n.endswith(("q_norm.weight", "k_norm.weight")):  # and the per-head norms other than ones
                p.uniform_(0.5, 1.5)
    return model


ROPE_VARIANTS = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
]


def _save(hf, tmp_path):
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


@pytest.mark.parametrize("kind,overrides", ROPE_VARIANTS)
def test_padded_logits_match_hf(tmp_path, kind, overrides):
    hf = _hf_model(kind, **overrides)
    if "rope_scaling" in overrides:  # transformers v5 keeps scaling in rope_parameters
        rp = dict(overrides["rope_scaling"], rope_theta=10000.0)
        hf.config.rope_parameters = rp
        hf = type(hf)(hf.config).eval()
    ours = Transformer.from_pretrained(_save(hf, tmp_path), dtype=torch.float32)
    if "rope_scaling" in overrides:
        assert ours.args.rope_type == overrides["rope_scaling"]["rope_type"]
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 40))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[1, :15] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, position_ids=pos, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_packed_logits_match_hf_per_sequence(tmp_path, kind):
    hf = _hf_model(kind)
    ours = Transformer.from_pretrained(_save(hf, tmp_path))
    torch.manual_seed(2)
    lengths = [5, 17, 1, 30]
    seqs = [torch.randint(0, 97, (n,)) for n in lengths]
    packed = torch.cat(seqs)[None]
    cu = cu_seqlens_from_lengths(lengths)
    with torch.no_grad():
        got = ours(packed, cu_seqlens=cu)[0]
        for i, s in enumerate(seqs):
            ref = hf(input_ids=s[None]).logits[0]
            assert (got[cu[i]:cu[i + 1]] - ref).abs().max().item() <= TOL


def test_save_load_round_trip_exact(tmp_path):
    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, model_type="qwen2",
                     attention_bias=True, tie_word_embeddings=False)
    model = Transformer.build(args, seed=3)
    # A tiny shard size forces the sharded-with-index layout.
    model.save_pretrained(tmp_path / "m", max_shard_size=20_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    again = Transformer.from_pretrained(tmp_path / "m")
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    # and transformers reads it back with the same logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - model(ids)).abs().max().item() <= TOL


def test_value_model_from_token_classification(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    torch.manual_seed(4)
    hf = transformers.Qwen2ForTokenClassification(cfg).eval()
    with torch.no_grad():
        hf.score.bias.fill_(0.37)
    hf.save_pretrained(tmp_path / "v")
    critic = Transformer.from_pretrained(tmp_path / "v", head="value")
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[..., 0]
        got = critic(ids)
    assert got.shape == (2, 7)
    assert (got - ref).abs().max().item() <= TOL


def test_value_model_from_causal_lm_starts_at_zero(tmp_path):
    hf = _hf_model("qwen2")
    critic = Transformer.from_pretrained(_save(hf, tmp_path), head="value")
    with torch.no_grad():
        assert torch.equal(critic(torch.randint(0, 97, (2, 5))), torch.zeros(2, 5))


def test_meta_build_never_allocates_full_model_on_cpu(tmp_path):
    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        m = Transformer(args)
    assert all(p.is_meta for p in m.parameters())


def test_bad_checkpoint_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Transformer.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Transformer.from_pretrained(tmp_path / "empty")


def test_packed_position_ids_restart_at_each_sequence():
    from models import position_ids_from_lengths

    assert position_ids_from_lengths([3, 1, 0, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    assert position_ids_from_lengths([]).tolist() == []
    assert position_ids_from_lengths([2]).dtype == torch.long


def test_qwen2_with_its_own_head_dim_loads_and_exports(tmp_path):
    """A Qwen2 checkpoint whose head_dim is not hidden / heads (32 against 16): meshppo's logits equal
    transformers', and the trained-policy export (`export_hf`) writes a directory that transformers loads
    with the same logits, carrying the base checkpoint's generation_config.json (its EOS ids)."""
    from trainer.checkpointing import export_hf
    from models.checkpoint import load_model_args

    hf = _hf_model("qwen2", head_dim=32)
    base = _save(hf, tmp_path)
    transformers.GenerationConfig(eos_token_id=[5, 6], temperature=0.7, top_p=0.8, do_sample=True).save_pretrained(base)
    ours = Transformer.from_pretrained(base)
    assert ours.args.head_dim == 32
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= TOL

    class _Tokenizer:
        def save_pretrained(self, path):
            pass

    out = tmp_path / "hf_actor"
    export_hf(ours, load_model_args(base), _Tokenizer(), str(out), True, base_model=str(base))
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max().item() <= TOL
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [5, 6] and generation.temperature == 0.7


@pytest.mark.parametrize("kind,overrides", [("llama", {"mlp_bias": True}), ("qwen2", {}), ("qwen3", {}),
                                            ("llama", {"head_dim": 24})])
def test_num_params_counts_what_transformers_counts(tmp_path, kind, overrides):
    """`ModelArgs.num_params` (the MFU's FLOP count) against transformers' parameter count, biases included."""
    hf = _hf_model(kind, **overrides)
    ours = Transformer.from_pretrained(_save(hf, tmp_path))
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())


def test_qwen3_round_trips_through_transformers(tmp_path):
    """A Qwen3 model built by meshppo (per-head q/k norms, head_dim 24 against hidden / heads 16, untied
    head) saves a directory that transformers loads as Qwen3ForCausalLM with the same logits, and loads
    back bit for bit; a Qwen3 token classifier becomes a value model with transformers' scores."""
    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=24, model_type="qwen3", tie_word_embeddings=False)
    model = Transformer.build(args, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 24
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - model(ids)).abs().max().item() <= TOL
    again = Transformer.from_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    cfg = transformers.Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=24, num_labels=1)
    torch.manual_seed(4)
    scorer = transformers.Qwen3ForTokenClassification(cfg).eval()
    with torch.no_grad():
        scorer.score.bias.fill_(0.37)
        scorer.model.layers[0].self_attn.k_norm.weight.uniform_(0.5, 1.5)
    scorer.save_pretrained(tmp_path / "v")
    critic = Transformer.from_pretrained(tmp_path / "v", head="value")
    with torch.no_grad():
        assert (critic(ids % 40) - scorer(input_ids=ids % 40).logits[..., 0]).abs().max().item() <= TOL


def test_qwen3_variants_meshppo_lacks_are_refused(tmp_path):
    """A Qwen3 checkpoint with sliding-window layers loads with its window on those layers
    (tests/unit/test_attention_window.py: logits past the window), layers of another type are refused naming
    layer_types, and one with attention biases (transformers puts one on o_proj too, which meshppo's attention
    lacks) is refused."""
    cfg = transformers.Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1)
    args = ModelArgs.from_hf_config(cfg)
    assert args.windowed_layers == [1] and args.attention_window == 8 and args.layer_windows == [None, 8]
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        ModelArgs.from_hf_config(cfg)
    cfg.layer_types = ["full_attention"] * 2
    assert ModelArgs.from_hf_config(cfg).qk_norm and ModelArgs.from_hf_config(cfg).attention_window is None
    cfg.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.parametrize("max_window_layers", [2, 5])
def test_qwen2_sliding_window_that_windows_no_layer_loads(tmp_path, max_window_layers):
    """Qwen2's use_sliding_window=true windows only the layers from max_window_layers on: with
    max_window_layers at or past num_hidden_layers (2) none is, and transformers' logits past the
    window (16 positions) are meshppo's full-attention ones."""
    hf = _hf_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers)
    ours = Transformer.from_pretrained(_save(hf, tmp_path))
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= TOL


def test_qwen2_sliding_window_read_where_a_layer_is_windowed():
    """Without layer_types (transformers v4's config.json) the windowed layers are those from
    max_window_layers on, as transformers reads them."""
    cfg = dict(model_type="qwen2", vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8)
    args = ModelArgs.from_hf_config(dict(cfg, max_window_layers=1))
    assert args.windowed_layers == [1, 2] and args.layer_windows == [None, 8, 8]
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=3)).attention_window is None
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=1, sliding_window=None)).attention_window is None


def test_llama_attention_bias_is_refused_naming_config_json(tmp_path):
    """transformers' Llama with attention_bias=true has a bias on o_proj too, which meshppo's attention
    lacks: the checkpoint is refused naming its config.json and the key, not its tensors. (meshppo's
    own llama with q/k/v biases, saved without o_proj biases, loads: its tests' models are such.)"""
    from models.checkpoint import CheckpointFileError

    path = _save(_hf_model("llama", attention_bias=True), tmp_path)
    with pytest.raises(CheckpointFileError) as e:
        Transformer.from_pretrained(path)
    message = str(e.value)
    assert message.startswith(f"{str(path / 'config.json')!r}: ValueError: config.json's llama with "
                              "attention_bias=true, whose weights bias o_proj"), message
    ours = Transformer.build(ModelArgs(model_type="llama", attention_bias=True), seed=0)
    ours.save_pretrained(tmp_path / "ours")
    assert Transformer.from_pretrained(tmp_path / "ours").args.attention_bias


def test_a_checkpoint_with_rope_buffers_loads_as_transformers_loads_it(tmp_path):
    """Older transformers wrote each layer's `rotary_emb.inv_freq` buffer into checkpoints; transformers
    ignores it when it loads (RoPE's frequencies come from config.json), and meshppo refused the checkpoint
    ("has tensor ... that the model does not have")."""
    from safetensors.torch import load_file, save_file

    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, model_type="llama", tie_word_embeddings=False)
    model = Transformer.build(args, seed=3)
    model.save_pretrained(tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    for i in range(2):  # wrong values on purpose: they must not be read
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.full((8,), 7.0)
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    again = Transformer.from_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - again(ids)).abs().max().item() <= TOL
