"""verl's `checkpoint.save_contents` / `load_contents` of the actor and the critic: which files a
checkpoint holds, the `hf_model` export against the sharded weights (and transformers), and a
resume that leaves the optimizer fresh (world size 1, the untrained tiny model)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_distributed
from tests.e2e.conftest import ROOT, checkpoint_keys
from tests.e2e.test_resume import BASE, LENGTH_REWARD
from trainer import cli

DEMO = os.path.join(ROOT, "configs", "demo.yaml")
ACTOR, CRITIC = "actor_rollout_ref.actor.checkpoint", "critic.checkpoint"


def _overrides(assets, run, *extra):
    return [f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run}",
            "trainer.logger=[jsonl]", *BASE, f"custom_reward_function.path={run.parent.parent / 'reward.py'}", *extra]


def _main(assets, run, capsys, *extra):
    # the reward file is part of what makes the run: one per test's root, shared by its copies
    (run.parent.parent / "reward.py").write_text(LENGTH_REWARD)
    code = cli.main(["--config", DEMO, *_overrides(assets, run, *extra)])
    return code, capsys.readouterr().err


def _dcp_model(ckpt_dir) -> dict[str, torch.Tensor]:
    """The weights of a sharded checkpoint, read without a process group (torch's DCP converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return torch.load(out, weights_only=True)["model"]


@pytest.fixture(scope="module")
def gae_run(tiny_assets, tmp_path_factory):
    """One GAE step whose actor checkpoint has no optimizer and an HF export, and whose critic's
    has its optimizer and an HF export but no extra (its LR scheduler)."""

    root = tmp_path_factory.mktemp("contents")
    (root / "reward.py").write_text(LENGTH_REWARD)
    run = root / "gae" / "run"
    code = cli.main(["--config", DEMO, *_overrides(tiny_assets, run, "algorithm.adv_estimator=gae",
                                                   "trainer.total_training_steps=1", "critic.ppo_mini_batch_size=16",
                                                   f"{ACTOR}.save_contents=['model','extra','hf_model']",
                                                   f"{CRITIC}.save_contents=[model,optimizer,hf_model]")])
    assert code == 0
    return run


def test_save_contents_decide_what_each_checkpoint_holds(gae_run):
    step = gae_run / "checkpoints" / "global_step_1"
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["contents"] == {"actor": ["model", "extra", "hf_model"], "critic": ["model", "optimizer", "hf_model"]}
    actor_keys, critic_keys = checkpoint_keys(step / "actor"), checkpoint_keys(step / "critic")
    assert any(k.startswith("model.") for k in actor_keys) and not any(k.startswith("optim.") for k in actor_keys)
    assert any(k.startswith("optim.") for k in critic_keys)
    # the actor's extra: its LR scheduler and the RNG files; the critic's scheduler is not saved
    assert "actor_sched" in state and "critic_sched" not in state and (step / "rng" / "rank_0.pt").is_file()
    # always saved: the run's position
    assert state["trainer"]["global_step"] == 1 and state["loader"]["position"] == 16 and "kl" in state
    for role in ("actor", "critic"):
        hf = step / role / "huggingface"
        assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file(), sorted(os.listdir(hf))
        assert (hf / "tokenizer_config.json").is_file()
    assert json.loads((step / "critic" / "huggingface" / "config.json").read_text())["architectures"][0].endswith(
        "ForTokenClassification")


def test_the_hf_export_is_the_trained_model(gae_run, tiny_assets):
    """The `hf_model` directory holds exactly the sharded checkpoint's weights (which moved away
    from the starting model), and transformers computes the meshppo model's logits from it."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from models import Transformer, load_model_args
    from models.checkpoint import hf_key_to_meshppo

    step = gae_run / "checkpoints" / "global_step_1"
    start = {hf_key_to_meshppo(k): v for k, v in load_file(tiny_assets / "sft_model" / "model.safetensors").items()}
    for role in ("actor", "critic"):
        sharded = _dcp_model(step / role)
        exported = {hf_key_to_meshppo(k): v for k, v in load_file(step / role / "huggingface" / "model.safetensors").items()}
        assert exported.keys() == sharded.keys()
        for k in sharded:  # a copy: bit for bit
            assert torch.equal(exported[k], sharded[k]), (role, k)
        assert any(not torch.equal(sharded[k], start[k]) for k in sharded if k in start), role

    hf_dir = step / "actor" / "huggingface"
    ours = Transformer(load_model_args(hf_dir))
    ours.load_state_dict(_dcp_model(step / "actor"))
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, ours.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(ids), theirs(ids).logits
    # float32 on CPU: the two implementations differ by rounding (~1e-6); logits are O(1)
    assert (ours_logits - their_logits).abs().max() < 1e-4
    assert ours_logits.abs().max() > 1e-2
    critic = AutoModelForTokenClassification.from_pretrained(step / "critic" / "huggingface", torch_dtype=torch.float32)
    assert critic.config.num_labels == 1


def test_a_missing_load_item_is_refused_naming_the_checkpoint(gae_run, tiny_assets, capsys):

    run = gae_run.parent.parent / "copy" / "run"
    shutil.copytree(gae_run, run)
    same = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=16", "trainer.total_training_steps=2"]
    step = run / "checkpoints" / "global_step_1"
    before = (step / "trainer_state.json").read_text()
    # load_contents defaults to save_contents, and this run asks for the actor's optimizer
    code, err = _main(tiny_assets, run, capsys, *same)
    assert code == 1
    assert (f"meshppo: error (rank 0): checkpoint '{step}' has no actor 'optimizer' (it holds ['model', 'extra', "
            f"'hf_model'], the save_contents of the run that wrote it): drop 'optimizer' from {ACTOR}.load_contents") in err
    assert (step / "trainer_state.json").read_text() == before
    code, err = _main(tiny_assets, run, capsys, *same, f"{ACTOR}.load_contents=[model,extra]",
                      f"{CRITIC}.load_contents=[model,optimizer,extra]")
    assert code == 1 and f"checkpoint '{step}' has no critic 'extra'" in err and f"{CRITIC}.load_contents" in err
    # what the checkpoint holds, and hf_model (an export, nothing to load): the run continues
    code, err = _main(tiny_assets, run, capsys, *same, f"{ACTOR}.load_contents=[model,extra,hf_model]",
                      f"{CRITIC}.save_contents=[model,optimizer,hf_model]")
    assert code == 0, err
    assert (f"checkpoint {step}: not loaded (checkpoint.load_contents), starting fresh: actor optimizer (empty "
            "optimizer state); critic extra (LR schedule from its start)") in err
    assert "global_step_2" in os.listdir(run / "checkpoints")


def _resume_body(rank, world_size, overrides, load_contents, saved_dir):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    cfg = load_config(PPOConfig, DEMO, [*overrides, f"{ACTOR}.load_contents={load_contents}"])
    trainer = PPOTrainer(cfg, init_distributed("cpu"))
    m, logs = trainer.models, []
    trainer.ckpt.log = logs.append
    assert trainer.ckpt.maybe_resume("auto") == saved_dir
    assert trainer.global_step == 1 and m.actor_sched.last_epoch == 1
    from pathlib import Path

    saved = _dcp_model(Path(saved_dir) / "actor")
    for name, p in m.actor.named_parameters():
        assert torch.equal(p.to_local().detach(), saved[name]), name
    states = list(m.actor_optim.state.values())
    if "optimizer" in load_contents:
        assert states and all(int(s["step"]) == 1 for s in states) and not logs
    else:  # as built: no moments, the first step will be AdamW's first
        assert not states
        assert logs == [f"checkpoint {saved_dir}: not loaded (checkpoint.load_contents), starting fresh: actor "
                        "optimizer (empty optimizer state)"]


@pytest.mark.parametrize("load_contents", ["[model,extra]", "[model,optimizer,extra]"])
def test_resume_without_optimizer_starts_it_fresh(tiny_assets, tmp_path, capsys, load_contents):
    run = tmp_path / "default" / "run"
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=1")
    assert code == 0, err
    step = run / "checkpoints" / "global_step_1"
    assert any(k.startswith("optim.") for k in checkpoint_keys(step / "actor"))
    assert not (step / "actor" / "huggingface").exists()  # default save_contents: no export
    if "optimizer" in load_contents:  # as a checkpoint from before save_contents existed: all of it loads
        state = json.loads((step / "trainer_state.json").read_text())
        assert state.pop("contents") == {"actor": ["model", "optimizer", "extra"]}
        (step / "trainer_state.json").write_text(json.dumps(state))
    run_distributed(_resume_body, 1, _overrides(tiny_assets, run, "trainer.total_training_steps=2"), load_contents,
                    str(step), timeout=600)


def _sharded_export_body(rank, world_size, assets, root):
    from transformers import AutoModelForCausalLM

    from models.checkpoint import hf_key_to_meshppo
    from sharding.checkpoint import gather_full_state_dict
    from tests.e2e.conftest import demo_trainer
    from tests.e2e.test_lora_trainer import COMMON, LORA

    trainer = demo_trainer(assets, f"{root}/run", f"{root}/reward.py", *COMMON, *LORA, "algorithm.adv_estimator=gae",
                           f"{ACTOR}.save_contents=[model,hf_model]", f"{CRITIC}.save_contents=[hf_model]")
    m = trainer.models
    trainer.step()
    step = trainer.ckpt.save(1)
    critic_full = gather_full_state_dict(m.critic)
    ids = torch.randint(0, m.actor_args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = m.actor(ids)  # the trained LoRA actor, sharded over both ranks, adapters on
    if rank == 0:
        assert sorted(os.listdir(step)) == ["actor", "critic", "trainer_state.json"]  # no extra: no rng/
        assert sorted(os.listdir(f"{step}/critic")) == ["huggingface"]  # only the export
        exported = load_file(f"{step}/critic/huggingface/model.safetensors")
        assert {hf_key_to_meshppo(k) for k in exported} == set(critic_full)
        for k, v in exported.items():
            assert torch.equal(v, critic_full[hf_key_to_meshppo(k)]), k
        # the actor's export: its adapters merged into the weights, as transformers computes it
        theirs = AutoModelForCausalLM.from_pretrained(f"{step}/actor/huggingface", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            their_logits = theirs(ids).logits
        assert (ours - their_logits).abs().max() < 1e-4, (ours - their_logits).abs().max()
        # which the base model's logits are far from: the trained adapters are in the export
        base = AutoModelForCausalLM.from_pretrained(f"{assets}/sft_model", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            gap = (base(ids).logits - their_logits).abs().max()
        assert gap > 1e-2, gap


def test_hf_model_export_of_sharded_models(tiny_assets, tmp_path, capsys):
    """Two ranks: the critic's export is its gathered weights bit for bit (and the checkpoint holds
    nothing else of it), the LoRA actor's export computes the sharded actor's logits. The export
    tool, in one process, rebuilds the LoRA actor from that 2-rank checkpoint: the same merged
    weights, and its adapters as a peft directory that equals the checkpoint's."""
    from models import Transformer
    from models.lora import inject_lora, load_peft_adapter, read_peft_adapter
    from tools import export_hf

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run_distributed(_sharded_export_body, 2, str(tiny_assets), str(tmp_path), timeout=600)
    step = tmp_path / "run" / "checkpoints" / "global_step_1"
    out = tmp_path / "export"
    assert export_hf.main([str(step), str(out)]) == 0
    assert "LoRA adapters merged, and alone in lora_adapter/" in capsys.readouterr().out
    adapter = out / "lora_adapter"
    cfg, tensors = read_peft_adapter(adapter)
    saved = _dcp_model(step / "actor")
    assert len(tensors) == len(saved) and all("lora_" in k for k in saved)
    # the adapters on the base model (peft's way) compute what the merged export computes
    base = Transformer.from_pretrained(tiny_assets / "sft_model")
    inject_lora(base, cfg)
    load_peft_adapter(base, adapter)
    merged = Transformer.from_pretrained(out)
    ids = torch.randint(0, merged.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = base(ids), merged(ids)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()  # float32 rounding of the merge: ~1e-7
    assert (want - Transformer.from_pretrained(tiny_assets / "sft_model")(ids)).abs().max() > 1e-3  # trained
    shutil.rmtree(adapter)  # the rest is the trainer's export of the step
    _same_export(out, step / "actor" / "huggingface")
    # the critic was saved as an export only: no weights to rebuild it from
    assert export_hf.main([str(step), str(tmp_path / "critic"), "--role", "critic"]) == 1
    assert (f"checkpoint {str(step)!r} holds no weights of the critic: its run's critic.checkpoint.save_contents "
            "was ['hf_model'], without 'model'") in capsys.readouterr().err
    # the LoRA actor's base at its model path holding other weights than the run read (as recorded in the
    # checkpoint): the merge would be another model, refused in one line before anything is written
    state_file = step / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["bases"]["actor_rollout_ref.model.path"]["fingerprint"]["model.safetensors"] = "0" * 32
    state_file.write_text(json.dumps(state))
    assert export_hf.main([str(step), str(tmp_path / "other_base")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {str(step)!r} was trained on other files than "
                          f"actor_rollout_ref.model.path={str(tiny_assets / 'sft_model')!r} holds now "
                          "(model.safetensors differ") and err.count("\n") == 1
    assert not (tmp_path / "other_base").exists()


def _same_export(got, want):
    """Two Hugging Face directories with the same files, the same config and tokenizer, and the
    same weights bit for bit."""
    assert sorted(os.listdir(got)) == sorted(os.listdir(want)), (sorted(os.listdir(got)), sorted(os.listdir(want)))
    for name in os.listdir(want):
        if name == "model.safetensors":
            a, b = load_file(got / name), load_file(want / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
        elif (want / name).is_file():
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


def test_export_tool_writes_what_the_trainer_exports(gae_run, tmp_path, capsys):
    """`python -m tools.export_hf` on a checkpoint step gives the actor and the critic exactly as
    the trainer's own `hf_model` exports of that step hold them; a role's directory, or the run's
    checkpoints/ directory (its latest step), name the same."""
    from tools import export_hf

    step = gae_run / "checkpoints" / "global_step_1"
    assert export_hf.main([str(step), str(tmp_path / "actor")]) == 0
    assert f"wrote {tmp_path / 'actor'}: the actor of step 1" in capsys.readouterr().out
    _same_export(tmp_path / "actor", step / "actor" / "huggingface")
    assert export_hf.main([str(step / "critic"), str(tmp_path / "critic")]) == 0
    _same_export(tmp_path / "critic", step / "critic" / "huggingface")
    assert export_hf.main([str(gae_run / "checkpoints"), str(tmp_path / "latest"), "--role", "critic"]) == 0
    _same_export(tmp_path / "latest", step / "critic" / "huggingface")
    # a checkpoint from before trainer states listed their contents: its model directories hold everything
    old = tmp_path / "old" / "global_step_1"
    shutil.copytree(step, old)
    state = json.loads((old / "trainer_state.json").read_text())
    del state["contents"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    assert export_hf.main([str(old), str(tmp_path / "old_critic"), "--role", "critic"]) == 0
    _same_export(tmp_path / "old_critic", step / "critic" / "huggingface")


def test_export_tool_refuses_outputs_it_would_destroy(gae_run, tiny_assets, tmp_path, capsys):
    """Each refusal is one line before anything is written: the run directory (it holds the
    checkpoint), the model the run started from, a directory of other files, a model directory
    without --overwrite; and a checkpoint that is not one, or the wrong role."""
    from tools import export_hf

    step = gae_run / "checkpoints" / "global_step_1"
    before = sorted(p.relative_to(gae_run) for p in gae_run.rglob("*"))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    cases = [([str(step), str(gae_run)], f"output {str(gae_run)!r} holds the checkpoint"),
             ([str(step), str(tiny_assets / "sft_model"), "--overwrite"],
              f"output {str(tiny_assets / 'sft_model')!r} holds {str(tiny_assets / 'sft_model')!r}, which the "
              "checkpoint's run reads"),
             ([str(step), str(other)], "is a directory with other files in it"),
             ([str(step), str(step / "actor" / "huggingface")], "holds the checkpoint or lies inside it"),
             ([str(tmp_path / "nowhere"), str(tmp_path / "out")], f"checkpoint {str(tmp_path / 'nowhere')!r} does "
              "not exist"),
             ([str(tiny_assets), str(tmp_path / "out")], "is not a meshppo checkpoint"),
             ([str(step / "actor"), str(tmp_path / "out"), "--role", "critic"], "is the actor's part of its step, "
              "but --role is critic")]
    for argv, message in cases:
        assert export_hf.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert (other / "todo.txt").read_text() == "keep me" and not (tmp_path / "out").exists()
    assert sorted(p.relative_to(gae_run) for p in gae_run.rglob("*")) == before

    # a model directory is replaced with --overwrite only
    out = tmp_path / "model"
    assert export_hf.main([str(step), str(out), "--role", "critic"]) == 0
    assert export_hf.main([str(step), str(out)]) == 1
    assert "already holds a model; pass --overwrite" in capsys.readouterr().err
    assert export_hf.main([str(step), str(out), "--overwrite"]) == 0
    _same_export(out, step / "actor" / "huggingface")


def test_export_tool_refuses_a_base_config_other_than_the_runs(gae_run, tmp_path, capsys):
    """A full fine-tune's export rebuilds the model from the config.json at its model path: changed since the
    run read it (another epsilon, other RoPE, a directory replaced), the export wrote that config with the
    trained weights, silently another model (rms_norm_eps 0.5 where the run trained with 1e-06). It is now
    refused in one line, for the actor and the critic, before anything is written; changed weights at the path
    do not matter (the checkpoint holds them all)."""
    from tools import export_hf

    step = tmp_path / "checkpoints" / "global_step_1"
    shutil.copytree(gae_run / "checkpoints" / "global_step_1", step)
    state_file = step / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("actor_rollout_ref.model.path", "critic.model.path"):
        state["bases"][key]["fingerprint"]["model.safetensors"] = "0" * 32
    state_file.write_text(json.dumps(state))
    assert export_hf.main([str(step), str(tmp_path / "weights_changed")]) == 0
    _same_export(tmp_path / "weights_changed", step / "actor" / "huggingface")
    for key in ("actor_rollout_ref.model.path", "critic.model.path"):
        state["bases"][key]["fingerprint"]["config.json"] = "0" * 32
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    for role in ("actor", "critic"):
        assert export_hf.main([str(step), str(tmp_path / role), "--role", role]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: checkpoint {str(step)!r} was trained on other files than "
                              f"{'actor_rollout_ref.model' if role == 'actor' else 'critic.model'}.path=") \
            and "(config.json differ from what its run read in" in err and err.count("\n") == 1, err
        assert err.endswith("put back the model the run started from (the export rebuilds the model from these "
                            "files)\n") and "default_local_dir" not in err, err
        assert not (tmp_path / role).exists()
