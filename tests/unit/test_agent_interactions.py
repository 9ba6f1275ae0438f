"""The interaction layer of multi-turn rollouts: verl's base and GSM8K interactions, the interaction
config file, and the batch steps the turn loop takes (start, turns, finalize)."""

import asyncio
import re

import pytest
import yaml

from agent import (
    BaseInteraction,
    Gsm8kInteraction,
    InteractionConfigError,
    InteractionError,
    finalize_interactions,
    interaction_turns,
    load_interactions,
    start_interactions,
)
from agent.interactions import GSM8K_CORRECT, GSM8K_INCORRECT, default_name
from data.gsm8k import convert_row
from tests.agent_files import user_module, write_yaml

SHIPPED = "configs/interactions/gsm8k_interaction.yaml"
CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


def _assistant(text):
    return {"role": "assistant", "content": text}


# ---- the base and GSM8K interactions


def test_base_interaction_is_verls():
    base = BaseInteraction({})
    assert base.name == "interaction_agent" and BaseInteraction({"name": "judge"}).name == "judge"

    async def session():
        given = await base.start_interaction("id-1", ground_truth="3")
        fresh = await base.start_interaction()
        return given, fresh, await base.generate_response(given, [_assistant("hi")]), \
            await base.calculate_score(), await base.finalize_interaction()

    given, fresh, answer, score, final = asyncio.run(session())
    assert given == "id-1" and isinstance(fresh, str) and len(fresh) == 36  # a uuid4
    assert answer == (False, "Your current result seems acceptable.", 0.8, {})
    assert (score, final) == (0.0, None)


def _gsm8k_turns(ground_truth, chats):
    """Each chat of `chats` answered in turn by one GSM8K instance; the results and the instance's state."""
    interaction = Gsm8kInteraction({"name": "gsm8k"})

    async def session():
        instance = await interaction.start_interaction("s0", ground_truth=ground_truth, query="q", name="gsm8k")
        assert instance == "s0"
        out = [await interaction.generate_response(instance, chat, name="gsm8k", ground_truth=ground_truth)
               for chat in chats]
        return out, dict(interaction._instances[instance])

    return asyncio.run(session())


@pytest.mark.parametrize("content, ground_truth, expected", [
    ("3 * 24 = 72\n#### 72", "72", (True, CORRECT, 1.0, {})),             # right, in the asked format
    ("#### 1,500", "1500", (True, CORRECT, 1.0, {})),                      # strict drops the commas
    ("3 * 24 = 72\n#### 71", "72", (False, INCORRECT, 0.0, {})),           # wrong: format score 0.0
    ("The answer is 72.", "72", (False, INCORRECT, 0.0, {})),              # right number, no `####`
    ("#### $72", "72", (False, INCORRECT, 0.0, {})),                       # strict takes no `$`
    ("#### 72 at first, then #### 73", "72", (False, INCORRECT, 0.0, {})),  # the last `####` counts
])
def test_gsm8k_interaction_scores_the_answer_strictly(content, ground_truth, expected):
    (result,), state = _gsm8k_turns(ground_truth, [[{"role": "user", "content": "q"}, _assistant(content)]])
    assert result == expected
    assert state == {"response": content, "ground_truth": ground_truth, "reward": 0.0}


def test_gsm8k_interaction_reads_the_last_assistant_message():
    wrong_last = [_assistant("#### 72"), {"role": "user", "content": INCORRECT}, _assistant("#### 5")]
    right_last = [_assistant("#### 5"), {"role": "user", "content": INCORRECT}, _assistant("#### 72"),
                  {"role": "user", "content": "a user message after it is not read"}]
    no_assistant = [{"role": "system", "content": "#### 72"}, {"role": "user", "content": "#### 72"}]
    results, state = _gsm8k_turns("72", [wrong_last, right_last, no_assistant])
    assert [r[:3] for r in results] == [(False, INCORRECT, 0.0), (True, CORRECT, 1.0), (False, INCORRECT, 0.0)]
    assert state["response"] == ""  # no assistant message: the empty response
    assert (GSM8K_CORRECT, GSM8K_INCORRECT) == (CORRECT, INCORRECT)


def test_gsm8k_interaction_state_per_instance_and_finalize():
    interaction = Gsm8kInteraction({"name": "gsm8k"})

    async def session():
        a = await interaction.start_interaction("a", ground_truth="7")
        b = await interaction.start_interaction(None, ground_truth="8")
        assert b != a and set(interaction._instances) == {a, b}
        ra = await interaction.generate_response(a, [_assistant("#### 8")])
        rb = await interaction.generate_response(b, [_assistant("#### 8")])
        scores = (await interaction.calculate_score(a), await interaction.calculate_score(b))
        await interaction.finalize_interaction(a)
        left = set(interaction._instances)
        with pytest.raises(KeyError):
            await interaction.generate_response(a, [_assistant("#### 7")])
        return ra, rb, scores, left, b

    ra, rb, scores, left, b = asyncio.run(session())
    assert ra[:3] == (False, INCORRECT, 0.0) and rb[:3] == (True, CORRECT, 1.0)
    assert scores == (0.0, 1.0) and left == {b}


# ---- the interaction config file


USER_INTERACTIONS = '''
from agent.interactions import BaseInteraction


class FooInteraction(BaseInteraction):
    """The base interaction under a name verl derives as "foo"."""


class Judge(BaseInteraction):
    """The base interaction under a name without verl's suffix ("judge")."""


class Broken(BaseInteraction):
    def __init__(self, config):
        raise RuntimeError("boom")


class NotAnInteraction:
    """A class that is not a BaseInteraction: load_interactions refuses it."""
'''


@pytest.fixture
def user_interactions(tmp_path, monkeypatch):
    return user_module(tmp_path, monkeypatch, "meshppo_test_user_interactions", USER_INTERACTIONS)


def _write_config(tmp_path, doc, name="interactions.yaml"):
    return write_yaml(tmp_path, doc, name)


def test_shipped_config_is_verls_gsm8k_interaction():
    interactions = load_interactions(SHIPPED)
    assert list(interactions) == ["gsm8k"]
    gsm8k = interactions["gsm8k"]
    assert type(gsm8k) is Gsm8kInteraction and gsm8k.name == "gsm8k" and gsm8k.config == {"name": "gsm8k"}
    with open(SHIPPED, encoding="utf-8") as f:
        assert yaml.safe_load(f) == {"interaction": [
            {"name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {}}]}


def test_names_default_as_verl_derives_them(tmp_path, user_interactions):
    path = _write_config(tmp_path, {"interaction": [
        {"class_name": f"{user_interactions}.FooInteraction", "config": {"threshold": 2}},
        {"class_name": f"{user_interactions}.Judge"},  # no config: an empty one
        {"class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": None},
        {"name": "polite", "class_name": "agent.interactions.BaseInteraction", "config": {"name": "polite"}},
    ]})
    interactions = load_interactions(path)
    assert list(interactions) == ["foo", "judge", "gsm8k", "polite"]
    assert [type(i).__name__ for i in interactions.values()] == ["FooInteraction", "Judge", "Gsm8kInteraction",
                                                                 "BaseInteraction"]
    assert interactions["foo"].config == {"threshold": 2, "name": "foo"} and interactions["foo"].name == "foo"
    assert interactions["judge"].config == {"name": "judge"}
    assert interactions["polite"].name == "polite"
    assert [default_name(n) for n in ("a.b.FooInteraction", "a.Interactions", "a.CamelCaseInteraction")] == \
        ["foo", "interactions", "camelcase"]


def _entry(**overrides):
    entry = {"name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {}}
    entry.update(overrides)
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize("doc, message", [
    ("interaction: [", r"not valid YAML"),
    ("- a\n- b\n", r"must be a mapping with a 'interaction' list, got list"),
    ({"interactions": []}, r"must be a mapping with a 'interaction' list, got dict with keys \['interactions'\]"),
    ({"interaction": [_entry()], "tools": []},
     r"unknown top-level keys \['tools'\]; interaction config files hold only 'interaction'"),
    ({"interaction": []}, r"interaction: must be a non-empty list"),
    ({"interaction": ["gsm8k"]}, r"interaction\[0\]: must be a mapping with \['name', 'class_name', 'config'\]"),
    ({"interaction": [_entry(kwargs={})]}, r"interaction\[0\]: unknown keys \['kwargs'\]"),
    ({"interaction": [_entry(class_name=None)]}, r"interaction\[0\]\.class_name: missing"),
    ({"interaction": [_entry(class_name="Gsm8kInteraction")]},
     r"interaction\[0\]\.class_name: must be a dotted import path"),
    ({"interaction": [_entry(), _entry(name="other", class_name="nosuch_pkg.mod.Foo")]},
     r"interaction\[1\]\.class_name: cannot import module 'nosuch_pkg\.mod'"),
    ({"interaction": [_entry(class_name="verl.interactions.weather_interaction.WeatherInteraction")]},
     r"interaction\[0\]\.class_name: cannot import module 'verl\.interactions\.weather_interaction'.*of verl's "
     r"interactions meshppo provides \['verl\.interactions\.base\.BaseInteraction', "
     r"'verl\.interactions\.gsm8k_interaction\.Gsm8kInteraction'\]"),
    ({"interaction": [_entry(class_name="agent.interactions.NoSuch")]},
     r"interaction\[0\]\.class_name: module 'agent\.interactions' has no 'NoSuch'"),
    ({"interaction": [_entry(class_name="agent.tools.BaseTool")]},
     r"interaction\[0\]\.class_name: agent\.tools\.BaseTool is not a subclass of agent\.interactions\.BaseInteraction"),
    ({"interaction": [_entry(name=3)]}, r"interaction\[0\]\.name: must be a non-empty string, got 3"),
    ({"interaction": [_entry(name="")]}, r"interaction\[0\]\.name: must be a non-empty string, got ''"),
    ({"interaction": [_entry(config=[1])]}, r"interaction\[0\]\.config: must be a mapping"),
    ({"interaction": [_entry(config={"name": "other"})]},
     r"interaction\[0\]\.config\.name: 'other' differs from the entry's name 'gsm8k'"),
    ({"interaction": [_entry(), _entry(class_name="agent.interactions.Gsm8kInteraction")]},
     r"interaction\[1\]\.name: 'gsm8k' is also the name of interaction\[0\]; interaction names must be unique"),
    ({"interaction": [_entry(), _entry(name=None)]},  # the derived name collides too
     r"interaction\[1\]\.name: 'gsm8k' is also the name of interaction\[0\]"),
])
def test_bad_interaction_configs_name_the_file_entry_and_key(tmp_path, doc, message):
    path = _write_config(tmp_path, doc)
    with pytest.raises(InteractionConfigError, match=re.escape(path) + ": " + message):
        load_interactions(path)


def test_bad_interaction_classes_name_the_file_entry_and_key(tmp_path, user_interactions):
    for cls, message in [("Broken", r"interaction\[0\]: meshppo_test_user_interactions\.Broken\(config\) failed: "
                                    r"RuntimeError: boom"),
                         ("NotAnInteraction", r"interaction\[0\]\.class_name: .*NotAnInteraction is not a subclass "
                                              r"of agent\.interactions\.BaseInteraction")]:
        path = _write_config(tmp_path, {"interaction": [{"class_name": f"{user_interactions}.{cls}"}]})
        with pytest.raises(InteractionConfigError, match=re.escape(path) + ": " + message):
            load_interactions(path)


def test_missing_interaction_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(InteractionConfigError, match=re.escape(path) + r": cannot read the interaction config "
                                                     r"\(actor_rollout_ref\.rollout\.multi_turn\."
                                                     r"interaction_config_path\)"):
        load_interactions(path)
    assert issubclass(InteractionConfigError, ValueError) and issubclass(InteractionError, ValueError)


# ---- the batch steps


class Recorder(BaseInteraction):
    """Records its calls; answers with the instance id and the number of messages, scored by their count."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = []

    async def start_interaction(self, instance_id=None, **kwargs):
        self.calls.append(("start", instance_id, kwargs))
        return f"{self.name}:{instance_id}"

    async def generate_response(self, instance_id, messages, **kwargs):
        self.calls.append(("turn", instance_id, kwargs))
        return len(messages) > 1, f"{self.name} {instance_id} {len(messages)}", len(messages), {"n": 1}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.calls.append(("finalize", instance_id, kwargs))


class Rendezvous(BaseInteraction):
    """Instance "first" waits (at most 5 s) for instance "second" at every step, so a step that does not
    run them concurrently times out; the order in which they finish is recorded."""

    def __init__(self, config):
        super().__init__(config)
        self.events = {}
        self.finished = []

    async def _meet(self, step, instance_id):
        event = self.events.setdefault(step, asyncio.Event())
        if instance_id == "first":
            await asyncio.wait_for(event.wait(), timeout=5)
        else:
            event.set()
        self.finished.append((step, instance_id))

    async def start_interaction(self, instance_id=None, **kwargs):
        await self._meet("start", instance_id)
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        await self._meet("turn", instance_id)
        return instance_id == "first", instance_id, None, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        await self._meet("finalize", instance_id)


def test_batch_steps_run_concurrently_and_keep_order():
    meet = Rendezvous({"name": "meet"})
    interactions = {"meet": meet}
    assert start_interactions(interactions, [("first", {"name": "meet"}), ("second", {"name": "meet"})]) == \
        ["first", "second"]
    turns = interaction_turns(interactions, [("meet", "first", [], {"name": "meet"}), ("meet", "second", [], {})])
    assert turns == [(True, "first", None, {}), (False, "second", None, {})]
    finalize_interactions(interactions, [("meet", "first"), ("meet", "second")])
    # each step: the second finished first, yet the results are in request order
    assert meet.finished == [(step, who) for step in ("start", "turn", "finalize") for who in ("second", "first")]


def test_batch_steps_route_by_name_and_pass_the_kwargs_as_keywords():
    a, b = Recorder({"name": "a"}), Recorder({"name": "b"})
    interactions = {"a": a, "b": b}
    ids = start_interactions(interactions, [("r0", {"name": "b", "ground_truth": "1"}),
                                            ("r1", {"name": "a", "query": "q"}),
                                            ("r2", {"name": "b", "ground_truth": "2"})])
    assert ids == ["b:r0", "a:r1", "b:r2"]
    chat = [{"role": "user", "content": "q"}, _assistant("x")]
    turns = interaction_turns(interactions, [("b", "b:r0", chat, {"name": "b", "ground_truth": "1"}),
                                             ("a", "a:r1", chat[:1], {"name": "a", "query": "q"}),
                                             ("b", "b:r2", chat, {})])
    assert turns == [(True, "b b:r0 2", 2.0, {"n": 1}), (False, "a a:r1 1", 1.0, {"n": 1}),
                     (True, "b b:r2 2", 2.0, {"n": 1})]
    assert all(type(score) is float for _, _, score, _ in turns)  # an int score comes back as a float
    finalize_interactions(interactions, [("a", "a:r1"), ("b", "b:r0"), ("b", "b:r2")])
    assert a.calls == [("start", "r1", {"name": "a", "query": "q"}), ("turn", "a:r1", {"name": "a", "query": "q"}),
                       ("finalize", "a:r1", {})]
    assert b.calls == [("start", "r0", {"name": "b", "ground_truth": "1"}),
                       ("start", "r2", {"name": "b", "ground_truth": "2"}),
                       ("turn", "b:r0", {"name": "b", "ground_truth": "1"}), ("turn", "b:r2", {}),
                       ("finalize", "b:r0", {}), ("finalize", "b:r2", {})]


def test_batch_steps_from_inside_a_running_event_loop():
    interactions = load_interactions(SHIPPED)

    async def inside():
        ids = start_interactions(interactions, [("x", {"name": "gsm8k", "ground_truth": "4"})])
        return ids, interaction_turns(interactions, [("gsm8k", "x", [_assistant("#### 4")], {})])

    assert asyncio.run(inside()) == (["x"], [(True, CORRECT, 1.0, {})])
    finalize_interactions(interactions, [("gsm8k", "x")])
    assert interactions["gsm8k"]._instances == {}


def test_the_rows_of_the_interaction_variant_drive_the_shipped_interaction():
    """verl's interaction rows (data.gsm8k) pick the shipped config's interaction and carry its ground truth."""
    row = convert_row({"question": "A car costs $1,200 plus $300 tax. Total?", "answer": "1200+300\n#### 1,500"},
                      0, "train", multiturn="interaction")
    kwargs = row["extra_info"]["interaction_kwargs"]
    interactions = load_interactions(SHIPPED)
    (instance,) = start_interactions(interactions, [("req-0", kwargs)])
    chat = list(row["prompt"]) + [_assistant("1200 + 300 = 1600\n#### 1600")]
    first = interaction_turns(interactions, [(kwargs["name"], instance, chat, kwargs)])
    chat += [{"role": "user", "content": first[0][1]}, _assistant("Sorry: 1200 + 300 = 1500\n#### 1,500")]
    second = interaction_turns(interactions, [(kwargs["name"], instance, chat, kwargs)])
    assert (first, second) == ([(False, INCORRECT, 0.0, {})], [(True, CORRECT, 1.0, {})])
    finalize_interactions(interactions, [(kwargs["name"], instance)])
    assert interactions["gsm8k"]._instances == {}


@pytest.mark.parametrize("kwargs, message", [
    ({"query": "q", "ground_truth": "1"}, r"request 1: 'name' key is required in interaction_kwargs .*got keys "
                                          r"\['query', 'ground_truth'\]"),
    ({"name": "weather"}, r"request 1: interaction 'weather' not found; the interactions are \['gsm8k', 'rec'\] "
                          r"\(actor_rollout_ref\.rollout\.multi_turn\.interaction_config_path\)"),
    (None, r"request 1: a row's extra_info\.interaction_kwargs must be a mapping .*got NoneType"),
])
def test_start_refuses_rows_that_pick_no_interaction_before_starting_any(kwargs, message):
    rec = Recorder({"name": "rec"})
    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"}), "rec": rec}
    with pytest.raises(InteractionError, match=message):
        start_interactions(interactions, [("r0", {"name": "rec"}), ("r1", kwargs)])
    assert rec.calls == []


def test_turns_and_finalize_refuse_unknown_names_and_bad_kwargs():
    interactions = {"rec": Recorder({"name": "rec"})}
    with pytest.raises(InteractionError, match=r"request 0: interaction 'other' not found; the interactions are "
                                               r"\['rec'\]"):
        interaction_turns(interactions, [("other", "i", [], {})])
    with pytest.raises(InteractionError, match=r"request 1: a row's extra_info\.interaction_kwargs must be a mapping"):
        interaction_turns(interactions, [("rec", "i", [], {}), ("rec", "j", [], ["name"])])
    with pytest.raises(InteractionError, match=r"request 0: interaction None not found"):
        finalize_interactions(interactions, [(None, "i")])
    assert interactions["rec"].calls == []


class Faulty(BaseInteraction):
    """Breaks in the way its config's `fault` says."""

    async def start_interaction(self, instance_id=None, **kwargs):
        if self.config["fault"] == "raise":
            raise RuntimeError("no user today")
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        fault = self.config["fault"]
        if fault == "raise":
            raise RuntimeError("no user today")
        return {"short": (True, "x", 1.0), "text": (True, None, 1.0, {}), "score": (True, "x", "1.0", {}),
                "bool score": (True, "x", True, {}), "metrics": (True, "x", 1.0, None)}[fault]

    async def finalize_interaction(self, instance_id=None, **kwargs):
        raise KeyError(instance_id)


@pytest.mark.parametrize("fault, message", [
    ("raise", r"interaction 'bad' \(Faulty\)\.generate_response failed: RuntimeError: no user today"),
    ("short", r"interaction 'bad' \(Faulty\)\.generate_response returned \(True, 'x', 1\.0\); it must return "
              r"\(should_terminate, text, score, metrics\)"),
    ("text", r"returned a text of type NoneType, not a str"),
    ("score", r"returned the score '1\.0'; it must be a number or None"),
    ("bool score", r"returned the score True; it must be a number or None"),
    ("metrics", r"returned metrics of type NoneType, not a dict"),
])
def test_an_interaction_that_raises_or_breaks_its_contract_stops_the_run_naming_it(fault, message):
    interactions = {"bad": Faulty({"name": "bad", "fault": fault}), "rec": Recorder({"name": "rec"})}
    with pytest.raises(InteractionError, match=message):
        interaction_turns(interactions, [("rec", "r", [], {}), ("bad", "b", [], {})])


def test_start_and_finalize_errors_name_the_interaction():
    interactions = {"bad": Faulty({"name": "bad", "fault": "raise"})}
    with pytest.raises(InteractionError, match=r"interaction 'bad' \(Faulty\)\.start_interaction failed: "
                                               r"RuntimeError: no user today") as err:
        start_interactions(interactions, [("b", {"name": "bad"})])
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(InteractionError, match=r"interaction 'bad' \(Faulty\)\.finalize_interaction failed: "
                                               r"KeyError: 'b'"):
        finalize_interactions(interactions, [("bad", "b")])
    gsm8k = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    with pytest.raises(InteractionError, match=r"interaction 'gsm8k' \(Gsm8kInteraction\)\.finalize_interaction "
                                               r"failed: KeyError: 'never-started'"):
        finalize_interactions(gsm8k, [("gsm8k", "never-started")])
