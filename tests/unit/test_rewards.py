"""Rule-based scorers, the reward registry, custom reward files and score_responses."""

import math
import re
import sys

import pytest

from rewards import RewardError, default_compute_score, get_reward_fn, load_custom_reward_fn, score_responses
from rewards import demo, gsm8k


def _verl_extract_solution(solution_str, method="strict"):
    """verl's `verl/utils/reward_score/gsm8k.py` extract_solution, transcribed line for line."""
    assert method in ["strict", "flexible"]
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if len(solutions) == 0:
            final_answer = None
        else:
            final_answer = solutions[-1].replace(",", "").replace("$", "")
    elif method == "flexible":
        answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = None
        if len(answer) != 0:  # verl: `if len(answer) == 0: pass` / `else:`
            invalid_str = ["", "."]
            for final_answer in reversed(answer):
                if final_answer not in invalid_str:
                    break
    return final_answer


@pytest.mark.parametrize("solution, method, expected", [
    ("3 + 4 = 7\n#### 7", "strict", "7"),
    ("#### 1,234.5", "strict", "1234.5"),
    ("#### $18", "strict", None),  # verl's strict format has no dollar sign
    ("#### -3 then later #### 12", "strict", "12"),
    ("The answer is 7", "strict", None),
    ("####7", "strict", None),  # verl's strict format needs the space
    ("The answer is 1,500 dollars.", "flexible", "1,500"),  # flexible answers are not cleaned
    ("first 3, then 4.", "flexible", "4."),
    ("so 1,234 apples", "flexible", "1,234"),
    ("#### 1,2,3", "flexible", "1,2,3"),
    ("#### 1,2,3", "strict", "123"),
    (".", "flexible", "."),  # only punctuation: verl's loop falls through to the first match
    ("#### .", "flexible", "."),
    ("#### .", "strict", "."),
    ("no digits here.", "flexible", "."),
    ("no digits here", "flexible", None),
    ("#### 5" + " filler" * 60, "strict", None),  # the marker is outside the last 300 characters
])
def test_gsm8k_extract_solution(solution, method, expected):
    assert gsm8k.extract_solution(solution, method=method) == expected == _verl_extract_solution(solution, method)


def test_gsm8k_compute_score():
    assert gsm8k.compute_score("so #### 72", "72") == 1.0
    assert gsm8k.compute_score("so #### 71", "72") == 0.0
    assert gsm8k.compute_score("so #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("so 72", "72") == 0.0
    assert gsm8k.compute_score("so 72", "72", method="flexible", score=2.0) == 2.0
    assert gsm8k.compute_score("#### $18", "18") == 0.0
    assert gsm8k.compute_score("the answer is 4.", "4", method="flexible", format_score=0.1) == 0.1
    # compared without conversion, as verl compares: an int ground truth never equals the answer string
    assert gsm8k.compute_score("#### 72", 72, format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible'"):
        gsm8k.compute_score("#### 1", "1", method="loose")


def test_demo_compute_score():
    assert demo.compute_score("95", "95") == 1.0
    assert demo.compute_score(" 95\n", "95") == 1.0
    assert demo.compute_score("095", "95") == 0.0
    assert demo.compute_score("95+1", "95") == 0.0
    assert demo.compute_score("", "0") == 0.0


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 1,000", "1000") == 1.0
    assert default_compute_score("openai/gsm8k", "1000", "1000") == 0.0  # strict format required
    assert default_compute_score("meshppo/demo_add", "12", "12", {"index": 0}) == 1.0
    with pytest.raises(RewardError,
                       match=r"no built-in reward for data_source 'my/data'.*custom_reward_function\.path"):
        default_compute_score("my/data", "x", "y")
    assert get_reward_fn() is default_compute_score


CUSTOM = '''
import math

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str), "pred": solution_str}

def boolean(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str == ground_truth

def with_info(data_source, solution_str, ground_truth, extra_info=None):
    return extra_info["weight"] * (solution_str == ground_truth)

def broken(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise KeyError("boom")
    return 1.0

def wrong_type(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def not_finite(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def calls_library(data_source, solution_str, ground_truth, extra_info=None):
    return math.sqrt(-1.0)

def reordered(solution_str, ground_truth, data_source=None, extra_info=None):
    return float(solution_str == ground_truth)

def keywords_only(**kwargs):
    return {"score": float(kwargs["solution_str"] == kwargs["ground_truth"]), "source_len": len(kwargs["data_source"])}

def numpy_bool(data_source, solution_str, ground_truth, extra_info=None):
    import numpy
    return numpy.isclose(float(solution_str), float(ground_truth))

def positional_names(ds, response, truth, info=None):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_load_custom_reward_fn(custom_file, tmp_path):
    fn = load_custom_reward_fn(custom_file)
    assert fn("d", "4", "4")["score"] == 1.0
    assert get_reward_fn(custom_file, "boolean")("d", "4", "5") is False
    with pytest.raises(RewardError, match=r"custom reward file not found: .*missing\.py \(looking for function 'f'\)"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "f")
    with pytest.raises(RewardError, match=r"my_reward\.py has no function 'score_fn' \(it defines: .*'boolean'"):
        load_custom_reward_fn(custom_file, "score_fn")
    with pytest.raises(RewardError, match=r"'NOT_A_FUNCTION' in custom reward file .*my_reward\.py is a int"):
        load_custom_reward_fn(custom_file, "NOT_A_FUNCTION")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport not_a_module_anywhere\n")
    with pytest.raises(RewardError,
                       match=r"importing custom reward file .*bad\.py failed at .*bad\.py:2: ModuleNotFoundError") as info:
        load_custom_reward_fn(str(bad))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    bad.write_text("def compute_score(a, b, c, d=None):\n    return (\n")
    with pytest.raises(RewardError, match=r"importing custom reward file .*bad\.py failed at .*bad\.py:2: SyntaxError"):
        load_custom_reward_fn(str(bad))


def test_a_reward_file_that_exits_at_import_is_a_reward_error(tmp_path, monkeypatch):
    """argparse at a reward file's top level meets the trainer's command line and exits (status 2): that is the
    file's failure, named, not the rank's end with argparse's usage; the half-imported module is not kept."""
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--config", "configs/demo.yaml", "trainer.total_epochs=1"])
    path = tmp_path / "exits.py"
    path.write_text("import argparse\nparser = argparse.ArgumentParser()\nARGS = parser.parse_args()\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    def kept():  # the reward-file modules imported since the start
        return {m for m in set(sys.modules) - before if m.startswith("meshppo_custom_reward_")}

    before = set(sys.modules)
    with pytest.raises(RewardError, match=r"importing custom reward file .*exits\.py failed at .*exits\.py:3: "
                                          r"SystemExit: the code exits at import \(exit status 2\)") as info:
        load_custom_reward_fn(str(path))
    assert isinstance(info.value.__cause__, SystemExit)
    assert not kept()
    # any BaseException but KeyboardInterrupt, and a module imported as pkg://
    path.write_text("class Stop(BaseException):\n    pass\nraise Stop('no')\n")
    with pytest.raises(RewardError, match=r"exits\.py failed at .*exits\.py:3: Stop: no"):
        load_custom_reward_fn(str(path))
    assert not kept()
    path.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_custom_reward_fn(str(path))
    assert not kept()
    (tmp_path / "exits_pkg.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"custom reward module exits_pkg \(pkg://exits_pkg\) cannot be imported "
                                          r"at .*exits_pkg\.py:2: SystemExit: .*\(exit status 3\)"):
        load_custom_reward_fn("pkg://exits_pkg")
    assert "exits_pkg" not in sys.modules


def test_reward_kwargs_win_over_the_calls_own(custom_file, tmp_path):
    """verl's custom_reward_function.reward_kwargs: merged into every call, {**call, **reward_kwargs}."""
    path = tmp_path / "kw.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                    "    return scale * (solution_str == ground_truth)\n")
    fn = get_reward_fn(str(path), "compute_score", {"scale": 0.5, "ground_truth": "7"})
    # the ground truth from reward_kwargs wins over the call's "4": "7" == "7" scores 0.5, "4" scores 0
    assert score_responses(fn, ["d"] * 2, ["7", "4"], ["4", "4"])[0] == [0.5, 0.0]
    with pytest.raises(RewardError, match=r"'compute_score' in custom reward file .*my_reward\.py cannot be called as a "
                                          r"reward function: it is called by keyword, fn\(data_source=\.\.\., "
                                          r"solution_str=\.\.\., ground_truth=\.\.\., extra_info=\.\.\., scale=\.\.\.\)"):
        load_custom_reward_fn(custom_file, "compute_score", {"scale": 2})
    # an error inside the function still names the user's line
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                    "    raise KeyError(scale)\n")
    with pytest.raises(RewardError, match=r"raised on sample 0 .* at .*kw\.py:2: KeyError: 3"):
        score_responses(load_custom_reward_fn(str(path), reward_kwargs={"scale": 3}), ["d"], ["x"], ["x"])


def test_custom_reward_paths_in_verls_forms(custom_file, tmp_path, monkeypatch):
    """verl's load_module reads file:///abs/x.py and pkg://package.module (slashes or dots)."""
    assert load_custom_reward_fn("file://" + custom_file, "boolean")("d", "4", "4") is True
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("pkg://mypkg.scores", "pkg://mypkg/scores"):
        fn = load_custom_reward_fn(path, "boolean")
        assert fn.__module__ == "mypkg.scores" and fn("d", "4", "5") is False
    with pytest.raises(RewardError, match=r"custom reward file not found: /nope/x\.py \(looking for function 'f'\)"):
        load_custom_reward_fn("file:///nope/x.py", "f")
    with pytest.raises(RewardError, match=r"custom reward module mypkg\.missing \(pkg://mypkg/missing\) cannot be "
                                          r"imported.*ModuleNotFoundError: No module named 'mypkg\.missing'"):
        load_custom_reward_fn("pkg://mypkg/missing")
    with pytest.raises(RewardError, match=r"custom reward module pkg://mypkg\.scores has no function 'nope' "
                                          r"\(it defines: .*'boolean'"):
        load_custom_reward_fn("pkg://mypkg.scores", "nope")


def test_score_responses_numbers_bools_and_extras(custom_file):
    scores, extras, others = score_responses(
        default_compute_score, ["meshppo/demo_add", "openai/gsm8k", "meshppo/demo_add"],
        ["5", "#### 9", "6"], ["5", "9", "5"], [None, {}, None])
    assert scores == [1.0, 1.0, 0.0] and extras == {} and others == {}

    scores, extras, others = score_responses(load_custom_reward_fn(custom_file, "boolean"), ["d"] * 2, ["a", "b"],
                                             ["a", "a"])
    assert scores == [1.0, 0.0] and all(type(s) is float for s in scores) and extras == others == {}

    scores, extras, others = score_responses(load_custom_reward_fn(custom_file), ["d"] * 2, ["ab", "c"], ["ab", "x"],
                                             None)
    # Numeric extras become metrics; the string "pred" goes to the dumps only.
    assert scores == [1.0, 0.0] and extras == {"length": [2.0, 1.0]} and others == {"pred": ["ab", "c"]}

    fn = load_custom_reward_fn(custom_file, "with_info")
    scores, _, _ = score_responses(fn, ["d"] * 2, ["a", "a"], ["a", "a"], [{"weight": 0.5}, {"weight": 2}])
    assert scores == [0.5, 2.0]


def test_reward_functions_are_called_by_keyword_as_verl_calls_them(custom_file):
    """verl calls compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...): a
    function with its parameters in another order, or taking **kwargs, gets each value by name."""
    # called positionally, "reordered" would compare the data source "d" with the response: 0.0 for all
    scores, _, _ = score_responses(load_custom_reward_fn(custom_file, "reordered"), ["d"] * 2, ["42", "7"], ["42", "42"])
    assert scores == [1.0, 0.0]
    scores, extras, _ = score_responses(load_custom_reward_fn(custom_file, "keywords_only"), ["ab", "abc"],
                                        ["42", "7"], ["42", "42"])
    assert scores == [1.0, 0.0] and extras == {"source_len": [2.0, 3.0]}
    # numpy's bools (np.isclose) are scores as Python's are
    scores, _, _ = score_responses(load_custom_reward_fn(custom_file, "numpy_bool"), ["d"] * 2, ["1.0", "2"], ["1", "3"])
    assert scores == [1.0, 0.0] and all(type(s) is float for s in scores)
    # a function that cannot take verl's keywords is refused when it is loaded, before any rollout
    with pytest.raises(RewardError, match=r"'positional_names' in custom reward file .*my_reward\.py cannot be called "
                                          r"as a reward function: it is called by keyword, fn\(data_source=\.\.\., "
                                          r"solution_str=.*\(ds, response, truth, info=None\)"):
        load_custom_reward_fn(custom_file, "positional_names")


def test_score_responses_takes_tensors_and_gives_verls_extra_info():
    """A 0-d tensor is a score (verl assigns it to the reward slot); extra_info carries verl's num_turns (2 for
    single-turn generation), tool_rewards and turn_scores ([], as verl 0.9.1's single-turn agent loop sets them)
    and rollout_reward_scores ({}), on a copy of the row's dict."""
    import numpy as np
    import torch

    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        if solution_str == "w":
            return {"score": torch.tensor(True), "z": torch.tensor(3)}
        return {"x": torch.tensor(0.5), "y": np.array(2.0)}[solution_str]

    row_info = {"index": 4}
    scores, extras, _ = score_responses(fn, ["d"] * 3, ["x", "y", "w"], ["", "", ""], [row_info, None, row_info])
    assert scores == [0.5, 2.0, 1.0] and all(type(x) is float for x in scores) and list(extras) == ["z"]
    assert math.isnan(extras["z"][0]) and math.isnan(extras["z"][1]) and extras["z"][2] == 3.0
    turn_fields = {"num_turns": 2, "tool_rewards": [], "turn_scores": [], "rollout_reward_scores": {}}
    assert seen == [{"index": 4, **turn_fields}, turn_fields, {"index": 4, **turn_fields}]
    # a multi-turn rollout's own counts and rewards are kept
    score_responses(fn, ["d"], ["x"], [""], [{"num_turns": 4, "tool_rewards": [0.5], "turn_scores": [0.25]}])
    assert seen[-1] == {"num_turns": 4, "tool_rewards": [0.5], "turn_scores": [0.25], "rollout_reward_scores": {}}
    assert row_info == {"index": 4}  # the dataset's dict is untouched
    with pytest.raises(RewardError, match=r"returned Tensor tensor\(\[1\., 2\.\]\) on sample 0"):
        score_responses(lambda **kw: torch.tensor([1.0, 2.0]), ["d"], ["x"], [""])


def test_score_responses_extras_missing_in_some_samples_are_nan():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1, "late": 3} if solution_str == "late" else {"score": 0, "early": 1}

    scores, extras, _ = score_responses(fn, ["d"] * 3, ["early", "late", "early"], ["", "", ""])
    assert scores == [0.0, 1.0, 0.0]
    assert extras["early"][0] == 1.0 and math.isnan(extras["early"][1]) and extras["early"][2] == 1.0
    assert math.isnan(extras["late"][0]) and extras["late"][1] == 3.0 and math.isnan(extras["late"][2])


def test_score_responses_returns_the_other_extras_as_returned():
    """Extras that are not numbers (verl's dumps carry every key of a dict result) come back as the
    function returned them, aligned with the samples, None where a sample did not return the key;
    the numeric extras (the metrics) are as they were, and a key of both kinds is in both."""
    parsed, meta = [1, 2], {"steps": ["a", "b"]}

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "a":
            return {"score": 1.0, "pred": "42", "format_ok": True, "parsed": parsed, "meta": meta, "why": None,
                    "conf": 0.5, "mixed": 3}
        if solution_str == "b":
            return {"score": 0.0, "pred": "", "format_ok": False, "mixed": "n/a", "late": "x"}
        return 0.5  # a plain score: no extras at all

    scores, extras, others = score_responses(fn, ["d"] * 3, ["a", "b", "c"], ["", "", ""])
    assert scores == [1.0, 0.0, 0.5]
    assert list(others) == ["pred", "parsed", "meta", "why", "mixed", "late"]  # the function's order
    assert others["pred"] == ["42", "", None] and others["why"] == [None, None, None]
    assert others["parsed"][0] is parsed and others["meta"][0] is meta and others["parsed"][1:] == [None, None]
    assert others["mixed"] == [3, "n/a", None] and others["late"] == [None, "x", None]
    # the metrics as before: bools and numbers only, NaN where a sample gave none
    assert list(extras) == ["format_ok", "conf", "mixed"]
    assert extras["format_ok"][:2] == [1.0, 0.0] and extras["conf"][0] == 0.5 and extras["mixed"][0] == 3.0
    assert all(math.isnan(x) for x in (extras["format_ok"][2], *extras["conf"][1:], *extras["mixed"][1:]))


def test_score_responses_extras_keep_the_functions_key_order():
    """New keys in the order the function returned them (not a set's order, which varies by process)."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "zeta": 1.0, "alpha": 2.0, "mid": 3.0}

    for _ in range(3):
        assert list(score_responses(fn, ["d"] * 2, ["a", "b"], ["", ""])[1]) == ["zeta", "alpha", "mid"]


def test_score_responses_errors(custom_file):
    line = CUSTOM.splitlines().index('        raise KeyError("boom")') + 1
    with pytest.raises(RewardError, match=r"reward function broken raised on sample 1 \(data_source='gsm'\) "
                                          rf"at .*my_reward\.py:{line}: KeyError: 'boom'") as info:
        score_responses(load_custom_reward_fn(custom_file, "broken"), ["d", "gsm"], ["ok", "boom"], ["", ""])
    assert isinstance(info.value.__cause__, KeyError)
    # an error inside a library the function calls: the user's calling line is named
    line = CUSTOM.splitlines().index("    return math.sqrt(-1.0)") + 1
    with pytest.raises(RewardError, match=rf"calls_library raised on sample 0 .* at .*my_reward\.py:{line}: "
                                          r"ValueError: math domain error"):
        score_responses(load_custom_reward_fn(custom_file, "calls_library"), ["d"], ["x"], ["x"])
    with pytest.raises(RewardError, match=r"wrong_type returned str '1\.0' on sample 0 .*expected a number"):
        score_responses(load_custom_reward_fn(custom_file, "wrong_type"), ["d"], ["x"], ["x"])
    with pytest.raises(RewardError, match=r"not_finite returned non-finite score nan on sample 0"):
        score_responses(load_custom_reward_fn(custom_file, "not_finite"), ["d"], ["x"], ["x"])
    with pytest.raises(RewardError, match=r"no_score returned a dict without a 'score' key on sample 0 .*\['acc'\]"):
        score_responses(load_custom_reward_fn(custom_file, "no_score"), ["d"], ["x"], ["x"])
    with pytest.raises(RewardError, match=r"rewards\.registry\.default_compute_score raised on sample 0 "
                                          r"\(data_source='unknown/x'\)"):
        score_responses(default_compute_score, ["unknown/x"], ["x"], ["x"])
    with pytest.raises(ValueError, match="inputs of one length"):
        score_responses(default_compute_score, ["d"], ["x", "y"], ["x", "y"])
