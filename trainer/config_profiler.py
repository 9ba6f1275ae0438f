"""verl's profiler options (`global_profiler` and each role's `profiler`), as config sections;
`trainer.profiling` turns them into what every rank profiles."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configlib import opt, other_than, section


PROFILER_TOOLS = ("nsys", "npu", "torch", "torch_memory")
TORCH_PROFILER_CONTENTS = ("cuda", "cpu", "memory", "shapes", "stack", "profile-by-stage", "merge-profiles")


@dataclass
class NsysToolConfig:
    discrete: bool | None = opt(None, "nsys: one capture range per phase of the step (gen, old_log_prob, "
                                      "update_actor, ...) instead of one per profiled step; null: "
                                      "global_profiler.global_tool_config.nsys.discrete")


_SCHEDULE_WHY = "read only with schedule.active > 0, which meshppo does not support"


@dataclass
class TorchScheduleConfig:
    """verl 0.9.1's `torch.schedule`: torch.profiler's schedule over the update's mini-batches."""

    skip_first: int = opt(0, "verl: mini-batches skipped first", ge=0, no_effect=_SCHEDULE_WHY)
    wait: int = opt(0, "verl: mini-batches idle a cycle", ge=0, no_effect=_SCHEDULE_WHY)
    warmup: int = opt(0, "verl: mini-batches warming up a cycle", ge=0, no_effect=_SCHEDULE_WHY)
    active: int = opt(0, "0 only: the whole step is recorded (verl: record only this many update mini-batches a "
                         "cycle)", ge=0, unsupported=bool)
    repeat: int = opt(0, "verl: the cycles", ge=0, no_effect=_SCHEDULE_WHY)


def _token_window(tool: str, unsupported: bool):
    """verl 0.9.1's `profile_token_start` / `_end` of its rollout's trace (from / to a response token)."""
    if unsupported:
        return opt(None, f"not supported: must be null (verl: {tool}'s rollout trace from / to a response-token "
                         "index; meshppo's covers the whole generation)", ge=0, unsupported=lambda v: v is not None)
    return opt(None, f"verl: {tool}'s rollout trace from / to a response-token index: no effect", ge=0)


@dataclass
class TorchProfilerToolConfig:
    contents: list[str] = opt(default_factory=list, help="torch: what the trace records: cpu, cuda (the "
                                                         "activities; none named: both), memory (allocations), "
                                                         "shapes (input shapes), stack (Python stacks); "
                                                         "profile-by-stage and merge-profiles are verl's sglang "
                                                         "server's and have no effect")
    discrete: bool = opt(False, "torch: one trace per phase of the step (gen, old_log_prob, update_actor, ...) "
                                "instead of one per profiled step")
    schedule: TorchScheduleConfig = section(TorchScheduleConfig, "verl: torch.profiler's schedule")
    profile_token_start: int | None = _token_window("torch", True)
    profile_token_end: int | None = _token_window("torch", True)

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
    memory_snapshot_num_steps: int | None = opt(None, "torch_memory: 1 only, a snapshot of each profiled step (or "
                                                      "range of profile_continuous_steps); verl: of every this many "
                                                      "profiled steps; null: the global one", ge=1,
                                                unsupported=other_than(1))


@dataclass
class NPUToolConfig:
    contents: list[str] = opt(default_factory=list, help="Ascend NPU profiler (tool=npu, which meshppo refuses): "
                                                         "no effect")
    level: str = opt("level0", "NPU profiler level: no effect", choices=("level_none", "level0", "level1", "level2"))
    analysis: bool = opt(True, "NPU profiler analysis: no effect")
    discrete: bool = opt(False, "NPU profiler discrete mode: no effect")
    profile_token_start: int | None = _token_window("the NPU profiler", False)
    profile_token_end: int | None = _token_window("the NPU profiler", False)


_PRECISION_WHY = "read only with precision_debugger.config_path, which meshppo does not support"


@dataclass
class PrecisionDebuggerConfig:
    """verl 0.9.1's `precision_debugger`: msprobe's precision dumps of chosen stages."""

    config_path: str | None = opt(None, "not supported: must be null (verl: msprobe's precision-debugging config)",
                                  unsupported=lambda v: v is not None)
    steps: list[int] | None = opt(None, "verl: deprecated, the steps (global_profiler.steps decide)",
                                  no_effect=_PRECISION_WHY)
    stages: list[str] | None = opt(None, "verl: the stages dumped", no_effect=_PRECISION_WHY)
    strict: bool = opt(False, "verl: fail where a dump fails", no_effect=_PRECISION_WHY)


@dataclass
class ProfilerToolConfigs:
    nsys: NsysToolConfig = section(NsysToolConfig, "Nsight Systems")
    npu: NPUToolConfig = section(NPUToolConfig, "Ascend NPU (refused)")
    torch: TorchProfilerToolConfig = section(TorchProfilerToolConfig, "torch.profiler")
    torch_memory: TorchMemoryToolConfig = section(TorchMemoryToolConfig, "CUDA memory history")
    precision_debugger: PrecisionDebuggerConfig = section(PrecisionDebuggerConfig, "verl: msprobe's precision dumps")


_HOOK_WHY = "read only with finish_hook_cmd, which meshppo does not support"
_RELOCATE_WHY = ("meshppo writes its traces and snapshots into save_path itself; an nsys report goes where "
                 "nsys profile -o puts it")
_ROLE_COPY = "; null: global_profiler's (the rollout's: the actor's), as verl's interpolations copy it"


def _relocate_results(role: bool):
    help_ = "verl: move the profiles a framework writes elsewhere (Ray's nsys reports) into save_path"
    return opt(None, help_ + _ROLE_COPY, no_effect=_RELOCATE_WHY) if role else opt(False, help_,
                                                                                    no_effect=_RELOCATE_WHY)


def _finish_hook_cmd():
    return opt(None, "not supported: must be null (verl: a shell command run once after the last profiled step, "
                     "e.g. to upload the profiles)", unsupported=lambda v: v is not None)


def _finish_hook_all_ranks(role: bool):
    help_ = "verl: run finish_hook_cmd on every rank"
    return opt(None, help_ + _ROLE_COPY, no_effect=_HOOK_WHY) if role else opt(False, help_, no_effect=_HOOK_WHY)


def _finish_hook_ranks(role: bool):
    help_ = "verl: the ranks that run finish_hook_cmd"
    if role:
        return opt(None, help_ + _ROLE_COPY, no_effect=_HOOK_WHY)
    return opt(default_factory=list, help=help_, no_effect=_HOOK_WHY)


FINISH_HOOK_OPTIONS = ("relocate_results", "finish_hook_cmd", "finish_hook_all_ranks", "finish_hook_ranks")
"""verl 0.9.1's finish-hook options, the global profiler's and each role's copy of them."""


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
    save_path: str | None = opt(None, "where the profiles go; null: global_profiler.save_path", path=True)
    tool_config: ProfilerToolConfigs = section(ProfilerToolConfigs, "each tool's settings")
    relocate_results: bool | None = _relocate_results(role=True)
    finish_hook_cmd: str | None = _finish_hook_cmd()
    finish_hook_all_ranks: bool | None = _finish_hook_all_ranks(role=True)
    finish_hook_ranks: list[int] | None = _finish_hook_ranks(role=True)


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
    save_path: str | None = opt(None, "where the profiles go; null: global_profiler.save_path", path=True)
    tool_config: ProfilerToolConfigs | None = opt(None, "verl's copy of actor_rollout_ref.actor.profiler.tool_config "
                                                        "(which this role uses): null, or each option it sets the "
                                                        "same (verl 0.9.1's rollout sets its own token window, "
                                                        "refused unless null)")
    relocate_results: bool | None = _relocate_results(role=True)
    finish_hook_cmd: str | None = _finish_hook_cmd()
    finish_hook_all_ranks: bool | None = _finish_hook_all_ranks(role=True)
    finish_hook_ranks: list[int] | None = _finish_hook_ranks(role=True)


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
    memory_snapshot_num_steps: int = opt(1, "1 only: a snapshot of each profiled step (or range of "
                                            "profile_continuous_steps); verl: of every this many profiled steps "
                                            "(the roles' default)", ge=1, unsupported=other_than(1))
    context: str | None = opt("all", "_record_memory_history's context: which stack traces are kept (state: those of "
                                     "the memory still allocated; alloc: also those of the history's allocation "
                                     "events; all: also those of its frees; null: none)",
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
    precision_debugger: PrecisionDebuggerConfig = section(PrecisionDebuggerConfig, "verl: msprobe's precision dumps "
                                                                                   "(the roles' default)")


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
    save_path: str = opt("outputs/profile", "directory of the profiles (relative: to the working directory)",
                          path=True)
    relocate_results: bool = _relocate_results(role=False)
    finish_hook_cmd: str | None = _finish_hook_cmd()
    finish_hook_all_ranks: bool = _finish_hook_all_ranks(role=False)
    finish_hook_ranks: list[int] = _finish_hook_ranks(role=False)
    global_tool_config: GlobalToolConfigs = section(GlobalToolConfigs, "the tools' run-wide settings")
