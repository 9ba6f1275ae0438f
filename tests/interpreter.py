"""Run Triton kernel checks on CPU under `TRITON_INTERPRET=1`, in child processes, and compile
every kernel launch they made for a Hopper GPU.

The variable must be set before triton is imported and changes every later `@triton.jit` in
the process, so a test file runs itself as a script in children (`report(__file__, CHECKS)`: one a
core, up to 4, each running its share of the checks), each child runs its checks (`main(_checks(), CHECKS)`,
`_checks` returning the locals that define them) and prints a JSON report, and the tests read the
merged report (`tests(__file__, CHECKS)`: one test per check, one run of the children per file):
nothing leaks into the pytest process.

The checks share what they run: `close` (two tensors within a tolerance), and for an engine
`random_model`, `cpu_engine` and `engine_matches_torch` (its Triton path's tokens and log-probs
against its PyTorch path's, over `PROMPTS` and `sampled()` unless given other runs, e.g. `greedy()`;
`same_tokens` compares two outputs), and `bf16_rounds_to_nearest_even` (the interpreter's float32 -> bf16
conversions rounded as the GPU's, which triton 3.9's interpreter truncates).

The interpreter runs a kernel's Python, not Triton's compiler: a kernel that the compiler
rejects (the return types of two branches of a `constexpr` if disagree, say) passes every
interpreter check and fails on the GPU. So the child also records each distinct launch (kernel,
argument types, `constexpr` values, options), and a second child, without the interpreter,
compiles each one for sm_90 (`triton.compile`, front end to ptxas; no GPU needed; one worker a core, up to 8), with
programmatic dependent launch on as on Hopper, and checks that its shared memory fits a Hopper block.

The child (and every rank of `run_distributed(..., triton_interpret=True)`) has the interpreter patch
`triton.language` once a launch instead of at every `@triton.jit` call inside it
(`patch_language_once_a_launch`): the same kernels run the same way, in about half the time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARKER = "TRITON_REPORT "


def report(test_file: str, checks: list[str]) -> dict:
    """Run `test_file` as a script under the interpreter in one child per core (up to 4), each taking the next of its
    `checks` not yet taken until none is left (they are independent; a child runs one at a time, on one thread);
    the merged report: {check: {"ok", "err" | "error", "s"}}, and every distinct launch any of them made."""
    import pytest

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # (at most 4: each child holds its own torch and models; a file's longest check is a fifth of its checks' time)
    n = max(1, min(len(os.sched_getaffinity(0)), len(checks), 4))
    if n > 1:
        env["OMP_NUM_THREADS"] = "1"  # n children of n threads each would share n cores
    out, launches = {}, {}
    with tempfile.NamedTemporaryFile("w+") as taken:  # how many checks the children have taken
        taken.write("0")
        taken.flush()
        env[_TAKEN] = taken.name
        children = [subprocess.Popen([sys.executable, test_file], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT) for _ in range(n)]
        for child in children:
            stdout, stderr = child.communicate(timeout=600)
            lines = [x for x in stdout.splitlines() if x.startswith(_MARKER)]
            assert child.returncode == 0 and lines, f"interpreter run failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
            part = json.loads(lines[-1][len(_MARKER):])
            for entry in part.pop(_LAUNCHES, []):
                _add_launch(launches, entry)
            out.update(part)
    if _UNUSABLE not in out:
        out[_LAUNCHES] = list(launches.values())
    return out


def _add_launch(launches: dict, entry: dict) -> None:
    """Record `entry` in `launches` unless an equal launch is there (key: its JSON)."""
    launches.setdefault(json.dumps(entry, sort_keys=True), entry)


def _take(names: list[str]):
    """In a child: the checks of `names` it runs, one at a time, each the next one no child has taken (all of them
    outside `report`)."""
    path = os.environ.get(_TAKEN)
    if path is None:
        yield from names
        return
    import fcntl

    while True:
        with open(path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            i = int(f.read())
            f.seek(0)
            f.write(str(i + 1))
        if i >= len(names):
            return
        yield names[i]


def tests(test_file: str, checks: list[str]):
    """The pytest side of a file's checks, to bind at module level:
    `interpreter_report, test_x, test_compiles = interpreter.tests(__file__, CHECKS)` (a module-scoped
    fixture running the child once, one test per check that fails with the check's error, and one
    that compiles every launch the checks made for sm_90)."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_report():
        return report(test_file, checks)

    @pytest.mark.parametrize("check", checks)
    def test_check(interpreter_report, check):
        _skip_if_unusable(interpreter_report)
        result = interpreter_report[check]
        assert result["ok"], result.get("error")

    def test_launches_compile_for_hopper(interpreter_report):
        _skip_if_unusable(interpreter_report)
        launches = interpreter_report[_LAUNCHES]
        assert launches, "the checks launched no kernel"
        failures = compile_report(launches)
        assert not failures, "\n\n".join(failures)

    return interpreter_report, test_check, test_launches_compile_for_hopper


_LAUNCHES = "__launches__"
_TAKEN = "MESHPPO_INTERPRETER_TAKEN"  # in a child: the file counting the checks taken
# The most shared memory one block may use on sm_90 (an H100's or H200's 227 KiB): a compiled kernel needing more
# fails only at its launch on the GPU.
HOPPER_SHARED_BYTES = 227 * 1024
_UNUSABLE = "__unusable__"


def _skip_if_unusable(report: dict) -> None:
    import pytest

    if _UNUSABLE in report:
        pytest.skip(report[_UNUSABLE])


# What triton 3.6's interpreter raises under numpy 2.4 for a loop bounded by a loaded scalar.
_KNOWN_BREAK = "only 0-dimensional arrays can be converted to Python scalars"


def _interpreter_problem() -> str | None:
    """Why this machine's Triton interpreter cannot run a loop bounded by a loaded scalar (None: it can).
    triton 3.6's interpreter indexes with `int()` of a one-element array, which numpy 2.4 refuses: every
    kernel with such a loop fails there (the GPU machine's torch 2.11 pins triton 3.6); its kernels are
    tested by tests/gpu on the GPU instead."""
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def bounded_sum(n_ptr, out_ptr):
        total = 0
        for i in range(0, tl.load(n_ptr)):
            total += i
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        bounded_sum[(1,)](torch.tensor([4], dtype=torch.int32), out)
    except Exception as e:  # only that known failure skips: any other is the checks' to report
        if _KNOWN_BREAK not in str(e):
            raise
        return (f"triton {triton.__version__}'s interpreter cannot run these kernels with numpy {numpy.__version__} "
                f"({type(e).__name__}: {str(e)[:200]}); tests/gpu checks them on a GPU")
    assert out.item() == 6, f"the interpreter's probe summed {out.item()}, expected 6"
    return None
_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8e4nv",
                 "float8_e5m2": "fp8e5", "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8",
                 "uint8": "u8", "bool": "i1"}


def _launch_entry(fn, arg_names, args, kwargs) -> dict | None:
    """What compiles one launch: the kernel's module and name, each argument's Triton type (or `constexpr`
    and its value), the compile options. None for a kernel that is not importable by module and name."""
    import inspect

    import torch

    if fn.__module__ == "__main__":
        return None
    params = inspect.signature(fn).parameters
    bound = {**dict(zip(arg_names, args)), **{k: v for k, v in kwargs.items() if k in params}}
    signature, constexprs = {}, {}
    for name in arg_names:
        value = bound.get(name, params[name].default)
        if "constexpr" in str(params[name].annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    if "PDL" in constexprs:
        constexprs["PDL"] = True  # as launched on Hopper
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "options": options}


def _record_launches(launches: dict) -> None:
    """Record each distinct launch of an interpreted kernel into `launches` (key: its JSON)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        entry = _launch_entry(self.fn, self.arg_names, args, kwargs)
        if entry is not None:
            _add_launch(launches, entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


def patch_language_once_a_launch() -> bool:
    """Make Triton's interpreter patch each `triton.language` module once a kernel launch, not again at every
    call of a `@triton.jit` function inside it (`tl.sum`, `tl.max`, meshppo's helpers). The interpreter swaps
    a module's builtins for numpy-backed ones when a launch starts (`_patch_lang`, undone when it ends) and
    again, scanning the whole module, at each such call: about 2 ms a call, a third of an engine check's
    time. A call's swaps are never undone, so repeating them within a launch changes nothing; a call that
    sees a module not yet patched in this launch (triton's own helpers see `triton.language.core`) is
    patched as before. Whether it did: a Triton whose interpreter has not these internals (`_patch_lang`, a
    `_LangPatchScope` that `restore`s) is left as it is, its kernels as slow and as right as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    if not callable(getattr(ti, "_patch_lang", None)) or not hasattr(getattr(ti, "_LangPatchScope", None), "restore"):
        return False
    patch, launch = ti._patch_lang, []  # while a launch runs: the ids of the modules patched in it

    def langs(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        fn_langs = langs(fn)
        if launch and fn_langs <= launch[0]:
            return ti._LangPatchScope()  # a call inside the launch, its modules patched already
        scope = patch(fn)
        if launch:
            launch[0] |= fn_langs
        else:  # a launch: GridExecutor restores its scope when it ends
            launch.append(fn_langs)
            restore = scope.restore

            def restore_and_end():
                restore()
                launch.clear()

            scope.restore = restore_and_end
        return scope

    patch_lang.__wrapped__ = patch
    ti._patch_lang = patch_lang
    return True


def compile_report(launches: list[dict]) -> list[str]:
    """Compile `launches` for sm_90 in a child without the interpreter; the failures, one message each, in the
    launches' order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", "from tests.interpreter import compile_main; compile_main()"],
                          input=json.dumps(launches), capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARKER)]
    assert proc.returncode == 0 and lines, f"compile run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(_MARKER):])


def _compile_one(e: dict) -> str | None:
    """`triton.compile` of launch `e` for sm_90: None, or why it would fail on an H100."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(e["module"]), e["name"])
    names = list(e["signature"])
    src = ASTSource(fn=kernel, signature=e["signature"],
                    constexprs={(names.index(k),): v for k, v in e["constexprs"].items()})
    try:
        shared = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=e["options"]).metadata.shared
    except Exception as exc:  # reported to the parent test
        return f"{e['module']}.{e['name']} {e['constexprs']}: {type(exc).__name__}: {exc}"[:4000]
    if shared > HOPPER_SHARED_BYTES:  # the launch would fail on the GPU (out of resources)
        return (f"{e['module']}.{e['name']} {e['constexprs']}: needs {shared} bytes of shared memory, more than a "
                f"block may have on an H100 ({HOPPER_SHARED_BYTES})")
    return None


def compile_main() -> None:
    """In the compile child: each launch from stdin through `_compile_one`, on every core (up to 8; a compile takes a
    fraction of a second to half a minute of one core: a float32 prefill attention at head dim 256 the most, so
    each worker takes the next launch when it is done with one); print the failures."""
    import importlib
    import multiprocessing

    importlib.import_module("triton")  # once, before the workers fork
    assert os.environ.get("TRITON_INTERPRET") != "1"
    launches = json.loads(sys.stdin.read())
    workers = min(len(os.sched_getaffinity(0)), len(launches), 8)  # (forked: they share the imported modules)
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = list(pool.imap(_compile_one, launches, chunksize=1))
    else:
        results = [_compile_one(e) for e in launches]
    print(_MARKER + json.dumps([r for r in results if r is not None]), flush=True)


@contextlib.contextmanager
def bf16_rounds_to_nearest_even():
    """In a check, while inside: the interpreter's float32 -> bfloat16 conversions (`x.to(tl.bfloat16)`) round to
    nearest even, as the GPU's (`cvt.rn.bf16.f32`) and PyTorch's do; triton 3.9's interpreter truncates them
    (`InterpreterBuilder.cast_impl`), one ulp off about half the time, so a kernel that rounds like torch (the
    sampler's soft cap) could not be told from one that rounds otherwise."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as ti

    cast = ti.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
            return ti.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    ti.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        ti.InterpreterBuilder.cast_impl = cast


def close(a, b, tol: float) -> float:
    """In a check: the largest absolute difference of tensors `a` and `b` (in float32), asserted to be at most
    `tol`; returns it."""
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"
    return err


def random_model(args, norm_mean: float = 1.0, norm_std: float = 0.2):
    """In a check: meshppo's model of `args` (ModelArgs) with random weights from torch's global generator, large
    enough that every token choice matters: norm weights `norm_mean` + `norm_std` · N(0, 1) (Gemma 3's norms scale by
    1 + weight: mean 0), the others 0.3 · N(0, 1)."""
    import torch

    from models import Transformer

    model = Transformer.build(args, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(norm_mean + norm_std * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
    return model


def cpu_engine(args, model, dtype=None):
    """In a check: a CPU engine of `args` (blocks of 4 tokens, 16 of them, 8 tokens a step: prompts are chunked and
    sequences span blocks) holding `model`'s weights, in `dtype` (float32 unless given)."""
    import torch

    from rollout import EngineConfig, LLMEngine

    engine = LLMEngine(args, EngineConfig(dtype=dtype or torch.float32, block_size=4, num_kv_blocks=16,
                                          max_num_batched_tokens=8), device="cpu")
    engine.load_weights(model.named_parameters())
    return engine


# Two prompts, of 3 tokens and of 10 (longer than a step's 8: a chunked prefill)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def sampled(max_tokens: int = 4, **kw):
    """Sampling parameters drawing two samples a prompt at temperature 0.9 (seed 1): prefill, then decode steps of
    several rows."""
    from rollout import SamplingParams

    return SamplingParams(**{**dict(temperature=0.9, n=2, max_tokens=max_tokens, seed=1), **kw})


def greedy(max_tokens: int = 4):
    """Greedy sampling parameters (temperature 0): one sample a prompt, its log-probs at temperature 1."""
    from rollout import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)


def logprob_gap(got: list, ref: list) -> float:
    """The largest difference of the log-probs of the outputs `got` and `ref` (lists of RequestOutput, paired)."""
    return max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x.logprobs, y.logprobs))


def same_tokens(got: list, ref: list) -> float:
    """In a check: the outputs `got` have the tokens of `ref`; the largest difference of their log-probs."""
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    return logprob_gap(got, ref)


def engine_matches_torch(engine, runs: list | None = None, tol: float = 1e-4) -> float:
    """In a check: `engine`'s Triton path (`runner.use_triton`) against its PyTorch path over `runs`, a list of
    (prompts, sampling params) generated in turn (default: PROMPTS sampled()): the same tokens, the log-probs within
    `tol`; returns their largest difference. The engine is left on the Triton path."""
    runs = runs or [(PROMPTS, sampled())]
    outs = []
    for use_triton in (False, True):
        engine.runner.use_triton = use_triton
        outs.append([o for prompts, sp in runs for o in engine.generate(prompts, sp)])
    err = same_tokens(outs[1], outs[0])
    assert err <= tol, f"log-probs differ by {err} > {tol}"
    return err


def main(checks: dict, names: list[str]) -> None:
    """In the child: run each check of `names` (returns its max error) from `checks` (a test file's `_checks()`:
    the locals that define them), recording the kernel launches, and print the report."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    problem = _interpreter_problem()
    if problem is not None:
        print(_MARKER + json.dumps({_UNUSABLE: problem}), flush=True)
        return
    import torch

    out, launches = {}, {}
    patch_language_once_a_launch()
    _record_launches(launches)
    for name in _take(names):
        check = checks[name]
        # the checks are taken from a counter shared by the children, in an order that varies from run to run: each
        # draws its random inputs from the same seed, so that they do not depend on which checks ran before it here
        torch.manual_seed(0)
        t0 = time.perf_counter()
        try:
            out[name] = {"ok": True, "err": check(), "s": time.perf_counter() - t0}
        except Exception as e:  # reported to the parent test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    out[_LAUNCHES] = list(launches.values())
    print(_MARKER + json.dumps(out), flush=True)
