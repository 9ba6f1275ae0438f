"""verl's profiler options in one process per rank (`trainer.profiling`): the plan the config gives
(ranks, tool, settings; errors and notes), and what `StepProfiler` captures at which steps: torch
traces per step or per phase, continuous ranges, and the CUDA tools' calls (mocked: no GPU here)."""

import gzip
import json
import os

import pytest
import torch

from trainer.config import PPOConfig, config_notes
from trainer.configlib import ConfigError, load_config
from trainer.profiling import StepProfiler, last_step_note, profile_plan
from trainer.tracking import Timer

CPU = torch.device("cpu")
ACTOR = "actor_rollout_ref.actor.profiler"


def _cfg(*overrides):
    return load_config(PPOConfig, "configs/demo.yaml", list(overrides))


def _plan(*overrides):
    return profile_plan(_cfg("global_profiler.steps=[2]", *overrides))


def test_defaults_profile_nothing():
    cfg = _cfg()
    assert profile_plan(cfg) is None and cfg.global_profiler.save_path == "outputs/profile"
    assert not any("profil" in n for n in config_notes(cfg))


def test_plan_is_the_union_of_the_enabled_roles():
    # the demo has a reference (use_kl_loss); the actor picks rank 1, the reference rank 0 by default
    plan = _plan("global_profiler.tool=torch", f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[1]",
                 f"{ACTOR}.tool_config.torch.contents=[cpu,shapes]", "actor_rollout_ref.ref.profiler.enable=true",
                 "actor_rollout_ref.ref.profiler.tool_config.torch.contents=[memory]")
    assert (plan.tool, plan.ranks, plan.all_ranks, plan.steps) == ("torch", {0, 1}, False, {2})
    assert plan.contents == {"cpu", "shapes", "memory"} and plan.save_path == "outputs/profile"
    assert [plan.profiles(r) for r in range(3)] == [True, True, False]
    # the rollout's selection is the actor's; a role's own tool needs no global one
    plan = _plan(f"{ACTOR}.tool=torch", f"{ACTOR}.enable=true", f"{ACTOR}.all_ranks=true")
    assert plan.all_ranks and plan.contents == {"cpu", "cuda"}  # empty contents: both activities, as verl
    cfg = _cfg(f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[3]")
    assert (cfg.actor_rollout_ref.rollout.profiler.enable, cfg.actor_rollout_ref.rollout.profiler.ranks) == (True, [3])
    # the global torch_memory settings are the roles' defaults
    plan = _plan("global_profiler.tool=torch_memory", f"{ACTOR}.enable=true",
                 "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=500",
                 "global_profiler.global_tool_config.torch_memory.context=alloc")
    assert (plan.max_entries, plan.context, plan.stacks) == (500, "alloc", "all")


def test_nothing_without_steps_or_enabled_roles_is_a_note():
    cfg = _cfg("global_profiler.tool=torch", "global_profiler.steps=[1]")
    assert profile_plan(cfg) is None
    assert any("no role's profiler.enable is true, nothing is profiled" in n for n in config_notes(cfg))
    # torch_memory: verl dumps a snapshot after every step whatever enable says; the note says meshppo does not
    cfg = _cfg("global_profiler.tool=torch_memory", "global_profiler.save_path=./mem")
    assert profile_plan(cfg) is None
    assert any(n.startswith("global_profiler.tool=torch_memory: no role's profiler.enable is true, so nothing is "
                            "recorded (verl dumps the actor's memory snapshot after every step") for n in config_notes(cfg))
    for steps in ("null", "[]"):  # said as a config writes them (not Python's None)
        cfg = _cfg("global_profiler.tool=torch", f"global_profiler.steps={steps}", f"{ACTOR}.enable=true")
        assert profile_plan(cfg) is None
        assert config_notes(cfg) == [  # (the rollout's enable, the actor's copy: not named)
            f"{ACTOR}.enable: global_profiler.steps is {steps}, nothing is profiled (as in verl: list the steps)"]
    notes = config_notes(_cfg("global_profiler.tool=torch", "global_profiler.steps=[1]", f"{ACTOR}.enable=true",
                              "critic.profiler.enable=true"))
    assert "critic.profiler.enable=true has no effect: the run has no critic" in notes
    assert ("actor_rollout_ref.actor.profiler.tool_config.npu have no effect: tool=npu is not supported"
            in config_notes(_cfg(f"{ACTOR}.tool_config.npu.level=level1")))
    nsys_note = "global_profiler.global_tool_config.nsys.worker_nsight_options has no effect"
    assert any(n.startswith(nsys_note) for n in config_notes(_cfg(
        "global_profiler.global_tool_config.nsys.worker_nsight_options={trace: cuda}")))


def test_steps_without_a_tool_or_an_enabled_role_are_a_note():
    """global_profiler.steps alone (no tool, no role enabled: verl's defaults) profiles nothing, as in verl:
    said at start-up, as the other settings that profile nothing are."""
    assert profile_plan(_cfg("global_profiler.steps=[1, 2]")) is None
    assert [n for n in config_notes(_cfg("global_profiler.steps=[1, 2]")) if "profil" in n] == [
        "global_profiler.steps=[1, 2] has no effect: no profiler tool is set (global_profiler.tool) and no role's "
        "profiler.enable is true: nothing is profiled"]
    assert [n for n in config_notes(_cfg("global_profiler.steps=[]")) if "profil" in n] == []
    # a tool, or an enabled role, has its own note
    for other in ("global_profiler.tool=torch", f"{ACTOR}.enable=true"):
        notes = [n for n in config_notes(_cfg("global_profiler.steps=[1]", other)) if "profil" in n]
        assert len(notes) == 1 and "global_profiler.steps=[1] has no effect" not in notes[0], notes


def test_profiler_notes_name_the_key_set_and_what_it_does():
    """A profiler note names the key the config or command line set: a role's own option, or the global_profiler
    one the role inherits (not the role's copy of it), and says what is unread: stack_depth at any tool, verl's
    sglang contents, the discrete switch that makes profile_continuous_steps unread, a tool named for a role not
    enabled."""
    tm, mem = "global_profiler.global_tool_config.torch_memory", f"{ACTOR}.tool_config.torch_memory"
    why = ("has no effect: torch's _record_memory_history takes no stack depth (it keeps whole stacks; verl passes "
           "it only where torch takes it)")
    on = ("global_profiler.steps=[1, 2]", f"{ACTOR}.enable=true")
    assert config_notes(_cfg(*on, "global_profiler.tool=torch_memory", f"{tm}.stack_depth=16")) == [
        f"{tm}.stack_depth=16 {why}"]  # (the roles inherit it: not named)
    assert config_notes(_cfg(*on, "global_profiler.tool=torch_memory", f"{mem}.stack_depth=16")) == [
        f"{mem}.stack_depth=16 {why}"]
    assert config_notes(_cfg(*on, "global_profiler.tool=torch", f"{tm}.stack_depth=16", f"{mem}.stack_depth=8")) == [
        f"{tm}.stack_depth=16, {mem}.stack_depth=8 {why}"]  # (unread with any tool)
    assert config_notes(_cfg(*on, "global_profiler.tool=torch", f"{ACTOR}.tool_config.torch.contents=[cpu,merge-profiles]")) == [
        f"{ACTOR}.tool_config.torch.contents merge-profiles has no effect: it is verl's sglang server's, meshppo "
        "generates in-process"]
    continuous = "global_profiler.profile_continuous_steps=true has no effect with"
    assert config_notes(_cfg(*on, "global_profiler.tool=torch", f"{ACTOR}.tool_config.torch.discrete=true",
                             "global_profiler.profile_continuous_steps=true")) == [
        f"{continuous} {ACTOR}.tool_config.torch.discrete=true: each phase has its own trace"]
    assert config_notes(_cfg(*on, "global_profiler.tool=nsys", "global_profiler.global_tool_config.nsys.discrete=true",
                             "global_profiler.profile_continuous_steps=true")) == [
        f"{continuous} global_profiler.global_tool_config.nsys.discrete=true: each phase has its own capture range"]
    assert config_notes(_cfg(*on, "global_profiler.tool=nsys", f"{ACTOR}.tool_config.nsys.discrete=true",
                             "global_profiler.profile_continuous_steps=true")) == [
        f"{continuous} {ACTOR}.tool_config.nsys.discrete=true: each phase has its own capture range"]
    assert config_notes(_cfg("global_profiler.steps=[1]", f"{ACTOR}.tool=torch")) == [
        f"global_profiler.steps=[1] has no effect: no role's profiler.enable is true ({ACTOR}.tool=torch names a tool "
        "for a role not enabled): nothing is profiled"]
    # an error between roles names the key each value comes from: the global tool, the reference's own
    with pytest.raises(ConfigError, match=r"^global_profiler.tool=torch, actor_rollout_ref.ref.profiler.tool=nsys: "):
        profile_plan(_cfg(*on, "global_profiler.tool=torch", "actor_rollout_ref.ref.profiler.enable=true",
                          "actor_rollout_ref.ref.profiler.tool=nsys"))


def test_listed_steps_after_the_last_are_a_note():
    profiled = ("global_profiler.tool=torch", f"{ACTOR}.enable=true")
    cfg = _cfg(*profiled, "global_profiler.steps=[2, 5, 7]", "trainer.total_training_steps=2")
    assert ("global_profiler.steps 5, 7 are after the run's last step (2, trainer.total_training_steps): not profiled"
            in config_notes(cfg))
    assert last_step_note(cfg, 2) is None  # said at start-up
    assert not any("after the run's last step" in n
                   for n in config_notes(_cfg(*profiled, "global_profiler.steps=[2]", "trainer.total_training_steps=2")))
    # without total_training_steps the trainer says it, once it knows the last step
    cfg = _cfg(*profiled, "global_profiler.steps=[2, 5]", "trainer.total_training_steps=null")
    assert not any("after the run's last step" in n for n in config_notes(cfg))
    assert last_step_note(cfg, 4) == ("global_profiler.steps 5 is after the run's last step (4: the training set's "
                                      "rounds x trainer.total_epochs): not profiled")
    assert last_step_note(cfg, 5) is None
    assert last_step_note(_cfg("global_profiler.steps=[5]", "trainer.total_training_steps=null"), 4) is None


def test_an_enabled_role_without_a_tool_is_a_note():
    cfg = _cfg("global_profiler.steps=[2]", f"{ACTOR}.enable=true")
    assert profile_plan(cfg) is None
    assert config_notes(cfg) == ["actor_rollout_ref.actor.profiler.enable=true but no tool is set "
                                 "(global_profiler.tool): nothing is profiled"]
    assert config_notes(_cfg("global_profiler.steps=[2]", "actor_rollout_ref.rollout.profiler.enable=true")) == [
        "actor_rollout_ref.rollout.profiler.enable=true but no tool is set (global_profiler.tool): nothing is profiled"]
    # with a role that has a tool, the whole step is profiled on its ranks: a role without one only
    # misses the ranks it would add
    cfg = _cfg("global_profiler.steps=[2]", f"{ACTOR}.enable=true", f"{ACTOR}.tool=torch")
    assert not any("no tool is set" in n for n in config_notes(cfg))  # the rollout: the actor's ranks
    cfg = _cfg("global_profiler.steps=[2]", f"{ACTOR}.enable=true", f"{ACTOR}.tool=torch",
               "actor_rollout_ref.ref.profiler.enable=true", "actor_rollout_ref.ref.profiler.ranks=[0, 1]")
    assert ("actor_rollout_ref.ref.profiler.enable=true but no tool is set (actor_rollout_ref.ref.profiler.tool, "
            "global_profiler.tool): its ranks are not profiled (1; the profiled ranks are 0)") in config_notes(cfg)
    assert not any("no tool is set" in n for n in config_notes(_cfg("global_profiler.steps=[2]")))


@pytest.mark.parametrize("overrides,message", [
    (["global_profiler.tool=npu"], "global_profiler.tool=npu is not supported"),
    (["global_profiler.tool=torch", f"{ACTOR}.enable=true", "actor_rollout_ref.ref.profiler.enable=true",
      "actor_rollout_ref.ref.profiler.tool=nsys"], "need one tool"),
    (["global_profiler.tool=torch", f"{ACTOR}.enable=true", "actor_rollout_ref.ref.profiler.enable=true",
      "actor_rollout_ref.ref.profiler.save_path=/elsewhere"], "need one save_path"),
    (["global_profiler.tool=torch", f"{ACTOR}.enable=true", "actor_rollout_ref.ref.profiler.enable=true",
      "actor_rollout_ref.ref.profiler.tool_config.torch.discrete=true"],
     rf"^{ACTOR}.tool_config.torch.discrete=false, actor_rollout_ref.ref.profiler.tool_config.torch.discrete=true: "
     "meshppo profiles every role in one process per rank, so the enabled roles need one torch discrete mode$"),
    (["global_profiler.tool=torch", f"{ACTOR}.tool_config.torch.contents=[gpu]"], "not among"),
    (["global_profiler.tool=perf"], "not one of"),
    (["global_profiler.global_tool_config.torch_memory.kw_args={max_entries: 5}"], "passes them itself"),
    (["global_profiler.steps=[0]"], "global_profiler.steps"),
])
def test_config_errors(overrides, message):
    from trainer.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(_cfg("global_profiler.steps=[2]", *overrides), 2)


def test_profiler_ranks_beyond_the_launch_are_refused():
    from trainer.config import validate

    with pytest.raises(ConfigError, match=rf"^{ACTOR}.ranks=\[7\]: rank 7 does not exist, the launch has 2 "
                                          r"\(trainer.nnodes x trainer.n_gpus_per_node = 1 x 2\): list ranks 0 to 1$"):
        validate(_cfg("global_profiler.steps=[2]", "global_profiler.tool=torch", f"{ACTOR}.enable=true",
                      f"{ACTOR}.ranks=[7]"))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.ref.profiler.ranks=\[1, 2, 3\]: ranks 2, 3 do not "
                                          r"exist, the launch has 2"):
        validate(_cfg("global_profiler.steps=[2]", "global_profiler.tool=torch",
                      "actor_rollout_ref.ref.profiler.enable=true", "actor_rollout_ref.ref.profiler.ranks=[1,2,3]"))
    # 2 nodes of 2: rank 3 exists; a role that is not enabled profiles nothing anyway
    validate(_cfg("global_profiler.steps=[2]", "global_profiler.tool=torch", f"{ACTOR}.enable=true",
                  f"{ACTOR}.ranks=[3]", "trainer.nnodes=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"))
    validate(_cfg("global_profiler.steps=[2]", "global_profiler.tool=torch", f"{ACTOR}.ranks=[7]"))
    # nothing profiled at all (no steps, or no tool): a note says so, the ranks are not an error
    validate(_cfg("global_profiler.tool=torch", f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[7]"))
    validate(_cfg("global_profiler.steps=[2]", f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[7]"))


@pytest.mark.parametrize("tool", ["nsys", "torch_memory"])
def test_cuda_tools_refuse_a_cpu_run(tool):
    with pytest.raises(ConfigError, match=f"global_profiler.tool={tool} needs CUDA"):
        StepProfiler(_plan(f"global_profiler.tool={tool}", f"{ACTOR}.enable=true"), 0, CPU, 3)
    with pytest.raises(ConfigError, match=r"^the torch profiler's contents \[cuda\] ask for CUDA activity only"):
        StepProfiler(_plan("global_profiler.tool=torch", f"{ACTOR}.enable=true",
                           f"{ACTOR}.tool_config.torch.contents=[cuda]"), 0, CPU, 3)


def _run(profiler, steps, phases=("gen", "update_actor")):
    """`steps` trainer-like steps: each a `step` phase around `phases` (one nested phase inside gen)."""
    timer = Timer(CPU)
    timer.around = profiler.phase
    for n in steps:
        with profiler.step(n), timer("step"):
            for name in phases:
                with timer(name):
                    if name == "gen":
                        with timer("reshard"):
                            torch.ones(3).sum()
                    torch.ones(4).mul(2)
    profiler.close()


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _phase_names(path):
    with gzip.open(path, "rt") as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("phase:")]


def test_torch_traces_the_listed_steps_on_the_chosen_ranks(tmp_path):
    plan = _plan("global_profiler.tool=torch", "global_profiler.steps=[2,4]", f"global_profiler.save_path={tmp_path}",
                 f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[1]", f"{ACTOR}.tool_config.torch.contents=[cpu]")
    _run(StepProfiler(plan, 0, CPU, 5), range(1, 6))  # rank 0: not chosen
    assert _files(tmp_path) == []
    _run(StepProfiler(plan, 1, CPU, 3), range(1, 4))  # step 4 lies beyond the run: fine
    assert _files(tmp_path) == ["step2/prof_rank-1.json.gz"]
    assert sorted(set(_phase_names(tmp_path / "step2/prof_rank-1.json.gz"))) == [
        "phase:gen", "phase:reshard", "phase:step", "phase:update_actor"]


def test_continuous_steps_share_one_trace(tmp_path):
    plan = _plan("global_profiler.tool=torch", "global_profiler.steps=[2,3,5,6]", "global_profiler.profile_continuous_steps=true",
                 f"global_profiler.save_path={tmp_path}", f"{ACTOR}.enable=true")
    _run(StepProfiler(plan, 0, CPU, 5), range(1, 6))  # 5-6 ends with the run, at 5
    assert _files(tmp_path) == ["step2-3/prof_rank-0.json.gz", "step5/prof_rank-0.json.gz"]
    assert _phase_names(tmp_path / "step2-3/prof_rank-0.json.gz").count("phase:step") == 2


def test_discrete_writes_one_trace_per_outermost_phase(tmp_path):
    plan = _plan("global_profiler.tool=torch", f"global_profiler.save_path={tmp_path}", f"{ACTOR}.enable=true",
                 f"{ACTOR}.tool_config.torch.discrete=true")
    _run(StepProfiler(plan, 0, CPU, 3), range(1, 4), phases=("gen", "update_actor", "gen"))
    assert _files(tmp_path) == ["step2/gen-2_prof_rank-0.json.gz", "step2/gen_prof_rank-0.json.gz",
                                "step2/update_actor_prof_rank-0.json.gz"]
    assert sorted(set(_phase_names(tmp_path / "step2/gen_prof_rank-0.json.gz"))) == ["phase:gen", "phase:reshard"]


def test_a_failed_step_still_writes_its_trace(tmp_path):
    plan = _plan("global_profiler.tool=torch", "global_profiler.steps=[1,2]", "global_profiler.profile_continuous_steps=true",
                 f"global_profiler.save_path={tmp_path}", f"{ACTOR}.enable=true")
    profiler = StepProfiler(plan, 0, CPU, 3)
    with pytest.raises(RuntimeError), profiler.step(1):
        raise RuntimeError("boom")
    assert _files(tmp_path) == ["step1-2/prof_rank-0.json.gz"]


def test_nsys_brackets_the_steps_and_marks_the_phases(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    cuda = torch.device("cuda")

    def run(*overrides):
        calls.clear()
        profiler = StepProfiler(_plan("global_profiler.tool=nsys", f"{ACTOR}.enable=true", *overrides), 0, cuda, 3)
        for n in (1, 2, 3):
            with profiler.step(n), profiler.phase("step"), profiler.phase("gen"):
                calls.append("work")  # the phase's work: inside every range
        return list(calls)

    assert run() == ["work", "start", "phase:step", "phase:gen", "work", "pop", "pop", "stop", "work"]
    assert run("global_profiler.global_tool_config.nsys.discrete=true") == [
        "work", "phase:step", "start", "phase:gen", "work", "pop", "stop", "pop", "work"]


def test_torch_memory_records_the_step_and_dumps_a_snapshot(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").close())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    plan = _plan("global_profiler.tool=torch_memory", f"global_profiler.save_path={tmp_path}", f"{ACTOR}.enable=true",
                 f"{ACTOR}.tool_config.torch_memory.trace_alloc_max_entries=77",
                 "global_profiler.global_tool_config.torch_memory.stacks=python",
                 "global_profiler.global_tool_config.torch_memory.kw_args={clear_history: true}")
    profiler = StepProfiler(plan, 0, torch.device("cuda"), 3)
    for n in (1, 2, 3):
        with profiler.step(n):
            assert len(calls) == (1 if n == 2 else 0 if n == 1 else 2)
    assert calls == [dict(max_entries=77, context="all", stacks="python", clear_history=True), dict(enabled=None)]
    assert _files(tmp_path) == ["step2/torch_memory_rank0.pickle"]
