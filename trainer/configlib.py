"""Typed, strictly checked configuration from YAML and dotted `key=value` overrides.

Config sections are dataclasses whose fields carry a one-line help string (`opt(...)`).
`load_config` merges a YAML file with command-line overrides and builds the dataclass tree,
rejecting unknown keys (naming the closest valid one), values of the wrong type, values
outside a field's `choices` or range (`ge`/`gt`/`le`/`lt`, for lists: of every item), and
options that verl has but meshppo does not support. A path option's (`opt(path=True)`) leading
`~` or `~user` is read as that home directory once, here (`expand_home`), so the resolved config,
`--print-config` and the run's recorded config hold the expanded path.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import fnmatch
import math
import numbers
import os
import re
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user error in the configuration: printed without a traceback, exit code 2."""


def opt(default=MISSING, help: str = "", choices=None, default_factory=MISSING, unsupported=None,
        ge=None, gt=None, le=None, lt=None, length=None, no_effect=None, path=False):
    """A config field with a one-line `help`, optional allowed `choices`, `unsupported`: a
    predicate on the value that marks verl settings meshppo does not implement, `no_effect`: why
    a verl setting changes nothing in meshppo (accepted at any value, said at start-up when not
    at its default: `trainer.config.config_notes`), and the allowed range of a number (of each
    item of a list): `ge` (>=), `gt` (>), `le` (<=), `lt` (<), plus a list's `length`. `null`
    is always allowed where the type allows it. `path`: the value (each item of a list) is a file
    or directory meshppo reads or writes, whose leading `~` is the home directory (`expand_home`)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"help": help, "choices": tuple(choices) if choices else None, "unsupported": unsupported,
            "bounds": bounds, "length": length, "no_effect": no_effect, "path": path}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def other_than(value):
    """An `unsupported` predicate: any value but `value` (verl's default, the one meshppo takes)."""
    return lambda v: v != value


def section(cls, help: str = "", key: str | None = None):
    """A nested config section; `key`: its name in a config where the attribute must be named
    otherwise (`option_key`)."""
    return field(default_factory=cls, metadata={"help": help, "choices": None, "unsupported": None, "key": key})


def option_key(f) -> str:
    """A field's name in a config: its attribute's, or the `key` it was given (verl's name where the
    attribute's is taken, e.g. by a property). A config may also name it by the attribute (what
    `dataclasses.asdict` writes)."""
    return f.metadata.get("key") or f.name


def allowed_range(meta) -> str:
    """`bounds` as text: `> 0`, `>= -1`, `[0, 1]`, `(0, 1]`; `""` when unbounded."""
    b = meta.get("bounds") or {}
    low = ("[", b["ge"]) if "ge" in b else ("(", b["gt"]) if "gt" in b else None
    high = ("]", b["le"]) if "le" in b else (")", b["lt"]) if "lt" in b else None
    if low and high:
        return f"{low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return ""


def describe(meta) -> str:
    """A field's help line with why it has no effect and its allowed range, as `--print-config`
    and docs/CONFIG.md show it."""
    help_, why, rng = meta.get("help", ""), meta.get("no_effect"), allowed_range(meta)
    if why:
        help_ = f"{help_}; has no effect: {why}" if help_ else f"has no effect: {why}"
    return f"{help_}; allowed: {rng}" if rng else help_


MISSING_MARK = "???"  # OmegaConf's mandatory value

_IN_RANGE = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b,
             "lt": lambda v, b: v < b}


def _check_range(value, meta, key: str) -> None:
    length = meta.get("length")
    if length is not None and isinstance(value, list) and len(value) != length:
        raise ConfigError(f"{key}: expected a list of {length} values, got {value!r}")
    bounds = meta.get("bounds")
    if not bounds or value is None:
        return
    items = enumerate(value) if isinstance(value, list) else [(None, value)]
    for i, v in items:
        if not all(_IN_RANGE[op](v, b) for op, b in bounds.items()):
            where = key if i is None else f"{key}[{i}]"
            raise ConfigError(f"{where}: {v!r} is out of range; allowed: {allowed_range(meta)}")


def expand_home(value, key: str):
    """A path option's value with a leading `~` (`~/data`, `~`) or `~user` read as that home
    directory, as a shell reads a word's, which it does not for `key=~/x` (no variable name before
    the `=`). Each item of a list; other text as it is: relative and absolute paths, URIs
    (`hdfs://`, `file://`, `pkg://`), a `~` inside a path. Environment variables are the config's
    interpolation's (`${oc.env:HOME}`), not expanded here. A ConfigError names `key` where there is
    no such user or no home directory."""
    if isinstance(value, list):
        return [expand_home(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or not value.startswith("~"):
        return value
    user = value[1:].split("/", 1)[0]
    expanded = os.path.expanduser(value)
    if expanded.startswith("~") or not user and os.environ.get("HOME") == "":  # (expanduser: "/" for an empty HOME)
        what = f"there is no user {user!r} on this machine" if user else "this user has no home directory (HOME)"
        raise ConfigError(f"{key}={value!r}: ~ is read as the home directory, but {what}")
    return expanded


def _type_name(tp) -> str:
    """A field's type as the docs show it (a nested section: "section")."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if is_dataclass(tp):
        return "section"
    return (str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))).replace("typing.", "")


def _coerce(value, tp, key: str):
    if value == MISSING_MARK:  # where meshppo reads the value (an opaque section's, e.g. verl's reward-model server, is not)
        raise ConfigError(f"{key} is ??? (verl's mark of a value that must be given): set it")
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            if is_dataclass(a) and isinstance(value, dict):
                return build_dataclass(a, value, key)  # an optional section: its own errors, as they are
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0] + " (or null)")
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if is_dataclass(tp):
        if value is None and getattr(tp, "NULL_IS_DEFAULT", False):  # a section verl also takes as null
            return tp()
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (a config section), got {value!r}")
        return build_dataclass(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, int, float)) and item_tp is str:
            value = [value]  # `trainer.logger=console` is a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # text where a number is wanted (quoted, or `${oc.env:LR}`'s): a number where float() reads
            # one, as OmegaConf's typed float options (verl's dataclass configs) convert it
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _closest(key: str, candidates: list[str], nested: list[str] = ()) -> str:
    """The suggestion for an unknown `key`: an option of the same name one section down (verl's
    `reward_model.model.path` for `reward_model.path`), else the closest of `candidates`."""
    name = key.rsplit(".", 1)[-1]
    match = [k for k in nested if k.rsplit(".", 1)[-1] == name][:1] or difflib.get_close_matches(key, candidates, n=1,
                                                                                                    cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


# The keys only verl's Megatron configs have (verl 0.9.1's ppo_megatron_trainer, and its older layout's
# reward_model.megatron, load_weight and nccl_timeout): refused as Megatron's, where an unknown key's
# nearest name (`actor.megatron` -> `actor.qat`) would mislead. fnmatch patterns of the dotted key.
_MEGATRON_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
_MEGATRON_TRAINED_ROLES = ("actor_rollout_ref.actor", "critic")
_MEGATRON_OPTIMIZER_KEYS = ("min_lr", "lr_warmup_init", "lr_decay_steps", "lr_decay_style", "lr_wsd_decay_steps",
                            "lr_wsd_decay_style", "weight_decay_incr_style", "use_checkpoint_opt_param_scheduler",
                            "use_precision_aware_optimizer", "use_layer_wise_distributed_optimizer",
                            "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "muon_*")
MEGATRON_KEYS = (*(f"{role}.{key}" for role in _MEGATRON_ROLES for key in ("megatron", "load_weight")),
                 *(f"{role}.checkpoint.mbridge_config" for role in _MEGATRON_TRAINED_ROLES),
                 *(f"{role}.optim.{key}" for role in _MEGATRON_TRAINED_ROLES for key in _MEGATRON_OPTIMIZER_KEYS),
                 "critic.nccl_timeout", "reward_model.nccl_timeout")
VERL_MEGATRON_CONFIG = "ppo_megatron_trainer"


def megatron_refusal(what: str) -> ConfigError:
    """The error for `what`, a setting that only verl's Megatron engine has."""
    return ConfigError(f"{what} is not supported: meshppo has no Megatron engine (it trains with FSDP2: strategy "
                       "fsdp or fsdp2)")


def _first_key(key: str, value) -> str:
    """The first option `value` sets under `key`: `a.megatron.tensor_model_parallel_size` for `a.megatron`
    given as a mapping (the key the user wrote, not the section it falls in)."""
    while isinstance(value, dict) and value:
        name, value = next(iter(value.items()))
        key = f"{key}.{name}"
    return key


def build_dataclass(cls, data: dict, prefix: str = ""):
    """Build `cls` from a nested dict, checking every key and value."""
    hints = typing.get_type_hints(cls)
    by_key = {option_key(f): f for f in fields(cls) if f.init}
    by_attr = {f.name: f for f in by_key.values()}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key == "_target_" and isinstance(value, str) and value.startswith("verl."):
            continue  # the class Hydra builds this section of a verl config into: metadata, no option
        f = by_key.get(key) or by_attr.get(key)
        if f is None and any(fnmatch.fnmatchcase(full, pattern) for pattern in MEGATRON_KEYS):
            raise megatron_refusal(_first_key(full, value))
        if f is None:
            all_keys = [f"{prefix}.{k}" if prefix else k for k in by_key]
            nested = [f"{k}.{option_key(g)}" for k, f in zip(all_keys, by_key.values())
                      if is_dataclass(hints[f.name]) for g in fields(hints[f.name])]
            raise ConfigError(f"unknown config key {full!r}{_closest(full, all_keys, nested)}")
        if value == MISSING_MARK and f.metadata.get("no_effect") and _optional(hints[f.name]):
            value = None  # verl's "must be given" on an option meshppo never reads: not given
        coerced = _coerce(value, hints[f.name], full)
        if f.metadata.get("path"):
            coerced = expand_home(coerced, full)
        choices = f.metadata.get("choices")
        if choices and coerced not in choices:
            if f.name == "strategy" and coerced == "megatron":  # (verl's other training engine)
                raise megatron_refusal(f"{full}=megatron")
            raise ConfigError(f"{full}: {coerced!r} is not one of {list(choices)}")
        _check_range(coerced, f.metadata, full)
        unsupported = f.metadata.get("unsupported")
        if unsupported is not None and coerced is not None and unsupported(coerced):
            raise ConfigError(f"{full}={shown(coerced)} is not supported by meshppo{_refusal_reason(f.metadata)}")
        kwargs[f.name] = coerced
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def shown(value) -> str:
    """`value` as a dotted override writes it (`key=value` in a message), which `parse_override` reads
    back as `value`: true, false and null as YAML writes them (not Python's True, None), lists and
    mappings in YAML's flow style (`[model, extra]`, `{gpu_memory_utilization: 0.3, x: null}`), and
    text quoted only where YAML would read it otherwise (`'1'`, `'true'`, `'a, b'` in a list)."""
    text = yaml.dump(value, Dumper=_ShownDumper, default_flow_style=True, width=math.inf, allow_unicode=True,
                     sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").removesuffix("\n")


def _refusal_reason(metadata) -> str:
    """The tail of an unsupported value's refusal: what the option's help says it takes and why
    (`"not supported: must be false (...)"` reads `: must be false (...)`), '' where it says no more."""
    reason = (metadata.get("help") or "").strip()
    if reason.startswith("not supported"):
        reason = reason[len("not supported"):].lstrip(": ")
    return "" if not reason else f" {reason}" if reason.startswith("(") else f": {reason}"


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers as OmegaConf (verl) reads them: the one YAML reader of
    config files, overrides, and tool and interaction files. YAML 1.1 (PyYAML) reads a number with
    an exponent as text unless a dot comes before the `e` and a sign after it; OmegaConf reads
    `1e-2`, `1E5`, `-3e+2` and `1.5e3` as floats, as the values verl's scripts give learning rates."""


# Digits (an optional sign first; groups joined by single underscores), an optional fraction, then
# `e` or `E` and the exponent's digits, signed or not. Text that merely looks like this (`1e2x`)
# stays text; what YAML 1.1 already reads as a float or an integer matches its own rules first.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9]+(?:_[0-9]+)*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class ConfigDumper(yaml.SafeDumper):
    """PyYAML's safe dumper with `ConfigLoader`'s number rule, so that text it would read as a number
    (`'1e-3'` in a reward function's keyword arguments) is written quoted: a dumped config reads back
    as it was."""


for _yaml_class in (ConfigLoader, ConfigDumper):
    _yaml_class.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


class _ShownDumper(ConfigDumper):
    """`shown`'s writer: `ConfigDumper` on one line, a float as Python spells it (`1e-05`, not
    `1.0e-05`; `.inf` and `.nan` as YAML's), numpy's and torch's numbers as Python's, a str
    subclass (a str Enum) as its text, a tuple or a set as a list, a config section as the mapping
    of its options, text with a line break or another character that is not printable
    double-quoted with escapes, any other object as its text, and no anchors for an object met
    twice."""

    def ignore_aliases(self, data):
        return True

    def represent_str(self, data):
        style = '"' if any(not c.isprintable() for c in data) else None
        return self.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    def represent_float(self, data):
        if not math.isfinite(data):
            return super().represent_float(data)
        return self.represent_scalar("tag:yaml.org,2002:float", repr(float(data)))

    def represent_other(self, data):
        if is_dataclass(data) and not isinstance(data, type):  # a section: its options by their keys
            return self.represent_dict({option_key(f): getattr(data, f.name) for f in fields(data)})
        if isinstance(data, (set, frozenset)):
            return self.represent_list(sorted(data, key=repr))
        if isinstance(data, str):
            return self.represent_str(str.__str__(data))
        if isinstance(data, numbers.Integral):
            return self.represent_int(int(data))
        if isinstance(data, numbers.Real):
            return self.represent_float(float(data))
        return self.represent_str(str(data))


_ShownDumper.add_representer(str, _ShownDumper.represent_str)
_ShownDumper.add_representer(set, _ShownDumper.represent_other)
_ShownDumper.add_representer(float, _ShownDumper.represent_float)
_ShownDumper.add_representer(tuple, _ShownDumper.represent_list)
_ShownDumper.add_multi_representer(object, _ShownDumper.represent_other)


def load_yaml_text(text: str):
    """The YAML document `text` read with `ConfigLoader` (None when empty)."""
    return yaml.load(text, Loader=ConfigLoader)


class _StrictLoader(ConfigLoader):
    """`ConfigLoader`, except that a key written twice in one mapping is a ConfigError
    (`yaml.safe_load` keeps the last one silently: a second `data:` section drops the first).
    `source` names what is read in the message ("config file 'x.yaml'")."""

    source = "YAML"

    def __init__(self, stream):
        super().__init__(stream)
        self._paths: dict[int, str] = {}  # id of a mapping node: its dotted key
        self._checked: set[int] = set()  # mapping nodes already checked (a merge key flattens them)

    def construct_document(self, node):
        # The dotted key of every mapping node, for the message (nested mappings are built
        # lazily, out of order, so the constructor cannot track its parents itself).
        todo = [(node, "")]
        while todo:
            n, path = todo.pop()
            if isinstance(n, yaml.MappingNode):
                self._paths[id(n)] = path
                for k, v in n.value:
                    key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                    todo.append((v, f"{path}.{key}" if path else key))
            elif isinstance(n, yaml.SequenceNode):
                todo.extend((v, f"{path}[{i}]") for i, v in enumerate(n.value))
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode) and id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[tuple, int] = {}
            for k, _ in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                    continue
                line = k.start_mark.line + 1
                if (k.tag, k.value) in seen:
                    parent = self._paths.get(id(node), "")
                    key = f"{parent}.{k.value}" if parent else k.value
                    raise ConfigError(f"{self.source}: key {key!r} appears twice "
                                      f"(lines {seen[(k.tag, k.value)]} and {line})")
                seen[(k.tag, k.value)] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(stream, source: str, cls=None):
    """One YAML document (None when empty) with `_StrictLoader`; YAML syntax errors propagate.
    Given the config dataclass `cls`, the string options keep their text as written (`_typed_value`),
    as in an override."""
    loader = _StrictLoader(stream)
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        data = loader.construct_document(node)  # checks it (a key twice) and builds it
        return data if cls is None else _typed_value(loader, node, cls)
    finally:
        loader.dispose()


def _optional(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _text_kinds(tp) -> tuple[bool, bool]:
    """For a field of type `tp`: (a scalar is a string, the items of a list are strings) — `str`,
    `str | None`, `list[str]`, `str | list[str]` and the like; (False, False) for any type that
    also takes numbers or booleans."""
    if tp is None:
        return False, False
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    args = [a for a in args if a is not type(None)]
    list_str = [a for a in args if typing.get_origin(a) is list and typing.get_args(a) == (str,)]
    if args and all(a is str or a in list_str for a in args):
        return True, bool(list_str)  # list[str] also takes one string: `trainer.logger=console`
    return False, False


def _field_type(cls, path: list[str]):
    """The type of the field at `path` under dataclass `cls`; None for an unknown key (reported
    later, with a suggestion, by `build_dataclass`)."""
    tp = cls
    for part in path:
        if _optional(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if not is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
        if tp is None:
            return None
    return tp


def _typed_value(loader, node, tp):
    """The YAML value of `node` (already checked and built by `loader`) for a field of type `tp`,
    except that a plain (unquoted) scalar for a string field keeps its text: YAML would read
    `20250101`, `2025-01-01`, `1.0` or `on` as a number, a date or a boolean. `null` stays null."""
    scalar_text, items_text = _text_kinds(tp)
    if isinstance(node, yaml.ScalarNode):
        if scalar_text and node.style is None and node.tag != "tag:yaml.org,2002:null":
            return node.value
    elif isinstance(node, yaml.SequenceNode):
        if items_text:
            return [_typed_value(loader, item, str) for item in node.value]
    elif isinstance(node, yaml.MappingNode):
        if _optional(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            loader.flatten_mapping(node)
            out = {}
            for k, v in node.value:
                key = loader.construct_object(k, deep=True)
                out[key] = _typed_value(loader, v, hints.get(key) if isinstance(key, str) else None)
            return out
    return loader.construct_object(node, deep=True)


def parse_override(arg: str, cls=None) -> tuple[list[str], Any]:
    """`dotted.key=value` as (key parts, value); the value is YAML (`[a, b]`, `{lr: 1e-5}`, `null`).

    Hydra's `+key=value` and `++key=value` are accepted and mean `key=value`: meshppo's schema is
    fixed, so there is no key to add (`+` on an existing key is accepted, like Hydra's `++`, and an
    unknown key is still an error naming the closest valid one).

    Given the config dataclass `cls`, a value for a string option (`str`, `str | None`, the items
    of `list[str]`, the string options of a section given as a mapping) is its text as written,
    not what YAML reads: `trainer.experiment_name=2025-01-01` is the string '2025-01-01', not a
    date. Quotes are honoured (`'"1.0"'` is `1.0`) and `null` is null (None for an optional string).
    """
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} must look like dotted.key=value")
    key, raw = arg.split("=", 1)
    key = key.removeprefix("++") if key.startswith("++") else key.removeprefix("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {arg!r} has an empty key part")
    path = key.split(".")
    if raw == "":
        return path, ""
    loader = _StrictLoader(raw)
    loader.source = f"override {arg!r}"
    try:
        node = loader.get_single_node()
        if node is None:
            return path, None
        value = loader.construct_document(node)  # checks it (a key twice) and builds it
        if cls is not None:
            value = _typed_value(loader, node, _field_type(cls, path))
    except yaml.YAMLError as e:
        raise ConfigError(f"override {arg!r}: value is not valid YAML ({e})") from None
    finally:
        loader.dispose()
    _refuse_glued_mapping_keys(arg, value)
    return path, value


def _refuse_glued_mapping_keys(arg: str, value: Any) -> None:
    """Hydra reads `{enable_thinking:false}` as a mapping of one key; YAML reads the key
    `'enable_thinking:false'` with no value, which a free-form option would pass on silently. A null
    mapping key holding a colon is refused with the spelling YAML reads."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                name, _, rest = k.partition(":")
                raise ConfigError(f"override {arg!r}: {{{k}}} is one key with no value in YAML; write "
                                  f"{{{name}: {rest}}} (a space after the colon), as Hydra's {{{k}}} means")
            _refuse_glued_mapping_keys(arg, v)
    elif isinstance(value, list):
        for v in value:
            _refuse_glued_mapping_keys(arg, v)


def _merge_mapping(into: dict, value: dict) -> None:
    for k, v in value.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge_mapping(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def merge_override(data: dict, path: list[str], value) -> None:
    """Set `path` in `data` to `value`. A mapping merges into the section already there, key by
    key and recursively (as OmegaConf.merge does): `actor_rollout_ref.actor.optim={lr: 1e-5}`
    keeps the YAML's other optim options. Any other value replaces."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
        _merge_mapping(node[path[-1]], value)
    else:
        node[path[-1]] = copy.deepcopy(value) if isinstance(value, (dict, list)) else value


def read_yaml(path, cls=None) -> dict:
    """A config file's mapping; given the config dataclass `cls`, a string option written as a
    number or a date (`experiment_name: 2025-01-01`) is its text, as OmegaConf reads verl's files
    and as an override is read."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = _load_yaml(f, f"config file {str(path)!r}", cls)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


# verl's config files are Hydra configs: `defaults: [ppo_trainer, _self_]` composes verl's own
# defaults (which meshppo's mirror) under the file's values.
VERL_DEFAULTS = "ppo_trainer"


def _verl_composition(data: dict, source: str) -> dict:
    """A verl config file's Hydra header taken off: `hydra.searchpath` (where Hydra finds verl's
    config group) and `defaults: [ppo_trainer, _self_]` (verl's defaults first, the file over them,
    as meshppo's defaults and the file already are). Anything else in them composes configs
    meshppo does not have: a ConfigError naming it."""
    data = dict(data)
    hydra = data.pop("hydra", None)
    if hydra is not None and (not isinstance(hydra, dict) or set(hydra) - {"searchpath"}):
        extra = sorted(set(hydra) - {"searchpath"}) if isinstance(hydra, dict) else [repr(hydra)]
        raise ConfigError(f"{source}: hydra.{extra[0]} is not supported (only hydra.searchpath, which points Hydra at "
                          "verl's configs)")
    defaults = data.pop("defaults", None)
    if defaults is not None:
        names = [d for d in defaults] if isinstance(defaults, list) else [defaults]
        if VERL_MEGATRON_CONFIG in names:
            raise megatron_refusal(f"{source}: defaults {names}")
        if names not in ([VERL_DEFAULTS], [VERL_DEFAULTS, "_self_"]):
            raise ConfigError(f"{source}: defaults {names} is not supported: meshppo composes verl's defaults "
                              f"({VERL_DEFAULTS}) and then the file ([{VERL_DEFAULTS}, _self_]), nothing else")
    return data


class _Interpolations:
    """verl's OmegaConf interpolations in a config tree, resolved as OmegaConf resolves them: on
    the final values (the file's and the overrides' in `data`; for keys neither sets, `derived`:
    the values of the config built from them, `resolve_interpolations`).
    `${a.b}` is another option's value (its type kept when the interpolation is the whole value,
    its text inside a longer string); `${.x}` / `${..x}` are relative to the option's section;
    `${oc.select:a.b,default}` falls back to `default` where `a.b` is no option (a default may be an
    interpolation itself, as in verl's generated config); `${oc.env:VAR,default}` reads the
    environment. verl's `???` (a value that must be given) is an error where meshppo reads the value."""

    def __init__(self, data: dict, derived: dict):
        self.data, self.derived, self.active = data, derived, []

    def resolve_tree(self, node, path: tuple = ()):
        if isinstance(node, dict):
            return {k: self.resolve_tree(v, path + (str(k),)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.resolve_tree(v, path) for v in node]
        return self.resolve(node, path) if isinstance(node, str) and "${" in node else node

    def resolve(self, text: str, path: tuple):
        key = ".".join(path)
        if key in self.active:
            raise ConfigError(f"{key}: the interpolations {' -> '.join(self.active + [key])} form a cycle")
        self.active.append(key)
        try:
            return self._text(text, path)
        finally:
            self.active.pop()

    def _text(self, text: str, path: tuple):
        """`text` with its interpolations replaced: the value itself (its type kept) where one
        interpolation is the whole text, else their values as text."""
        spans = self._spans(text, path)
        if len(spans) == 1 and spans[0][:2] == (0, len(text)):
            return self._value(spans[0][2], path)
        out, end = [], 0
        for start, stop, expr in spans:
            out += [text[end:start], str(self._value(expr, path))]
            end = stop
        return "".join(out) + text[end:]

    @staticmethod
    def _spans(text: str, path: tuple) -> list[tuple[int, int, str]]:
        """(start, end, expression) of each outermost `${...}` of `text`; one nested in another's
        expression (verl's `${oc.select:a,${oc.select:b,null}}`) stays in it, for `_value`."""
        spans, depth, start = [], 0, 0
        i = 0
        while i < len(text):
            if text.startswith("${", i):
                start, depth, i = (i if depth == 0 else start), depth + 1, i + 2
                continue
            if text[i] == "}" and depth:
                depth -= 1
                if not depth:
                    spans.append((start, i + 1, text[start + 2:i]))
            i += 1
        if depth:
            raise ConfigError(f"{'.'.join(path)}: {text!r} has an unclosed ${{")
        return spans

    def _fallback(self, text: str, path: tuple, empty):
        """The default argument of an `oc.` resolver: YAML, or an interpolation of its own (read only
        where the default is used, as OmegaConf's oc.select falls back); `empty` where none is given."""
        text = text.strip()
        if not text:
            return empty
        return self._text(text, path) if "${" in text else load_yaml_text(text)

    def _value(self, expr: str, path: tuple):
        key = ".".join(path)
        resolver, _, args = expr.partition(":") if expr.startswith("oc.") else ("", "", expr)
        name, comma, fallback = args.partition(",")
        name = name.strip()
        if resolver == "oc.env":
            import os

            if name in os.environ:
                return os.environ[name]
            if not comma:
                raise ConfigError(f"{key}: ${{{expr}}} reads the environment variable {name}, which is not set")
            return self._fallback(fallback, path, "")
        if resolver not in ("", "oc.select"):
            raise ConfigError(f"{key}: ${{{expr}}}: the resolver {resolver} is not supported (meshppo reads "
                              "${a.b}, ${oc.select:a.b,default} and ${oc.env:VAR,default})")
        target = self._absolute(name, path)
        for tree in (self.data, self.derived):
            found, value = self._lookup(tree, target)
            if found:
                return self.resolve_tree(value, tuple(target))
        if resolver == "oc.select":
            return self._fallback(fallback, path, None)
        raise ConfigError(f"{key}: ${{{expr}}} names {'.'.join(target)!r}, which is no config option")

    @staticmethod
    def _absolute(name: str, path: tuple) -> list[str]:
        if not name.startswith("."):
            return name.split(".")
        dots = len(name) - len(name.lstrip("."))
        return list(path[:len(path) - dots]) + name[dots:].split(".")

    @staticmethod
    def _lookup(tree, parts: list[str]):
        for part in parts:
            if not isinstance(tree, dict) or part not in tree:
                return False, None
            tree = tree[part]
        return True, tree


def resolve_document(tree, name: str):
    """`tree`, a value of a YAML file read on its own (an entry of verl's tool and interaction config
    files, which verl reads with OmegaConf and resolves), with its interpolations resolved as a
    config's are (`_Interpolations`), `tree` being the file's only value, called `name`:
    `${oc.env:VAR,default}`, and `${.x}` / `${name.a.b}` / `${oc.select:...}` naming another of its
    values (through mappings). A ConfigError names the value, under `name`, that cannot be resolved."""
    return _Interpolations({name: tree}, {}).resolve_tree(tree, (name,))


def _interpolated_keys(tree: dict, path: tuple = ()) -> list[tuple]:
    """The paths of `tree`'s values that hold an interpolation (a list: as a whole)."""
    keys = []
    for k, v in tree.items():
        if isinstance(v, dict):
            keys += _interpolated_keys(v, path + (k,))
        elif "${" in str(v):
            keys.append(path + (k,))
    return keys


def _without(tree: dict, paths: list[tuple]) -> dict:
    tree = copy.deepcopy(tree)
    for path in paths:
        node = tree
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
    return tree


def _derived_values(cls, data: dict) -> dict:
    """The values of the config `cls` builds from `data` (the defaults it fills in, those that follow
    other options); where `data` builds none, the empty config's (the next pass, on better values,
    builds it, or the final build names what is wrong)."""
    for tree in (data, {}):
        try:
            return dataclasses.asdict(build_dataclass(cls, tree))
        except (TypeError, ValueError):
            continue
    return {}


def _at(tree: dict, path: tuple):
    return _Interpolations._lookup(tree, list(path))[1]


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def resolve_interpolations(cls, data: dict) -> dict:
    """`data` with verl's interpolations resolved (`_Interpolations`). A key `data` does not set is
    read from the config `cls` builds from `data`'s values, as verl's defaults, interpolations
    themselves, follow the user's values (rollout.response_length is data.max_response_length).
    That config is first built without the interpolated keys, then again from the values they
    resolve to, until they settle: a value that follows an interpolated one (max_model_len after an
    interpolated max_response_length) is then read as the final config has it. Values that never
    settle read one another in a cycle: a ConfigError naming them."""
    keys = _interpolated_keys(data)
    if not keys:
        return data
    base, resolved = _without(data, keys), None
    for _ in range(len(keys) + 2):  # each pass settles at least one more link of a chain of them
        previous, resolved = resolved, _Interpolations(data, _derived_values(cls, base)).resolve_tree(data)
        if resolved == previous:
            return resolved
        base = resolved
    unsettled = [p for p in keys if _at(resolved, p) != _at(previous, p)]
    raise ConfigError(f"{_dotted(unsettled[0])}: its interpolation {_at(data, unsettled[0])!r} reads a value that "
                      "changes with its own, through the options that follow it (unsettled: "
                      f"{', '.join(_dotted(p) for p in unsettled)}); set one of them")


def load_config(cls, path=None, overrides: list[str] = ()):
    """The config `cls` from the file at `path` and the dotted `overrides`, which records the options
    they set under the keys they were written as (`given_options`)."""
    data = _verl_composition(read_yaml(path, cls), f"config file {str(path)!r}") if path else {}
    for arg in overrides:
        merge_override(data, *parse_override(arg, cls))
    data = resolve_interpolations(cls, data)
    loading = _LOADING.set(data)  # (for the errors of the build itself: `given_option`)
    try:
        cfg = build_dataclass(cls, data)
    finally:
        _LOADING.reset(loading)
    cfg.given_options = copy.deepcopy(data)
    return cfg


_LOADING: contextvars.ContextVar = contextvars.ContextVar("loading", default=None)  # what load_config builds now


def given_option(cfg, key: str) -> tuple[bool, Any]:
    """(whether the config file or the overrides `cfg` was loaded from set the dotted `key`, the value
    written there), as `load_config` recorded them: by the key as written, before a config moves a
    value to another of its names (verl's aliases). null is not set; a config built otherwise
    records nothing. While `load_config` builds the config, its sections (`cfg` any) read what it builds."""
    given = getattr(cfg, "given_options", None)
    found, value = _Interpolations._lookup(_LOADING.get() or {} if given is None else given, key.split("."))
    return found and value is not None, value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_commented_yaml(cfg, indent: int = 0) -> str:
    """The resolved config as YAML, each option followed by its help string as a comment."""
    lines = []
    pad = "  " * indent
    for f in fields(cfg):
        value, name = getattr(cfg, f.name), option_key(f)
        help_ = describe(f.metadata)
        if is_dataclass(value):
            lines.append(f"{pad}{name}:" + (f"  # {help_}" if help_ else ""))
            lines.append(to_commented_yaml(value, indent + 1))
            continue
        dumped = yaml.dump(value, Dumper=ConfigDumper, default_flow_style=True, width=10_000).strip()
        if dumped.endswith("\n...") or dumped.endswith("..."):
            dumped = dumped.replace("\n...", "").removesuffix("...").strip()
        lines.append(f"{pad}{name}: {dumped}" + (f"  # {help_}" if help_ else ""))
    return "\n".join(line for line in lines if line)


def no_effect_options(cls, prefix: str = "") -> set[str]:
    """The dotted keys of `cls`'s options that change nothing in meshppo (`opt(no_effect=...)`)."""
    inst, out = cls(), set()
    for f in fields(cls):
        key = f"{prefix}.{option_key(f)}" if prefix else option_key(f)
        if is_dataclass(getattr(inst, f.name)):
            out |= no_effect_options(type(getattr(inst, f.name)), key)
        elif f.metadata.get("no_effect"):
            out.add(key)
    return out


def iter_options(cls, prefix: str = ""):
    """Yield `(dotted_key, type_name, default, help)` for every leaf option (for docs)."""
    hints = typing.get_type_hints(cls)
    inst = cls()
    for f in fields(cls):
        key = f"{prefix}.{option_key(f)}" if prefix else option_key(f)
        if is_dataclass(hints[f.name]) or is_dataclass(getattr(inst, f.name)):
            yield from iter_options(type(getattr(inst, f.name)), key)
        else:
            yield key, _type_name(hints[f.name]), getattr(inst, f.name), describe(f.metadata)
