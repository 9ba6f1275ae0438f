"""The byte count, the EOS stop set, the step-time split and the median run of bench/rollout.py (its GPU
figures rest on them), and the benchmarks' refusals of options they would misreport."""

import argparse

import pytest
import torch

from bench.rollout import engine_config, eos_ids, step_bytes, step_seconds, step_trend
from models import Transformer
from rollout import EngineConfig, LLMEngine
from tests.unit.test_engine import tiny_args


def test_step_bytes_reads_the_looked_up_embedding_rows_not_the_table():
    for kind in ("llama", "qwen2"):  # untied: the table is not read; tied: read whole as the LM head
        args = tiny_args(kind)
        engine = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8), device="cpu")
        with torch.device("meta"):
            params = sum(p.numel() for p in Transformer(args).parameters())
        table = args.vocab_size * args.hidden_size
        batch, context = 3, 10
        weights = params - (table if kind == "llama" else 0) + batch * args.hidden_size
        kv = batch * context * args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim
        nbytes, logits = step_bytes(engine, batch, context)
        assert nbytes == 4 * (weights + kv), kind
        assert logits == 4 * 2 * batch * args.vocab_size


def test_step_bytes_counts_fp8_projections_at_one_byte():
    args = tiny_args("qwen2")
    plain = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8), device="cpu")
    fp8 = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8, quantization="fp8"), device="cpu")
    h, i, d = args.hidden_size, args.intermediate_size, args.head_dim
    projections = args.num_hidden_layers * ((args.num_attention_heads + 2 * args.num_key_value_heads) * d * h
                                            + 2 * i * h + h * i)  # qkv, gate/up, down
    assert fp8.model.fp8_weight_bytes == projections
    assert step_bytes(plain, 3, 10)[0] - step_bytes(fp8, 3, 10)[0] == 3 * projections  # 4 bytes -> 1


def test_step_bytes_counts_an_e4m3_cache_with_its_scales():
    # 3 rows x 10 tokens of context, per layer, K and V, KV head: D float32 values, or D e4m3 bytes and a scale
    args = tiny_args("qwen2")
    plain = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8), device="cpu")
    kv8 = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8, kv_cache_dtype="fp8"), device="cpu")
    rows = 3 * 10 * args.num_hidden_layers * 2 * args.num_key_value_heads
    assert step_bytes(plain, 3, 10)[0] - step_bytes(kv8, 3, 10)[0] == rows * (4 * args.head_dim - (args.head_dim + 4))


def test_eos_ids_spread_over_the_vocabulary():
    v = 151936
    ids = eos_ids(v, 256)
    assert len(ids) == len(set(ids)) == 594 and ids[0] == 0 and ids[-1] < v  # V / 256 = 593.5 ids
    bounds = ids + [v]
    assert {b - a for a, b in zip(bounds, bounds[1:])} == {v // 594, v // 594 + 1}  # even spacing


def test_step_seconds_splits_prefill_and_decode():
    class Event:  # a CUDA event's timestamp, in ms
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, end):
            return end.t - self.t

    steps = [(True, 64, 0.0, 12.5), (False, 256, 13.0, 14.6), (True, 3, 15.0, 16.0), (False, 255, 16.5, 18.0)]
    events = [(pre, rows, Event(a), Event(b)) for pre, rows, a, b in steps]
    prefill, decode = step_seconds(events)
    assert abs(prefill - 0.0135) < 1e-12 and abs(decode - 0.0031) < 1e-12


def test_step_trend_reads_the_cost_of_context():
    # steps of 1.30 ms growing by 1.5 us a step, with a +-0.02 ms wobble that sums to zero and is
    # orthogonal to the step index over each block of 4: the slope is exact
    wobble = [0.02, -0.02, -0.02, 0.02]
    steps = [1.30 + 0.0015 * i + wobble[i % 4] for i in range(40)]
    t = step_trend(steps)
    assert abs(t["decode_us_per_context_token"] - 1.5) < 1e-3
    assert t["decode_ms_first"] == round(sorted(steps[:8])[3] / 2 + sorted(steps[:8])[4] / 2, 4)
    assert t["decode_ms_last"] == round(sorted(steps[-8:])[3] / 2 + sorted(steps[-8:])[4] / 2, 4)
    assert step_trend([1.0]) == {"decode_ms_first": None, "decode_ms_last": None, "decode_us_per_context_token": None}


def test_engine_options_reach_the_engine_config():
    """`--prefill-graph-max-tokens` and the other engine flags land in the EngineConfig; unset, the engine's default."""
    args = argparse.Namespace(gpu_memory_utilization=0.7, enforce_eager=True, tp_all_reduce="nccl",
                              capture_sizes=[1, 8], prefill_graph_max_tokens=None, quantization=None,
                              kv_cache_dtype="auto", max_num_batched_tokens=None)
    c = engine_config(256, 384, args)
    assert c.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    assert engine_config(256, 384, argparse.Namespace(**{**vars(args), "max_num_batched_tokens": 2048})
                         ).max_num_batched_tokens == 2048
    assert c.prefill_graph_max_tokens == EngineConfig().prefill_graph_max_tokens == 2048
    assert c.quantization is None and c.kv_cache_dtype == "auto"
    assert engine_config(256, 384, argparse.Namespace(**{**vars(args), "quantization": "fp8"})).quantization == "fp8"
    assert engine_config(256, 384, argparse.Namespace(**{**vars(args), "kv_cache_dtype": "fp8"})).kv_cache_dtype == "fp8"
    assert (c.max_num_seqs, c.max_model_len, c.gpu_memory_utilization, c.enforce_eager, c.tp_all_reduce,
            c.cudagraph_capture_sizes, c.free_cache_engine) == (256, 384, 0.7, True, "nccl", [1, 8], False)
    for cap in (0, 8192):
        assert engine_config(256, 384, argparse.Namespace(**{**vars(args), "prefill_graph_max_tokens": cap})
                             ).prefill_graph_max_tokens == cap


def test_turn_lengths_fixed_or_a_long_tail_of_the_same_mean():
    """The multi-turn workload's turn lengths: all `mean`, or 1 + an exponential of mean `mean` - 1
    capped at 4 `mean` (whose mean is `mean` - 0.5 less the cap's 1.8 %: 62.35 for 64), checked
    over 4 x 256 draws within 4 standard errors (about 2 tokens)."""
    from bench.rollout import turn_lengths

    assert turn_lengths(3, 2, 64, "fixed") == [[64] * 3] * 2
    lens = turn_lengths(256, 4, 64, "exponential")
    flat = [n for row in lens for n in row]
    assert len(lens) == 4 and len(flat) == 1024 and min(flat) >= 1 and max(flat) <= 256
    assert abs(sum(flat) / len(flat) - 62.35) < 4 * 63 / 1024 ** 0.5
    assert sorted(flat)[512] < 50  # a long tail: the median (44 for an exponential) well below the mean
    assert turn_lengths(256, 4, 64, "exponential") == lens  # seeded
    assert turn_lengths(2, 2, 1, "exponential") == [[1, 1], [1, 1]]


def test_figures_are_the_median_run_and_repeats_must_be_odd(capsys):
    """The figures come from the run of median wall time: with 2 runs there is none (the lower one
    would be a best-of-2), so an even --repeats is refused before any work."""
    import pytest

    from bench.rollout import main, median_run

    runs = [{"wall": w} for w in (1.3, 1.0, 1.2)]
    assert median_run(runs)["wall"] == 1.2
    with pytest.raises(ValueError, match="odd number of runs"):
        median_run(runs[:2])
    with pytest.raises(SystemExit) as e:
        main(["--repeats", "2"])
    assert e.value.code == 2 and "--repeats 2: give an odd count" in capsys.readouterr().err


def test_train_bench_refuses_an_unknown_variant(capsys):
    """bench/train.py ran an unknown --variants name as the base set-up, labelled with that name."""
    import pytest

    from bench.train import main

    with pytest.raises(SystemExit) as e:
        main(["--variants", "base,compiled"])
    assert e.value.code == 2 and "--variants: unknown compiled; known: base, compile, ac" in capsys.readouterr().err


def test_train_bench_measures_each_model_and_variant_in_a_fresh_process():
    """A model built earlier in the process kept its fp32 masters allocated, and later variants'
    peaks counted them: each (model, variant) now gets a command line of its own, the rest as given."""
    from argparse import Namespace

    from bench.train import measurement_argvs

    a = Namespace(models="m05,m15", variants="base,ac_offload", tokens=8192, seq_len=256, repeats=3, profile=True,
                  tiled_mlp=[0], layers=None)
    rest = ["--tokens=8192", "--seq-len=256", "--repeats=3", "--profile"]
    assert measurement_argvs(a) == [[f"--models={m}", f"--variants={v}", *rest]
                                    for m in ("m05", "m15") for v in ("base", "ac_offload")]
    a.models, a.variants, a.profile = "m05", "ac", False
    assert measurement_argvs(a) == [["--models=m05", "--variants=ac", *rest[:3]]]
    a.layers = 4  # a truncated shape: every child builds the same first 4 layers
    assert measurement_argvs(a) == [["--models=m05", "--variants=ac", *rest[:3], "--layers=4"]]
    from bench.train import main

    with pytest.raises(SystemExit) as e:  # refused before any GPU is looked for
        main(["--layers", "0"])
    assert e.value.code == 2


def test_every_engine_is_measured_in_a_fresh_process():
    """At TP 1 each engine, profile and HF measurement runs in a child of its own (a second engine
    in a process decoded 6-7 % slower on some H200s). Each child's command line, read back by the
    same parser, selects exactly its one measurement and carries every other option as given."""
    from bench.rollout import child_argv, isolated_jobs, parser

    ap = parser()
    args = ap.parse_args(["--models", "m05,m15", "--batches", "256,512", "--batch1-models", "m7", "--eos-models",
                          "m05", "--profile", "m15:256", "--hf-batches", "64,256", "--repeats", "5",
                          "--quantization", "fp8", "--capture-sizes", "1,2,4", "--prefill-graph-max-tokens", "0",
                          "--enforce-eager", "--new-tokens", "32"])
    children = [ap.parse_args(child_argv(ap, args, job)) for job in isolated_jobs(args)]

    def chosen(c):
        return (c.models, c.batches, c.batch1_models, c.eos_models, c.profile, c.skip_hf, c.hf_batches)

    assert [chosen(c) for c in children] == [
        ("m05", "256,512", "", "", "", True, ""), ("m15", "256,512", "", "", "", True, ""),
        ("", "", "m7", "", "", True, ""), ("", "", "", "m05", "", True, ""), ("", "", "", "", "m15:256", True, ""),
        ("m05", "", "", "", "", False, "64"), ("m05", "", "", "", "", False, "256"),
        ("m15", "", "", "", "", False, "64"), ("m15", "", "", "", "", False, "256")]
    for c in children:
        assert c.in_process and c.no_tables and not c.quick
        assert (c.repeats, c.quantization, c.capture_sizes, c.prefill_graph_max_tokens, c.enforce_eager,
                c.new_tokens, c.kv_cache_dtype, c.eos_prompts) == (5, "fp8", "1,2,4", 0, True, 32, "auto", 1024)
    quick = ap.parse_args(["--quick"])
    assert [chosen(ap.parse_args(child_argv(ap, quick, j))) for j in isolated_jobs(quick)] == [
        ("qwen2.5-0.5b", "256", "", "", "", True, "")]


def test_isolated_run_gathers_the_childrens_records_and_reports_a_failed_one(capsys):
    """The parent passes each child's output through, tabulates every record, and a child that
    fails is named (with its exit status) without stopping the others."""
    import json

    from bench.rollout import parser, run_isolated

    ap = parser()
    args = ap.parse_args(["--models", "a,b", "--batches", "8", "--batch1-models", "", "--skip-hf"])
    rec = {"benchmark": "rollout", "generated_tok_per_s": 1234.0, "peak_memory_gb": 1.0}

    def launch(argv):
        model = next(a.split("=", 1)[1] for a in argv if a.startswith("--models="))
        if model == "b":  # fails after its first line
            return [f"building {model}\n"], lambda: 3
        record = json.dumps({**rec, "workload": {"engine": "meshppo", "model": model, "prompts": 8}})
        return [f"building {model}\n", record + "\n"], lambda: 0

    assert run_isolated(ap, args, launch) == 1
    out, err = capsys.readouterr()
    assert "building a" in out and "building b" in out
    assert "| meshppo | a | 8 | 1,234 |" in out and "| meshppo | b |" not in out
    assert "a measurement failed" in err and "--models=b" in err and "(exit 3)" in err


def test_ulysses_memory_times_passes_after_a_warm_up_and_refuses_even_repeats(monkeypatch, capsys):
    """Its wall time was the median of every pass, the cold first one included: with the committed
    `--repeats 2`, the mean of the cold and the warm pass."""
    import types

    import pytest

    import bench.ulysses_memory as um

    clock = [0.0]
    cost = iter([9.0, 1.0, 2.0, 1.5])  # seconds of each call of the pass: the first is the cold one
    synced = []

    def one_pass():
        clock[0] += next(cost)

    monkeypatch.setattr(um, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert um.timed_passes(one_pass, 3, lambda: synced.append(clock[0])) == [1.0, 2.0, 1.5]
    assert synced == [9.0, 10.0, 12.0, 13.5]  # the device waited for after each pass, the warm-up's too
    for repeats in ("2", "0"):
        with pytest.raises(SystemExit) as e:
            um.main(["--repeats", repeats])
        assert e.value.code == 2 and f"--repeats {repeats}: give an odd count" in capsys.readouterr().err
