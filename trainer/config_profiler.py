"""verl's profiler options (`global_profiler` and each role's `profiler`), as config sections;
`trainer.profiling` turns them into what every rank profiles."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configlib import opt, section


PROFILER_TOOLS = ("nsys", "npu", "torch", "torch_memory")
TORCH_PROFILER_CONTENTS = ("cuda", "cpu", "memory", "shapes", "stack", "profile-by-stage", "merge-profiles")


@dataclass
class NsysToolConfig:
    discrete: bool | None = opt(None, "nsys: one capture range per phase of the step (gen, old_log_prob, "
                                      "update_actor, ...) instead of one per profiled step; null: "
                                      "global_profiler.global_tool_config.nsys.discrete")


@dataclass
class TorchProfilerToolConfig:
    contents: list[str] = opt(default_factory=list, help="torch: what the trace records: cpu, cuda (the "
                                                         "activities; none named: both), memory (allocations), "
                                                         "shapes (input shapes), stack (Python stacks); "
                                                         "profile-by-stage and merge-profiles are verl's sglang "
                                                         "server's and have no effect")
    discrete: bool = opt(False, "torch: one trace per phase of the step (gen, old_log_prob, update_actor, ...) "
                                "instead of one per profiled step")

    def __post_init__(self):
        bad = [c for c in self.contents if c not in TORCH_PROFILER_CONTENTS]
        if bad:
            raise ValueError(f"contents: {bad} not among {list(TORCH_PROFILER_CONTENTS)}")


@dataclass
class TorchMemoryToolConfig:
    trace_alloc_max_entries: int | None = opt(None, "torch_memory: allocation events kept (the last ones); null: "
                                                    "global_profiler.global_tool_config.torch_memory's", ge=1)
    stack_depth: int | None = opt(None, "torch_memory: accepted for verl compatibility; torch's "
                                        "_record_memory_history takes no stack depth (it keeps whole stacks), as in "
                                        "verl it has no effect; null: the global one", ge=1)


@dataclass
class NPUToolConfig:
    contents: list[str] = opt(default_factory=list, help="Ascend NPU profiler (tool=npu, which meshppo refuses): "
                                                         "no effect")
    level: str = opt("level0", "NPU profiler level: no effect", choices=("level_none", "level0", "level1", "level2"))
    analysis: bool = opt(True, "NPU profiler analysis: no effect")
    discrete: bool = opt(False, "NPU profiler discrete mode: no effect")


@dataclass
class ProfilerToolConfigs:
    nsys: NsysToolConfig = section(NsysToolConfig, "Nsight Systems")
    npu: NPUToolConfig = section(NPUToolConfig, "Ascend NPU (refused)")
    torch: TorchProfilerToolConfig = section(TorchProfilerToolConfig, "torch.profiler")
    torch_memory: TorchMemoryToolConfig = section(TorchMemoryToolConfig, "CUDA memory history")


@dataclass
class RoleProfilerConfig:
    """verl's per-role `profiler`. meshppo runs every role in one process per rank, so one profiler
    serves them all: a rank is profiled when any enabled role (of those the run has) selects it,
    and the enabled roles must agree on the tool, save_path and the tool's settings
    (`trainer.profiling`)."""

    tool: str | None = opt(None, "the profiler of this role; null: global_profiler.tool. One profiler serves "
                                 "every role of a rank: the enabled roles must name the same tool",
                           choices=(*PROFILER_TOOLS, None))
    enable: bool = opt(False, "profile this role at global_profiler.steps")
    all_ranks: bool = opt(False, "profile every rank")
    ranks: list[int] = opt(default_factory=list, help="the ranks to profile (empty, without all_ranks: rank 0)",
                           ge=0)
    save_path: str | None = opt(None, "where the profiles go; null: global_profiler.save_path")
    tool_config: ProfilerToolConfigs = section(ProfilerToolConfigs, "each tool's settings")


@dataclass
class SharedProfilerConfig:
    """verl's `profiler` of a role that takes the actor's tool settings (`tool_config`, as in verl)."""

    tool: str | None = opt(None, "the profiler of this role; null: global_profiler.tool",
                           choices=(*PROFILER_TOOLS, None))
    enable: bool | None = opt(None, "profile this role at global_profiler.steps; null: rollout: the actor's, "
                                    "reward_model: false")
    all_ranks: bool | None = opt(None, "profile every rank; null: rollout: the actor's, reward_model: false")
    ranks: list[int] | None = opt(None, "the ranks to profile (empty, without all_ranks: rank 0); null: rollout: "
                                        "the actor's, reward_model: []", ge=0)
    save_path: str | None = opt(None, "where the profiles go; null: global_profiler.save_path")
    tool_config: ProfilerToolConfigs | None = opt(None, "verl's copy of actor_rollout_ref.actor.profiler.tool_config "
                                                        "(which this role uses): null or the same")


@dataclass
class NsysGlobalConfig:
    discrete: bool = opt(False, "nsys: one capture range per phase instead of one per profiled step (the roles' "
                                "default)")
    controller_nsight_options: dict = opt(default_factory=lambda: {"trace": "cuda,nvtx,cublas,ucx",
                                                                   "cuda-memory-usage": "true",
                                                                   "cuda-graph-trace": "graph"},
                                          help="verl's nsys options for its Ray driver; no effect: meshppo does not "
                                               "launch nsys (pass the options to nsys profile yourself)")
    worker_nsight_options: dict = opt(default_factory=lambda: {"trace": "cuda,nvtx,cublas,ucx",
                                                               "cuda-memory-usage": "true",
                                                               "cuda-graph-trace": "graph",
                                                               "capture-range": "cudaProfilerApi",
                                                               "capture-range-end": None, "kill": "none"},
                                      help="verl's nsys options for its Ray workers; no effect: meshppo does not "
                                           "launch nsys (pass them to nsys profile yourself)")


@dataclass
class TorchMemoryGlobalConfig:
    trace_alloc_max_entries: int = opt(100000, "allocation events kept (the last ones): the roles' default", ge=1)
    stack_depth: int = opt(32, "accepted for verl compatibility; no effect (torch's _record_memory_history takes "
                               "no stack depth, it keeps whole stacks)", ge=1)
    context: str | None = opt("all", "_record_memory_history's context: which events carry a stack trace (state: "
                                     "allocations, alloc: and frees, all: both, null: none)",
                              choices=("state", "alloc", "all", None))
    stacks: str = opt("all", "_record_memory_history's stacks: python, or all (python and C++)",
                      choices=("python", "all"))
    kw_args: dict = opt(default_factory=dict, help="further keyword arguments of "
                                                   "torch.cuda.memory._record_memory_history")

    def __post_init__(self):
        taken = sorted(set(self.kw_args) & {"enabled", "max_entries", "context", "stacks"})
        if taken:
            raise ValueError(f"kw_args sets {', '.join(taken)}: the profiler passes them itself "
                             "(trace_alloc_max_entries, context, stacks)")


@dataclass
class GlobalToolConfigs:
    nsys: NsysGlobalConfig = section(NsysGlobalConfig, "Nsight Systems")
    torch_memory: TorchMemoryGlobalConfig = section(TorchMemoryGlobalConfig, "CUDA memory history")


@dataclass
class GlobalProfilerConfig:
    """verl's `global_profiler`: which tool profiles which steps (the roles' `profiler.enable` pick
    the ranks). Each profiled step's phases (generation to the updates; not validation or
    checkpointing) are captured on the profiled ranks (`trainer.profiling`)."""

    tool: str | None = opt(None, "torch: a torch.profiler chrome trace, SAVE/step{N}/prof_rank-{R}.json.gz "
                                 "(discrete: one per phase, {phase}_prof_rank-{R}.json.gz); torch_memory (CUDA): "
                                 "the allocator's history recorded over the step (verl records from start-up), "
                                 "SAVE/step{N}/torch_memory_rank{R}.pickle "
                                 "(for pytorch.org/memory_viz); nsys (CUDA): cudaProfilerStart/Stop around the "
                                 "steps and NVTX ranges phase:<name>, for nsys profile --capture-range="
                                 "cudaProfilerApi --capture-range-end=repeat torchrun ... train_ppo.py ...; npu: "
                                 "not supported; null: off", choices=(*PROFILER_TOOLS, None))
    steps: list[int] | None = opt(None, "the global steps (from 1) to profile; null or empty: none, as in verl",
                                  ge=1)
    profile_continuous_steps: bool = opt(False, "consecutive listed steps share one trace / snapshot / capture "
                                                "range (named after the first, step{A}-{B}) instead of one each")
    save_path: str = opt("outputs/profile", "directory of the profiles (relative: to the working directory)")
    global_tool_config: GlobalToolConfigs = section(GlobalToolConfigs, "the tools' run-wide settings")
