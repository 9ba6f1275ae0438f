"""Interactions for multi-turn rollouts: verl's simulated user, its GSM8K interaction, its
interaction config file, and the batch steps the turn loop takes with them.

An interaction answers the model's turn when the turn calls no tool (`rollout.multi_turn.
interaction_config_path`): the row's `extra_info.interaction_kwargs` name the interaction
(`name`) and carry what it needs (GSM8K's `ground_truth`); the interaction is started per sample,
gets the chat so far on each of its turns and answers (should the rollout stop, the user
message, the turn's score or None, metrics). An interaction is a `BaseInteraction` with verl's
methods and semantics, so one written for verl runs here by subclassing this class instead.

The batch steps (`start_interactions`, `interaction_turns`, `finalize_interactions`) run every
sample's call concurrently; the turn loop runs them, and each sample's `interaction_turn`, in one
event loop per rollout (`agent._load.EventLoop`), so an interaction may keep objects bound to it
(an `asyncio.Lock`) for the rollout, not from one rollout to the next. An interaction that raises
stops the run as an `InteractionError` naming it: verl does not catch it either, and unlike a
tool call the model did not choose it.
"""

from __future__ import annotations

import asyncio
import numbers
import os
from typing import Any
from uuid import uuid4

from agent._load import cancelled_from_outside, load_class, read_entries, run
from rewards import gsm8k

INTERACTION_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
DEFAULT_NAME = "interaction_agent"


class InteractionConfigError(ValueError):
    """An interaction config file that cannot be used; the message names the file, the entry and
    the key."""


class InteractionError(ValueError):
    """A row whose `interaction_kwargs` pick no interaction, or an interaction that raised or broke
    its contract; the message names the interaction."""


class BaseInteraction:
    """verl's interaction interface. `name` is the config's `name` (`load_interactions` puts the
    entry's name there). `start_interaction` starts an instance for one sample (verl's agent loop
    passes the request id and the row's `interaction_kwargs` as keywords), `generate_response`
    answers the chat so far, `calculate_score` scores the instance, `finalize_interaction` frees
    it. The base interaction keeps no state and answers every turn as verl's does: go on, a fixed
    text, score 0.8."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", DEFAULT_NAME)

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        """The instance's id: `instance_id`, or a fresh one."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float | None, dict[str, Any]]:
        """The answer to the chat `messages`: (stop the rollout, the user message's text, the
        turn's score or None for no score, metrics)."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        """The instance's score (verl's base takes no instance; here it may)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        """Free what the instance holds."""


GSM8K_CORRECT = "Your response is correct!"
GSM8K_INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K interaction: a user who checks the model's answer and asks it to try again.

    `start_interaction` keeps the row's `ground_truth`. Each turn scores the content of the last
    assistant message (none: the empty string) with `rewards.gsm8k.compute_score`, strict (only
    `#### N` counts), 1.0 if right and 0.0 otherwise; a right answer ends the rollout with
    "Your response is correct!", anything else asks for another try. The turn's score is that
    score.
    """

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        content = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, GSM8K_CORRECT, reward, {}
        return False, GSM8K_INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0,
                                   score=1.0)

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        del self._instances[instance_id]


# ---- the interaction config file

# verl's class names for the interactions meshppo provides, so that verl's configs load as written.
VERL_INTERACTION_CLASSES = {
    "verl.interactions.base.BaseInteraction": BaseInteraction,
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
}
_ENTRY_KEYS = ("name", "class_name", "config")
_SUFFIX = "Interaction"


def default_name(class_name: str) -> str:
    """verl's name for an entry without one: the class's own name, lower-cased, less a trailing
    `Interaction` (`pkg.mod.Gsm8kInteraction` -> `gsm8k`)."""
    short = class_name.rsplit(".", 1)[-1]
    if short.endswith(_SUFFIX):
        short = short[:-len(_SUFFIX)]
    return short.lower()


def load_interactions(path: str | os.PathLike) -> dict[str, BaseInteraction]:
    """The interactions of a verl interaction config file (`interaction:`, a list of `name`,
    `class_name` and `config`), built in order, by name. An entry's name defaults to
    `default_name(class_name)`, is put in its config as `name` (a config `name` that differs is
    refused: verl would silently overwrite it) and must be unique; `config` may be left out (an
    empty one). Every problem is an InteractionConfigError naming the file, the entry and the key."""
    path = os.fspath(path)
    entries = read_entries(path, "interaction", "interaction config", INTERACTION_CONFIG_KEY, InteractionConfigError)
    interactions: dict[str, BaseInteraction] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(entry, dict):
            raise InteractionConfigError(f"{where}: must be a mapping with {list(_ENTRY_KEYS)}, got "
                                         f"{type(entry).__name__}")
        unknown = [k for k in entry if k not in _ENTRY_KEYS]
        if unknown:
            raise InteractionConfigError(f"{where}: unknown keys {unknown}; an entry has {list(_ENTRY_KEYS)}")
        if "class_name" not in entry:
            raise InteractionConfigError(f"{where}.class_name: missing (the interaction's class, "
                                         "package.module.Class)")
        class_name = entry["class_name"]
        cls = load_class(class_name, f"{where}.class_name", BaseInteraction, VERL_INTERACTION_CLASSES,
                         "interactions", InteractionConfigError)
        name = entry.get("name")
        if name is None:
            name = default_name(class_name)
        elif not isinstance(name, str) or not name:
            raise InteractionConfigError(f"{where}.name: must be a non-empty string, got {name!r}")
        config = {} if entry.get("config") is None else entry["config"]
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}.config: must be a mapping (the interaction's settings), got "
                                         f"{config!r}")
        if "name" in config and config["name"] != name:
            raise InteractionConfigError(f"{where}.config.name: {config['name']!r} differs from the entry's name "
                                         f"{name!r}; set the name once, as the entry's 'name'")
        if name in first_index:
            raise InteractionConfigError(f"{where}.name: {name!r} is also the name of interaction[{first_index[name]}]"
                                         "; interaction names must be unique (an entry without one is named after "
                                         "its class)")
        config = {**config, "name": name}
        try:
            interaction = cls(config=config)
        except Exception as err:
            raise InteractionConfigError(f"{where}: {class_name}(config) failed: {type(err).__name__}: "
                                         f"{err}") from err
        first_index[name] = i
        interactions[name] = interaction
    return interactions


# ---- the batch steps of the turn loop


def _pick(interactions: dict[str, BaseInteraction], name: Any, i: int) -> BaseInteraction:
    """The interaction called `name` for request `i`; an InteractionError listing the names if none is."""
    if not isinstance(name, str) or name not in interactions:
        raise InteractionError(f"request {i}: interaction {name!r} not found; the interactions are "
                               f"{list(interactions)} ({INTERACTION_CONFIG_KEY})")
    return interactions[name]


def _checked(kwargs: Any, i: int) -> dict:
    """Request `i`'s `interaction_kwargs`, if a mapping (they are passed as keywords)."""
    if not isinstance(kwargs, dict):
        raise InteractionError(f"request {i}: a row's extra_info.interaction_kwargs must be a mapping with the "
                               f"interaction's 'name', got {type(kwargs).__name__}")
    return kwargs


def _named(kwargs: Any, i: int) -> Any:
    """The name in request `i`'s `interaction_kwargs`; an InteractionError unless they are a mapping
    with 'name'."""
    if "name" not in _checked(kwargs, i):
        raise InteractionError(f"request {i}: 'name' key is required in interaction_kwargs (it picks the "
                               f"interaction), got keys {list(kwargs)}")
    return kwargs["name"]


async def _call(interaction: BaseInteraction, method: str, *args, **kwargs):
    """`interaction.method(*args, **kwargs)`; what it raises becomes an InteractionError naming it."""
    try:
        return await getattr(interaction, method)(*args, **kwargs)
    except (Exception, asyncio.CancelledError) as err:
        if isinstance(err, asyncio.CancelledError) and cancelled_from_outside():
            raise
        raise InteractionError(f"interaction {interaction.name!r} ({type(interaction).__name__}).{method} "
                               f"failed: {type(err).__name__}: {err}") from err


def _gather(calls, loop=None):
    async def batch():
        return await asyncio.gather(*calls)

    return run(batch(), loop)


def start_interactions(interactions: dict[str, BaseInteraction],
                       requests: list[tuple[str, dict[str, Any]]], loop=None) -> list[str]:
    """Start an instance per sample, all at once: each request is (instance id, the row's
    `interaction_kwargs`), whose `name` picks the interaction; they are passed as keywords, as
    verl does. The instance ids the interactions return, in order (the turn loop ignores them and
    uses its own ids, as verl does). Every request's interaction is looked up before any starts."""
    picked = [_pick(interactions, _named(kwargs, i), i) for i, (_, kwargs) in enumerate(requests)]
    return _gather([_call(interaction, "start_interaction", instance_id, **kwargs)
                    for interaction, (instance_id, kwargs) in zip(picked, requests)], loop)


def _turn_result(interaction: BaseInteraction, result: Any) -> tuple[bool, str, float | None, dict]:
    """`generate_response`'s result checked: a 4-tuple (stop as a truth value, a str, a real score
    or None, a mapping); anything else is an InteractionError naming the interaction."""
    who = f"interaction {interaction.name!r} ({type(interaction).__name__}).generate_response"
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        raise InteractionError(f"{who} returned {result!r}; it must return (should_terminate, text, score, "
                               "metrics)")
    stop, text, score, metrics = result
    if not isinstance(text, str):
        raise InteractionError(f"{who} returned a text of type {type(text).__name__}, not a str")
    if score is not None and (isinstance(score, bool) or not isinstance(score, numbers.Real)):
        raise InteractionError(f"{who} returned the score {score!r}; it must be a number or None")
    if not isinstance(metrics, dict):
        raise InteractionError(f"{who} returned metrics of type {type(metrics).__name__}, not a dict")
    return bool(stop), text, (None if score is None else float(score)), metrics


def interaction_turn(interactions: dict[str, BaseInteraction], name: str, instance_id: str,
                     messages: list[dict[str, Any]], kwargs: dict[str, Any], i: int = 0):
    """One sample's interaction turn, as a coroutine: `generate_response` of the interaction called
    `name` on the chat so far, with the row's `interaction_kwargs` as keywords (verl passes them
    so); its (should_terminate, text, score or None, metrics). The interaction is looked up now (`i`
    numbers the request in errors)."""
    interaction = _pick(interactions, name, i)
    _checked(kwargs, i)

    async def turn():
        return _turn_result(interaction, await _call(interaction, "generate_response", instance_id, messages,
                                                     **kwargs))

    return turn()


def interaction_turns(interactions: dict[str, BaseInteraction],
                      requests: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]],
                      ) -> list[tuple[bool, str, float | None, dict]]:
    """The interaction turns of a batch, all at once: each request is (interaction name, instance
    id, the chat so far, the row's `interaction_kwargs`); per request in order, `interaction_turn`'s
    result. Every request is checked before any runs."""
    for i, (name, _, _, kwargs) in enumerate(requests):
        _pick(interactions, name, i), _checked(kwargs, i)
    turns = [interaction_turn(interactions, name, instance_id, messages, kwargs, i)
             for i, (name, instance_id, messages, kwargs) in enumerate(requests)]
    return _gather(turns)


def finalize_interactions(interactions: dict[str, BaseInteraction], requests: list[tuple[str, str]],
                          loop=None) -> None:
    """Free every (interaction name, instance id) of `requests`, all at once."""
    picked = [_pick(interactions, name, i) for i, (name, _) in enumerate(requests)]
    _gather([_call(interaction, "finalize_interaction", instance_id)
             for interaction, (_, instance_id) in zip(picked, requests)], loop)
