"""verl's profiler options (`global_profiler`, the roles' `profiler`) for meshppo's one process per rank.

verl profiles each Ray worker (actor/rollout, ref, critic, reward model) with its own profiler at
the global steps listed in `global_profiler.steps`. meshppo runs every role in one process per
rank, so one profiler per rank serves them all:

- the ranks profiled are the union of those the enabled roles (of the roles the run has) select:
  `all_ranks`, `ranks`, or rank 0 where neither is set (verl's default);
- the tool, `save_path` and the tool's settings are the enabled roles' (null: the global ones),
  which must agree, else a ConfigError;
- torch `contents` are the union of the enabled roles' (the rollout and the reward model take the
  actor's `tool_config`, as in verl).

Each profiled step is captured from its first phase to its last (`PPOTrainer.step`: generation
to the updates; validation and checkpointing are not in it); the phases are the trainer's
`Timer` ranges (`phase:<name>`, `trainer.tracking`). Files go to `save_path/step{N}/` (a
continuous range of steps: `step{A}-{B}/`), named with the rank:

- torch: `prof_rank-{R}.json.gz` (a gzipped chrome trace, as verl's); discrete: one trace per
  outermost phase of the step, `{phase}_prof_rank-{R}.json.gz` (a repeated phase: `{phase}-2_...`);
- torch_memory: `torch_memory_rank{R}.pickle`, the CUDA allocator's history recorded over the
  step (`torch.cuda.memory._dump_snapshot`, for https://pytorch.org/memory_viz);
- nsys: nothing here; `torch.cuda.profiler.start()/stop()` bound each step (discrete: each
  phase) and NVTX ranges `phase:<name>` mark the phases, for `nsys profile
  --capture-range=cudaProfilerApi --capture-range-end=repeat torchrun ... train_ppo.py ...`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from trainer.configlib import ConfigError, given_option, shown

SHARED_TOOL_CONFIG = "actor_rollout_ref.actor.profiler.tool_config"


def _roles(cfg) -> list[tuple[str, object, object]]:
    """`(key, profiler section, its tool_config)` of each role the run has."""
    arr = cfg.actor_rollout_ref
    actor_tc = arr.actor.profiler.tool_config
    roles = [("actor_rollout_ref.actor", arr.actor.profiler, actor_tc),
             ("actor_rollout_ref.rollout", arr.rollout.profiler, actor_tc)]
    if cfg.uses_ref:
        roles.append(("actor_rollout_ref.ref", arr.ref.profiler, arr.ref.profiler.tool_config))
    if cfg.uses_critic:
        roles.append(("critic", cfg.critic.profiler, cfg.critic.profiler.tool_config))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.profiler, actor_tc))
    return roles


# Where a role's profiler option comes from when the user leaves it null (`PPOConfig.resolve`): the key it
# inherits, by the option's key relative to the role's `profiler` (the rollout's selection is the actor's).
_GLOBAL_SOURCES = {"tool": "global_profiler.tool", "save_path": "global_profiler.save_path",
                   "tool_config.nsys.discrete": "global_profiler.global_tool_config.nsys.discrete",
                   "tool_config.torch_memory.trace_alloc_max_entries":
                       "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries",
                   "tool_config.torch_memory.stack_depth": "global_profiler.global_tool_config.torch_memory.stack_depth"}


def _source(role_key: str, rel: str) -> str | None:
    """The key option `rel` of role `role_key`'s profiler inherits where null, None where it inherits none."""
    if role_key == "actor_rollout_ref.rollout" and rel in ("enable", "all_ranks", "ranks"):
        return f"actor_rollout_ref.actor.profiler.{rel}"
    return _GLOBAL_SOURCES.get(rel)


def _lookup(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def setting_key(cfg, role_key: str, rel: str) -> str:
    """The key that gives option `rel` of role `role_key`'s profiler (`rel` under its profiler; the
    rollout's and the reward model's tool_config: the actor's) its value: the role's own where its
    value differs from the one it would inherit, or where the user's config or command line set it and
    not the key it inherits from (`configlib.given_option`; verl's generated config writes the role's
    as an interpolation of the global one: both set); else that key (global_profiler's; the rollout's
    selection: the actor's)."""
    own = (f"{SHARED_TOOL_CONFIG}{rel[len('tool_config'):]}"
           if rel.startswith("tool_config.") and role_key in ("actor_rollout_ref.rollout", "reward_model")
           else f"{role_key}.profiler.{rel}")
    source = _source(role_key, rel)
    if source is None:
        return own
    if _lookup(cfg, own) != _lookup(cfg, source):
        return own
    return own if given_option(cfg, own)[0] and not given_option(cfg, source)[0] else source


def _agreed(values: dict[str, object], what: str):
    """The one value the enabled roles give `what` (keyed by the option that sets it)."""
    distinct = {repr(v) for v in values.values()}
    if len(distinct) > 1:
        listed = ", ".join(f"{k}={shown(v)}" for k, v in values.items())
        raise ConfigError(f"{listed}: meshppo profiles every role in one process per rank, so the enabled roles "
                          f"need one {what}")
    return next(iter(values.values()))


@dataclass(frozen=True)
class ProfilePlan:
    """What every rank's `StepProfiler` does: the tool, the steps, which ranks, where, how."""

    tool: str
    steps: frozenset[int]
    continuous: bool
    all_ranks: bool
    ranks: frozenset[int]
    save_path: str
    discrete: bool = False                 # torch, nsys
    contents: frozenset[str] = frozenset()  # torch
    max_entries: int = 100000              # torch_memory
    context: str | None = "all"
    stacks: str = "all"
    kw_args: tuple = ()

    def profiles(self, rank: int) -> bool:
        return self.all_ranks or rank in self.ranks


def profile_plan(cfg) -> ProfilePlan | None:
    """The run's profiling from its config, None when nothing is profiled (no enabled role with a
    tool, or no step listed: verl's behaviour). Raises ConfigError for npu and for enabled roles
    that disagree."""
    gp = cfg.global_profiler
    for key, prof, _ in [("global_profiler", gp, None)] + _roles(cfg):
        if prof.tool == "npu" and (prof is gp or prof.enable):
            raise ConfigError(f"{key}.tool=npu is not supported: meshppo runs on CUDA or CPU (Ascend's profiler is "
                              "not available); use torch, torch_memory or nsys")
    enabled = [(key, prof, tc) for key, prof, tc in _roles(cfg) if prof.enable and prof.tool is not None]
    if not enabled or not gp.steps:
        return None
    tool = _agreed({setting_key(cfg, k, "tool"): p.tool for k, p, _ in enabled}, "tool")
    save_path = _agreed({setting_key(cfg, k, "save_path"): p.save_path for k, p, _ in enabled}, "save_path")
    ranks = frozenset(r for _, p, _ in enabled for r in (p.ranks or ([] if p.all_ranks else [0])))
    common = dict(tool=tool, steps=frozenset(gp.steps), continuous=gp.profile_continuous_steps,
                  all_ranks=any(p.all_ranks for _, p, _ in enabled), ranks=ranks, save_path=save_path)
    tcs = {_tool_config_key(k): (k, tc) for k, _, tc in enabled}
    if tool == "torch":
        discrete = _agreed({f"{k}.torch.discrete": tc.torch.discrete for k, (_, tc) in tcs.items()},
                           "torch discrete mode")
        return ProfilePlan(**common, discrete=discrete, contents=frozenset(
            c for _, tc in tcs.values() for c in (tc.torch.contents or ["cpu", "cuda"])))
    if tool == "nsys":
        discrete = _agreed({setting_key(cfg, role, "tool_config.nsys.discrete"): tc.nsys.discrete
                            for role, tc in tcs.values()}, "nsys discrete mode")
        return ProfilePlan(**common, discrete=discrete)
    mem = gp.global_tool_config.torch_memory
    max_entries = _agreed({setting_key(cfg, role, "tool_config.torch_memory.trace_alloc_max_entries"):
                           tc.torch_memory.trace_alloc_max_entries for role, tc in tcs.values()},
                          "torch_memory trace_alloc_max_entries")
    return ProfilePlan(**common, max_entries=max_entries, context=mem.context, stacks=mem.stacks,
                       kw_args=tuple(sorted(mem.kw_args.items())))


def unreached_steps_note(plan: ProfilePlan | None, last_step: int, why: str = "") -> str | None:
    """The note for listed steps after the run's last one (`why`: where that step count comes from),
    None when there are none: they are never profiled."""
    beyond = sorted(s for s in plan.steps if s > last_step) if plan is not None else []
    if not beyond:
        return None
    return (f"global_profiler.steps {', '.join(map(str, beyond))} {'are' if len(beyond) > 1 else 'is'} after the "
            f"run's last step ({last_step}{why}): not profiled")


def last_step_note(cfg, last_step: int) -> str | None:
    """The trainer's line, once it knows the run's last step, for listed steps after it; None
    where trainer.total_training_steps sets it (a start-up note then, `profiling_notes`)."""
    if cfg.trainer.total_training_steps:
        return None
    return unreached_steps_note(profile_plan(cfg), last_step, ": the training set's rounds x trainer.total_epochs")


def check_profiler_ranks(cfg, world_size: int) -> None:
    """An enabled role's `profiler.ranks` all below the launch's size (`trainer.nnodes` x
    `trainer.n_gpus_per_node`) when something is profiled (a profile plan: steps and a tool): a rank
    that does not exist would profile nothing, without a word. Without a plan nothing is profiled
    anyway (a start-up note says so)."""
    if profile_plan(cfg) is None:
        return
    for key, prof, _ in _roles(cfg):
        missing = sorted(r for r in prof.ranks or [] if r >= world_size)
        if prof.enable and missing and not prof.all_ranks:
            t = cfg.trainer
            raise ConfigError(f"{key}.profiler.ranks={shown(prof.ranks)}: rank{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} do{'' if len(missing) > 1 else 'es'} not exist, the "
                              f"launch has {world_size} (trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes} x "
                              f"{t.n_gpus_per_node}): list ranks 0 to {world_size - 1}")


def save_path_key(cfg) -> str | None:
    """The option that sets the run's profile directory (`ProfilePlan.save_path`), None when nothing
    is profiled: global_profiler.save_path, or the enabled role's own where it set another."""
    plan = profile_plan(cfg)
    if plan is None:
        return None
    own = [k for k, p, _ in _roles(cfg)
           if p.enable and p.tool is not None and p.save_path != cfg.global_profiler.save_path]
    return f"{own[0]}.profiler.save_path" if own else "global_profiler.save_path"


def _tool_config_key(role_key: str) -> str:
    return SHARED_TOOL_CONFIG if role_key in ("actor_rollout_ref.rollout", "reward_model") else \
        f"{role_key}.profiler.tool_config"


def _keys_set(cfg, role_keys: list[str], rel: str) -> str:
    """The keys that set option `rel` of the profilers of roles `role_keys` (`setting_key`), each once."""
    return ", ".join(dict.fromkeys(setting_key(cfg, k, rel) for k in role_keys))


def profiling_notes(cfg) -> list[str]:
    """Start-up notes: profiler settings that profile nothing or have no effect."""
    gp, notes = cfg.global_profiler, []
    roles = _roles(cfg)
    enabled = [k for k, p, _ in roles if p.enable and p.tool is not None]
    tool = gp.tool or next((p.tool for _, p, _ in roles if p.enable and p.tool), None)
    if tool == "torch_memory" and not enabled:  # verl dumps a snapshot after every step, enabled or not
        notes.append("global_profiler.tool=torch_memory: no role's profiler.enable is true, so nothing is recorded "
                     "(verl dumps the actor's memory snapshot after every step whatever enable says; meshppo records "
                     "the steps listed in global_profiler.steps for the roles enabled: set e.g. "
                     "actor_rollout_ref.actor.profiler.enable=true)")
    elif tool is not None and not enabled:
        notes.append(f"global_profiler.tool={tool}: no role's profiler.enable is true, nothing is profiled (as in "
                     "verl: set e.g. actor_rollout_ref.actor.profiler.enable=true)")
    elif enabled and not gp.steps:
        notes.append(f"{_keys_set(cfg, enabled, 'enable')}: global_profiler.steps is "
                     f"{shown(gp.steps)}, nothing is profiled (as in verl: list the "
                     "steps)")
    untooled = [(k, p) for k, p, _ in roles if p.enable and p.tool is None]
    if gp.steps and tool is None and not untooled:
        tooled = {setting_key(cfg, k, "tool"): p.tool for k, p, _ in roles if p.tool is not None}
        why = (f"no role's profiler.enable is true ({', '.join(f'{k}={shown(v)}' for k, v in tooled.items())} names a tool "
               "for a role not enabled)" if tooled else
               "no profiler tool is set (global_profiler.tool) and no role's profiler.enable is true")
        notes.append(f"global_profiler.steps={shown(gp.steps)} has no effect: {why}: nothing is profiled")
    if untooled and not enabled:
        notes.append(f"{_keys_set(cfg, [k for k, _ in untooled], 'enable')}=true but no tool is set "
                     "(global_profiler.tool): nothing is profiled")
    plan = profile_plan(cfg)
    for key, prof in untooled if plan is not None and not plan.all_ranks else []:
        # the roles with a tool profile the whole step on their ranks: this one only adds ranks
        extra = sorted(set(prof.ranks or [0]) - plan.ranks)
        missing = "every rank" if prof.all_ranks else ", ".join(map(str, extra))
        if missing:
            notes.append(f"{setting_key(cfg, key, 'enable')}=true but no tool is set ({key}.profiler.tool, "
                         f"global_profiler.tool): its ranks are not profiled ({missing}; the profiled ranks are "
                         f"{', '.join(map(str, sorted(plan.ranks)))})")
    present = {k for k, _, _ in roles}
    for key, prof in (("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.profiler), ("critic", cfg.critic.profiler),
                      ("reward_model", cfg.reward_model.profiler)):
        if prof.enable and key not in present:
            notes.append(f"{key}.profiler.enable=true has no effect: the run has no {key.rsplit('.', 1)[-1]}")
    total = cfg.trainer.total_training_steps  # null: the trainer says it, once it knows the last step
    note = unreached_steps_note(plan, total, ", trainer.total_training_steps") if total else None
    if note:
        notes.append(note)
    profiled = {_tool_config_key(k): (k, tc) for k, p, tc in roles if p.enable and p.tool is not None}
    if plan is not None and plan.tool == "torch":
        for key, (_, tc) in profiled.items():
            unread = [c for c in tc.torch.contents if c in ("profile-by-stage", "merge-profiles")]
            if unread:
                one = len(unread) == 1
                notes.append(f"{key}.torch.contents {', '.join(unread)} ha{'s' if one else 've'} no effect: "
                             f"{'it is' if one else 'they are'} verl's sglang server's, meshppo generates in-process")
    if plan is not None and plan.discrete and plan.continuous:
        keys = ([f"{key}.torch.discrete" for key in profiled] if plan.tool == "torch" else
                list(dict.fromkeys(setting_key(cfg, k, "tool_config.nsys.discrete") for k, _ in profiled.values())))
        notes.append(f"global_profiler.profile_continuous_steps=true has no effect with {', '.join(keys)}=true: "
                     "each phase has its own " + ("trace" if plan.tool == "torch" else "capture range"))
    depths = {"global_profiler.global_tool_config.torch_memory.stack_depth":
              gp.global_tool_config.torch_memory.stack_depth}
    depths = {k: v for k, v in depths.items() if v != 32}  # (verl's default)
    for role, _, tc in roles:  # a role's own, not the global one it inherits
        key = setting_key(cfg, role, "tool_config.torch_memory.stack_depth")
        if not key.startswith("global_profiler."):
            depths[key] = tc.torch_memory.stack_depth
    if depths:
        notes.append(f"{', '.join(f'{k}={shown(v)}' for k, v in depths.items())} has no effect: torch's "
                     "_record_memory_history takes no stack depth (it keeps whole stacks; verl passes it only where "
                     "torch takes it)")
    npu = [f"{k}.profiler.tool_config.npu" for k, p in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.profiler),
                                                       ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.profiler),
                                                       ("critic", cfg.critic.profiler))
           if p.tool_config.npu != type(p.tool_config.npu)()]
    if npu:
        notes.append(f"{', '.join(npu)} have no effect: tool=npu is not supported")
    nsys = gp.global_tool_config.nsys
    defaults = type(nsys)()
    for name in ("controller_nsight_options", "worker_nsight_options"):
        if getattr(nsys, name) != getattr(defaults, name):
            notes.append(f"global_profiler.global_tool_config.nsys.{name} has no effect: meshppo does not launch "
                         "nsys; pass the options to nsys profile")
    return notes


class StepProfiler:
    """This rank's profiler: `with profiler.step(n):` around a step, `with profiler.phase(name):`
    around each of its phases (the trainer's `Timer` calls it), `close()` at the end of the run."""

    def __init__(self, plan: ProfilePlan | None, rank: int, device: torch.device, last_step: int,
                 log=print):
        if plan is not None and plan.tool in ("nsys", "torch_memory") and device.type != "cuda":
            raise ConfigError(f"global_profiler.tool={plan.tool} needs CUDA, and this run is on {device.type} "
                              "(trainer.device); use tool=torch")
        if (plan is not None and plan.tool == "torch" and device.type != "cuda" and "cuda" in plan.contents
                and "cpu" not in plan.contents):
            raise ConfigError(f"the torch profiler's contents {shown(sorted(plan.contents))} ask for CUDA activity only, and "
                              f"this run is on {device.type}: add cpu, or leave contents empty")
        self.plan = plan if plan is not None and plan.profiles(rank) else None
        self.rank, self.device, self.last_step, self.log = rank, device, last_step, log
        self._dir: str | None = None     # the open capture's directory (step{N} or step{A}-{B})
        self._trace = None               # the open torch.profiler.profile
        self._phase_trace: str | None = None  # discrete: the phase whose trace is open
        self._phase_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ steps
    @contextmanager
    def step(self, step: int):
        plan = self.plan
        if plan is None or step not in plan.steps:
            yield
            return
        continuous = plan.continuous and not plan.discrete
        if self._dir is None:
            last = step
            while continuous and last + 1 in plan.steps and last + 1 <= self.last_step:
                last += 1
            self._dir = os.path.join(plan.save_path, f"step{step}" if last == step else f"step{step}-{last}")
            self._phase_counts = {}
            self._start()
        ok = False
        try:
            yield
            ok = True
        finally:
            # continuous: the capture goes on into the next listed step, unless this one failed
            if not (ok and continuous and step + 1 in plan.steps and step + 1 <= self.last_step):
                self.close()

    def close(self) -> None:
        """End the open capture, writing its files (the end of a continuous range, or of the run)."""
        if self._dir is None:
            return
        try:
            self._stop()
        finally:
            self._dir = None

    def _start(self) -> None:
        tool = self.plan.tool
        if tool == "torch_memory":
            torch.cuda.memory._record_memory_history(max_entries=self.plan.max_entries, context=self.plan.context,
                                                     stacks=self.plan.stacks, **dict(self.plan.kw_args))
        elif tool == "nsys" and not self.plan.discrete:
            torch.cuda.profiler.start()
        elif tool == "torch" and not self.plan.discrete:
            self._trace = self._torch_profile()
            self._trace.start()

    def _stop(self) -> None:
        tool = self.plan.tool
        if tool == "torch_memory":
            torch.cuda.synchronize(self.device)
            path = self._path(f"torch_memory_rank{self.rank}.pickle")
            try:
                torch.cuda.memory._dump_snapshot(path)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            self.log(f"[profiler] CUDA memory snapshot: {path}")
        elif tool == "nsys" and not self.plan.discrete:
            torch.cuda.profiler.stop()
        elif self._trace is not None:
            self._export(self._trace, "")

    # ----------------------------------------------------------------- phases
    def phase(self, name: str):
        """The capture of one phase: an NVTX range (nsys), a trace or capture range of its own
        (discrete mode, the outermost phases of the step but the step itself); else nothing."""
        if self._dir is None or self.plan.tool == "torch_memory" or (self.plan.tool == "torch"
                                                                     and not self.plan.discrete):
            return nullcontext()
        return self._phase(name)

    @contextmanager
    def _phase(self, name: str):
        plan = self.plan
        own = plan.discrete and name != "step" and self._phase_trace is None
        if own:
            self._phase_trace = name
            if plan.tool == "torch":
                self._trace = self._torch_profile()
                self._trace.start()
            else:
                torch.cuda.profiler.start()
        if plan.tool == "nsys":
            torch.cuda.nvtx.range_push(f"phase:{name}")
        try:
            yield
        finally:
            if plan.tool == "nsys":
                torch.cuda.nvtx.range_pop()
            if own:
                self._phase_trace = None
                if plan.tool == "torch":
                    n = self._phase_counts[name] = self._phase_counts.get(name, 0) + 1
                    self._export(self._trace, f"{name}_" if n == 1 else f"{name}-{n}_")
                else:
                    torch.cuda.profiler.stop()

    # ------------------------------------------------------------------ torch
    def _torch_profile(self) -> torch.profiler.profile:
        contents = self.plan.contents
        activities = [torch.profiler.ProfilerActivity.CPU] if "cpu" in contents else []
        if "cuda" in contents and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # none (contents such as [memory], as in verl): torch's default, every activity the machine has
        return torch.profiler.profile(activities=activities, record_shapes="shapes" in contents,
                                      profile_memory="memory" in contents, with_stack="stack" in contents)

    def _export(self, trace: torch.profiler.profile, prefix: str) -> None:
        trace.stop()
        self._trace = None
        path = self._path(f"{prefix}prof_rank-{self.rank}.json.gz")
        trace.export_chrome_trace(path)
        self.log(f"[profiler] trace: {path}")

    def _path(self, name: str) -> str:
        os.makedirs(self._dir, exist_ok=True)
        return os.path.join(self._dir, name)
