"""Command-line generation with the engine.

    python -m rollout.generate --model HF_DIR --prompts IN.jsonl --out OUT.jsonl --max-new-tokens N \
        [--temperature T --top-p P --top-k K --num-samples N --seed S --tp T --dtype bfloat16|float16|float32]
    torchrun --nproc_per_node=2 -m rollout.generate ... --tp 2      # tensor parallel

Input: JSON lines (blank lines skipped), a `.json` array or a `.parquet` file (read as the
trainer reads `data.train_files`), each row with `"prompt"` or `"prompt_token_ids"`. A `"prompt"` is text
(tokenized with the checkpoint's tokenizer, special tokens as the tokenizer adds them) or a list of
chat messages `{"role", "content"}` (rendered with the tokenizer's chat template and the generation
prompt, as the trainer's datasets render them; `--no-chat-template` joins their contents by
newlines instead). Output: one
line per (prompt, sample), prompt-major, with `prompt_index`, `sample_index`,
`prompt_token_ids`, `token_ids`, `logprobs` (see `rollout.config`), `finish_reason`
("stop" | "length") and `text` when the checkpoint has a tokenizer. Generation stops at the
EOS ids of config.json and generation_config.json and the tokenizer's (the trainer's, and vLLM's),
unless `--ignore-eos`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from models.args import torch_dtypes
from rollout.config import KV_CACHE_DTYPES, QUANTIZATIONS

class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--prompts", required=True,
                   help="input JSON lines (or a .json array, or .parquet): 'prompt' (text or chat messages) or "
                        "'prompt_token_ids' per row")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="chat-message prompts: join the contents by newlines instead of the tokenizer's chat template")
    p.add_argument("--out", required=True, help="output JSONL, one line per (prompt, sample)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    # --n is an abbreviation of torchrun's own options: under torchrun only --num-samples reaches us
    p.add_argument("--num-samples", "--n", dest="n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (= torchrun's nproc_per_node)")
    p.add_argument("--dtype", choices=sorted(torch_dtypes()), default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: qkv, gate/up and down projections as e4m3 GEMMs (EngineConfig.quantization)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: the KV cache as e4m3 values with a scale per token and head (EngineConfig.kv_cache_dtype)")
    args = p.parse_args(argv)
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--num-samples", args.n, 1),
                               ("--max-num-seqs", args.max_num_seqs, 1), ("--tp", args.tp, 1)):
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    return args


def load_tokenizer(model_dir: Path):
    from models.tokenizer import has_tokenizer, load_tokenizer as load

    if not has_tokenizer(model_dir):
        return None

    return load(str(model_dir))


def model_eos_ids(model_dir: Path, config_eos, tokenizer=None) -> list[int]:
    """The ids that end a response: the EOS ids of config.json (`config_eos`) and
    generation_config.json (instruct models list several there), and the tokenizer's, where given
    (vLLM and the trainer stop at it too: a fine-tune may change the tokenizer's EOS alone).
    ValueError for an unreadable generation_config.json."""
    ids = []
    sources = [config_eos, None if tokenizer is None else tokenizer.eos_token_id]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            data = json.loads(gen.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{gen}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{gen}: expected a JSON object, got {type(data).__name__}")
        sources.append(data.get("eos_token_id"))
    for e in sources:
        if isinstance(e, int):
            ids.append(e)
        elif isinstance(e, list):
            ids.extend(int(x) for x in e)
    return sorted(set(ids))


def read_prompts(path: Path, tokenizer, vocab_size: int, max_model_len: int,
                 chat_template: bool = True) -> list[list[int]]:
    """Token ids of every prompt; any problem is a CLIError naming the file and line."""
    from data.dataset import DatasetError, parse_json_lines, read_records, render_prompt

    if not path.is_file():
        raise CLIError(f"prompts file {str(path)!r} does not exist")
    try:  # the trainer's readers: JSON lines (any other name too), a .json array, .parquet
        records = (read_records(path) if path.suffix.lower() in (".json", ".parquet")
                   else parse_json_lines(str(path), skip_blank=True))
    except DatasetError as e:
        raise CLIError(str(e)) from None
    prompts = []
    for lineno, obj in records:
        where = f"{path}:{lineno}"
        if ("prompt" in obj) == ("prompt_token_ids" in obj):
            raise CLIError(f"{where}: expected an object with exactly one of 'prompt' or 'prompt_token_ids'")
        if "prompt" in obj:
            if tokenizer is None:
                raise CLIError(f"{where}: 'prompt' given but the model directory has no tokenizer; "
                               f"give 'prompt_token_ids'")
            try:
                text, templated = render_prompt(tokenizer, obj["prompt"], where, "prompt", chat_template,
                                                "--no-chat-template")
            except DatasetError as e:
                raise CLIError(str(e)) from None
            ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        else:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise CLIError(f"{where}: 'prompt_token_ids' must be a list of integers")
        if not ids:
            raise CLIError(f"{where}: empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise CLIError(f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(ids) >= max_model_len:
            raise CLIError(f"{where}: prompt has {len(ids)} tokens, the model's context is {max_model_len} "
                           f"(no room for a response)")
        prompts.append(list(ids))
    if not prompts:
        raise CLIError(f"prompts file {str(path)!r} has no prompts")
    return prompts


def _setup_distributed(tp: int):
    """(tp_mesh or None, device) for this process; under torchrun the world is the TP group."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise CLIError(f"--tp {tp} needs exactly {tp} processes (torchrun --nproc_per_node={tp}); found {world}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if tp == 1:
        return None, device
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))["tp"], device


def run(args: argparse.Namespace) -> int:
    from models.checkpoint import load_model_args
    from rollout import EngineConfig, LLMEngine, SamplingParams

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"--model {args.model!r} is not a model directory (no config.json)")
    out = _check_out(Path(args.out), Path(args.prompts))
    mesh, device = _setup_distributed(args.tp)
    dtype = torch_dtypes()[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model_args = load_model_args(model_dir)
    except (OSError, ValueError) as e:
        raise CLIError(f"--model {args.model!r}: {e}") from None
    longest = model_args.max_position_embeddings
    if args.max_model_len is not None and not 2 <= args.max_model_len <= longest:
        raise CLIError(f"--max-model-len {args.max_model_len}: give 2 to the model's max_position_embeddings "
                       f"({longest})")
    max_model_len = args.max_model_len or longest
    tokenizer = load_tokenizer(model_dir)
    prompts = read_prompts(Path(args.prompts), tokenizer, model_args.vocab_size, max_model_len, args.chat_template)
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                                eos_token_id=model_eos_ids(model_dir, model_args.eos_token_id, tokenizer))
        config = EngineConfig(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max(args.max_num_seqs, args.n),
                              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as e:
        raise CLIError(str(e)) from None
    try:
        engine = LLMEngine.from_pretrained(model_dir, config, tp_mesh=mesh, device=device)
    except (OSError, ValueError) as e:
        raise CLIError(f"--model {args.model!r}: {e}") from None
    from rollout.engine import CacheTooSmallError

    try:
        outputs = engine.generate(prompts, params)
    except CacheTooSmallError as e:
        raise CLIError(e.worded("--gpu-memory-utilization", "--max-model-len")) from None
    if mesh is None or mesh.get_local_rank() == 0:
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            with open(tmp, "w") as f:
                for o in outputs:
                    rec = {"prompt_index": o.prompt_index, "sample_index": o.sample_index,
                           "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "logprobs": o.logprobs,
                           "finish_reason": o.finish_reason}
                    if tokenizer is not None:
                        rec["text"] = tokenizer.decode(o.token_ids, skip_special_tokens=True)
                    f.write(json.dumps(rec) + "\n")
            os.replace(tmp, out)  # a run cut short leaves the previous file whole
        except OSError as e:  # a disk that filled up while generating: the earlier --out file is left as it was
            tmp.unlink(missing_ok=True)
            raise CLIError(f"--out {str(out)!r}: writing the results failed ({e.strerror or e}); "
                           f"{'the earlier file is unchanged' if out.exists() else 'nothing was written'}") from None
    return 0


def _check_out(out: Path, prompts: Path) -> Path:
    """The output path, checked before any work: a file we can create, not the prompts file (the
    results would replace their input) and not a directory."""
    if out.exists() and prompts.exists() and out.resolve() == prompts.resolve():
        raise CLIError(f"--out {str(out)!r} is the prompts file: the results would replace their input")
    if out.is_dir():
        raise CLIError(f"--out {str(out)!r} is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"--out {str(out)!r}: cannot create its directory ({e.strerror})") from None
    from trainer.configlib import ConfigError
    from trainer.setup import check_output_dir

    try:  # the results go to a temporary file beside it first
        check_output_dir("--out's directory", str(out.parent))
    except ConfigError as e:
        raise CLIError(str(e)) from None
    return out


def main(argv=None) -> int:
    import torch.distributed as dist

    from trainer.versions import check_versions

    args = parse_args(argv)
    if code := check_versions():  # an older torch or transformers than requirements.txt's: one line each
        return code
    owned = not dist.is_initialized()
    try:
        return run(args)
    except CLIError as e:
        print(f"rollout.generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
