"""Verifiable math reward: answer formats, routing, hostile inputs, timeouts, verl loading."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recipe_hacpo.reward import answer_extraction as ax
from recipe_hacpo.reward import compute_score, equivalence, timeouts
from recipe_hacpo.reward.math_reward import DEFAULT_TIMEOUT_S, spec_for

REWARD_FILE = Path(__file__).resolve().parents[1] / "reward" / "math_reward.py"
RESULT_KEYS = {"score", "acc", "pred", "reason"}
SLOW = "\\boxed{9^{9^{9^{9}}}}"  # sympy keeps evaluating this far past any sane budget


def _check_result(result: dict) -> None:
    assert set(result) == RESULT_KEYS
    assert isinstance(result["score"], float) and result["score"] in (0.0, 1.0)
    assert isinstance(result["acc"], float) and result["acc"] == result["score"]
    assert isinstance(result["pred"], str) and len(result["pred"]) <= 200
    assert isinstance(result["reason"], str) and result["reason"]


_MATRIX = "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"

# (data_source, response, ground truth, expected correct)
FORMAT_TABLE = [
    # fractions
    ("math", "So $x = \\boxed{\\frac{1}{2}}$.", "0.5", True),
    ("math", "\\boxed{0.5}", "\\frac{1}{2}", True),
    ("math", "\\boxed{1/2}", "\\dfrac{1}{2}", True),
    ("math", "\\boxed{\\dfrac{1}{3}}", "\\frac13", True),
    ("math", "\\boxed{\\frac{2}{3}}", "\\frac{1}{2}", False),
    # LaTeX expressions, sqrt, pi
    ("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("math", "\\boxed{x^2+1}", "1+x^2", True),
    ("math", "\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", True),
    ("math", "\\boxed{2\\pi}", "2\\pi", True),
    ("math", "\\boxed{\\pi}", "2\\pi", False),
    ("math", "\\boxed{3\\sqrt{2}}", "2\\sqrt{3}", False),
    # thousands separators
    ("math", "\\boxed{1,234}", "1234", True),
    ("math", "\\boxed{1234}", "1,234", True),
    ("math", "\\boxed{1{,}000{,}000}", "1000000", True),
    ("math", "\\boxed{1,235}", "1234", False),
    # intervals
    ("math", "\\boxed{(0, 1]}", "(0,1]", True),
    ("math", "\\boxed{[0,1]}", "(0,1]", False),
    ("math", "\\boxed{(-\\infty, 2)}", "(-\\infty,2)", True),
    # units, currency, degrees, text
    ("math", "\\boxed{5\\text{ cm}}", "5", True),
    ("math", "\\boxed{\\$5}", "5", True),
    ("math", "\\boxed{5}", "\\$5", True),
    ("math", "\\boxed{90^\\circ}", "90", True),
    ("math", "\\boxed{90}", "90^{\\circ}", True),
    ("math", "\\boxed{18 dollars}", "18", True),
    ("math", "\\boxed{6\\text{ cm}}", "5", False),
    ("HuggingFaceH4/MATH-500", "\\boxed{\\text{(C)}}", "\\text{(C)}", True),
    # percentages
    ("math", "\\boxed{50\\%}", "50", True),
    ("math", "\\boxed{50}", "50\\%", True),
    ("math", "\\boxed{40\\%}", "50\\%", False),
    # negative numbers
    ("math", "\\boxed{-3}", "-3", True),
    ("math", "\\boxed{3}", "-3", False),
    ("lighteval/MATH", "\\boxed{-\\frac{1}{2}}", "-0.5", True),
    # nested braces, escaped braces, boxes in boxes, \fbox, bare \boxed
    ("math", "\\boxed{\\frac{\\sqrt{\\frac{1}{4}}}{2}}", "\\frac{1}{4}", True),
    ("math", "\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
    ("math", "\\boxed{\\boxed{5}}", "5", True),
    ("math", "Hence \\fbox{7}.", "7", True),
    ("math", "The answer is $\\boxed 7$.", "7", True),
    ("math", "first \\boxed{3}, corrected: \\boxed{4}", "4", True),
    ("math", "\\boxed{4}, no wait \\boxed{3}", "4", False),
    # ground truth given boxed
    ("math", "\\boxed{7}", "\\boxed{7}", True),
    ("math", "\\boxed{7}", "The answer is $\\boxed{8}$.", False),
    # GSM8K: #### in ground truth and in responses
    ("openai/gsm8k", "48 + 24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", True),
    ("gsm8k", "#### 1,234", "1234", True),
    ("gsm8k", "The answer is \\boxed{18}.", "#### 18", True),
    ("gsm8k", "#### $18.00", "#### 18", True),
    ("gsm8k", "\\boxed{17}\nActually\n#### 18", "#### 18", True),
    ("GSM8K_test", "#### 17", "#### 18", False),
    ("gsm8k", "the answer is 18", "#### 18", False),
    # synthetic arithmetic: boxed else last integer, exact strings (leading zeros matter)
    ("hacpo/arith", "so the answer is 0579", "0579", True),
    ("hacpo/arith", "so the answer is 579", "0579", False),
    ("hacpo/arith_mul", "\\boxed{0579} and then 12", "0579", True),
    ("hacpo/arith", "\\boxed{ 05 79 }", "\\boxed{0579}", True),
    ("hacpo/arith", "12-0579", "0579", True),
    ("hacpo/arith", "x = -42", "-42", True),
    ("hacpo/arith", "\\boxed{0579.0}", "0579", False),
    # competition sets and unknown sources
    ("aime25", "\\boxed{033}", "33", True),
    ("AIME_2024", "\\boxed{34}", "33", False),
    ("amc23", "\\boxed{27}", "27.0", True),
    ("minerva_math", "\\boxed{3.0 \\times 10^{8}}", "3\\times10^8", True),
    ("olympiadbench", "\\boxed{x=2}", "2", True),
    ("olympiadbench", "\\boxed{" + _MATRIX.replace(" ", "") + "}", _MATRIX, True),
    ("some/new_dataset", "\\boxed{\\frac12}", "0.5", True),
    ("some/new_dataset", "the answer is 0.5", "0.5", False),
]


@pytest.mark.parametrize("data_source,response,ground_truth,expected", FORMAT_TABLE)
def test_answer_formats(data_source, response, ground_truth, expected):
    result = compute_score(data_source, response, ground_truth)
    _check_result(result)
    assert (result["score"] == 1.0) is expected, result
    assert (result["reason"] == "correct") is expected, result


def test_format_table_size():
    assert len(FORMAT_TABLE) >= 30
    assert sum(1 for row in FORMAT_TABLE if not row[3]) >= 10


@pytest.mark.parametrize(
    "data_source,family",
    [
        ("math", "math"),
        ("lighteval/MATH", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("openai/gsm8k", "gsm8k"),
        ("GSM8K", "gsm8k"),
        ("aime25", "aime"),
        ("AIME2024", "aime"),
        ("amc23", "amc"),
        ("minerva", "minerva"),
        ("minerva_math", "minerva"),
        ("OlympiadBench", "olympiadbench"),
        ("hacpo/arith", "arith"),
        ("hacpo/arith_add_3digit", "arith"),
        ("prefix/hacpo/arith", "default"),
        ("unknown/source", "default"),
        (None, "default"),
        (123, "default"),
    ],
)
def test_routing(data_source, family):
    assert spec_for(data_source).family == family


@pytest.mark.parametrize(
    "response,reason",
    [
        ("I have no idea.", "no_boxed_answer"),
        ("the answer is \\boxed{5", "no_boxed_answer"),
        ("\\boxed{}", "no_boxed_answer"),
        ("\\boxed{3} and finally \\boxed{", "no_boxed_answer"),
        ("\\boxed{" + "1+" * 2000 + "1}", "answer_too_long"),
        ("\\boxed{" + "\\frac{" * 40 + "1" + "}{2}" * 40 + "}", "answer_too_complex"),
        ("\\boxed{2}", "mismatch"),
        ("\\boxed{@@@}", "parse_error"),
    ],
)
def test_failure_reasons(response, reason):
    result = compute_score("math", response, "1")
    _check_result(result)
    assert result["score"] == 0.0
    assert result["reason"] == reason


def test_no_answer_reasons_for_non_boxed_sources():
    assert compute_score("gsm8k", "no number here", "#### 3")["reason"] == "no_answer"
    assert compute_score("hacpo/arith", "no digits", "12")["reason"] == "no_answer"
    assert compute_score("math", "\\boxed{1}", "")["reason"] == "empty_ground_truth"


def test_ground_truth_variants():
    assert compute_score("math", "\\boxed{2}", ["1", "2"])["score"] == 1.0
    assert compute_score("math", "\\boxed{2}", np.array(["1", "3"], dtype=object))["score"] == 0.0
    assert compute_score("math", "\\boxed{12}", 12)["score"] == 1.0
    assert compute_score("math", b"\\boxed{12}", "12")["score"] == 1.0
    assert compute_score("math", None, "12")["reason"] == "no_boxed_answer"


def test_extraction_helpers():
    assert ax.last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert ax.last_boxed("\\boxedx{1} \\boxed{2} \\boxedfoo") == "2"
    assert ax.last_boxed("\\boxed{\\}}") == "\\}"
    assert ax.last_boxed("\\fbox{a} \\boxed {b}") == "b"
    assert ax.last_boxed("$\\boxed 12$ apples") == "12"
    assert ax.last_boxed("no box") is None
    assert ax.unwrap_boxed("\\boxed{\\fbox{3}}") == "3"
    assert ax.unwrap_boxed("\\boxed{3}+\\boxed{4}") == "\\boxed{3}+\\boxed{4}"
    assert ax.hash_answer("x\n#### 1,234\n") == "1,234"
    assert ax.first_number("$1,234.50 total") == "1234.50"
    assert ax.last_integer("a 007 b 0579.") == "0579"
    assert ax.last_integer("(3)-5") == "5"
    assert ax.ground_truth_answer("...\n#### 1,234") == "1234"
    assert ax.ground_truth_answer(" \\boxed{\\frac{1}{2}} ") == "\\frac{1}{2}"
    assert ax.ground_truth_answer("(0, 1]") == "(0, 1]"
    assert equivalence.brace_depth("{{\\{}}") == 2


def test_answer_is_taken_from_the_tail_only():
    filler = "x" * 200_000
    assert compute_score("math", "\\boxed{5}" + filler, "5")["reason"] == "no_boxed_answer"
    assert compute_score("math", filler + "\\boxed{5}", "5")["score"] == 1.0


HOSTILE = [
    "a" * 200_000,
    "\\boxed{" + "x" * 200_000 + "}",
    "{" * 10_000,
    "}" * 10_000,
    "\\boxed{" + "{" * 10_000,
    "\\boxed{" + "}" * 10_000,
    "\\boxed{" + "{" * 5_000 + "}" * 5_000 + "}",
    "\\boxed{" * 10_000,
    "\\boxedx" * 20_000,
    "\\boxed{" + "\\frac{" * 2_000 + "1" + "}{2}" * 2_000 + "}",
    "\\boxed{" + "\\frac{" * 14 + "1" + "}{2}" * 14 + "}",
    "\\boxed{" + "\\sqrt{" * 16 + "2" + "}" * 16 + "}",
    "\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(130)) + "}",
    SLOW,
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{(10^{8})!}",
    "\\boxed{",
    "\\boxed",
    "\\fbox{",
    "####",
    "#### " + "9" * 100_000,
    "\\boxed{" + "9" * 900 + "}",
    "\x00" * 100_000,
    "\\boxed{1\x00}",
    "\\boxed{\u202e1\u202c}\u200f\u200e",
    "\\boxed{１}",
    "答案是 \\boxed{一}",
    "\\boxed{😀🚀}" * 1000,
    "\\boxed{\ud800}",
    "\\boxed{\\text{" + "é" * 500 + "}}",
    "$" * 50_000 + "\\boxed{$$$}",
    "\\boxed{\\begin{pmatrix}" + "1&" * 300 + "1\\end{pmatrix}}",
    "\\boxed{\\left(\\right.}",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{0/0}",
    "\\boxed{\\infty - \\infty}",
    "\\boxed{x=y=z=}",
    "\\boxed{\\\\\\\\}",
]


@pytest.mark.parametrize("source", ["math", "gsm8k", "hacpo/arith"])
def test_hostile_inputs_never_raise_and_are_bounded(source):
    budget = 1.5
    for text in HOSTILE:
        for gold in ("1", text[:2000]):
            start = time.monotonic()
            result = compute_score(source, text, gold, timeout_s=budget)
            elapsed = time.monotonic() - start
            _check_result(result)
            assert elapsed < budget + 1.0, (text[:60], source, elapsed, result)


def test_default_timeout_bounds_a_hopeless_sample():
    start = time.monotonic()
    result = compute_score("math", SLOW, "1")
    elapsed = time.monotonic() - start
    assert result["reason"] == "timeout"
    assert DEFAULT_TIMEOUT_S - 0.5 < elapsed < DEFAULT_TIMEOUT_S + 1.0


def test_slow_comparison_times_out_on_main_thread():
    start = time.monotonic()
    result = compute_score("math", SLOW, "1", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result["reason"] == "timeout" and result["score"] == 0.0
    assert elapsed < 2.0
    assert compute_score("math", "\\boxed{1}", "1", timeout_s=1.0)["score"] == 1.0


def test_alarm_restores_outer_timer_and_handler():
    import signal

    fired = []

    def outer(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        compute_score("math", SLOW, "1", timeout_s=0.5)
        assert signal.getsignal(signal.SIGALRM) is outer
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.0 < remaining <= 1.0
        time.sleep(remaining + 0.2)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _in_thread(fn, *args, **kwargs):
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # pragma: no cover - surfaced by the assert below
            box["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert "error" not in box, box.get("error")
    return box["value"]


def test_off_main_thread_works_and_times_out_cleanly():
    assert _in_thread(compute_score, "math", "\\boxed{\\dfrac{1}{2}}", "0.5")["score"] == 1.0

    start = time.monotonic()
    result = _in_thread(compute_score, "math", SLOW, "1", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result["reason"] == "timeout" and result["score"] == 0.0
    assert elapsed < 1.0 + timeouts.KILL_GRACE_S + 1.0

    # the stuck worker was stopped and the pool still answers
    assert _in_thread(compute_score, "math", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}")["score"] == 1.0
    pool = timeouts.get_pool(os.path.abspath(equivalence.__file__))
    assert pool._idle
    assert all(w.proc.poll() is None for w in pool._idle)


_STUCK_MODULE = """
import os


def stuck(pid_file):
    with open(pid_file, "w") as fh:
        fh.write(str(os.getpid()))
    # one long C loop: the interpreter never gets a chance to run a signal handler
    return sum(range(10**12))


def quick(x):
    return x + 1
"""


def test_worker_stuck_in_c_code_is_killed(tmp_path):
    import importlib.util

    path = tmp_path / "stuck_target.py"
    path.write_text(_STUCK_MODULE)
    spec = importlib.util.spec_from_file_location("stuck_target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert timeouts.run_bounded(module, "quick", [1], 5.0, "process").value == 2

    pid_file = tmp_path / "pid"
    start = time.monotonic()
    outcome = timeouts.run_bounded(module, "stuck", [str(pid_file)], 0.5, "process")
    elapsed = time.monotonic() - start
    assert outcome.status == "timeout"
    assert elapsed < 0.5 + timeouts.KILL_GRACE_S + 0.5
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert timeouts.run_bounded(module, "quick", [2], 5.0, "process").value == 3
    timeouts.get_pool(str(path)).close()


def test_falls_back_to_a_thread_when_workers_cannot_start(tmp_path, monkeypatch):
    import importlib.util
    import sys

    path = tmp_path / "quick_target.py"
    path.write_text(_STUCK_MODULE)
    spec = importlib.util.spec_from_file_location("quick_target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    for n in range(timeouts.MAX_START_FAILURES + 1):
        assert timeouts.run_bounded(module, "quick", [n], 2.0, "process").value == n + 1
    pool = timeouts.get_pool(str(path))
    assert not pool.usable
    pool.close()


def test_concurrent_threads_get_their_own_answers():
    cases = [(f"\\boxed{{\\frac{{{n}}}{{2}}}}", str(n / 2), True) for n in range(1, 9)]
    cases += [(f"\\boxed{{{n}\\sqrt{{2}}}}", f"{n + 1}\\sqrt{{2}}", False) for n in range(1, 9)]
    results = [None] * len(cases)

    def run(i):
        response, gold, _ = cases[i]
        results[i] = compute_score("math", response, gold)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (_, _, expected), result in zip(cases, results):
        _check_result(result)
        assert (result["score"] == 1.0) is expected


def test_soft_thread_and_inline_isolation():
    assert compute_score("math", "\\boxed{1/2}", "0.5", isolation="inline")["score"] == 1.0
    assert compute_score("math", "\\boxed{1/2}", "0.5", isolation="thread")["score"] == 1.0


def test_invalid_settings_are_errors_not_defaults():
    with pytest.raises(ValueError, match=r"^isolation='bogus': must be one of auto, process, thread, inline$"):
        compute_score("math", "\\boxed{1/2}", "0.5", isolation="bogus")
    for odd_timeout in ("nan?", float("inf"), float("nan"), -1, 0, None, 1e300):
        with pytest.raises(ValueError, match=r"^timeout_s=.*: must be a number of seconds in \(0, 600\]$"):
            compute_score("math", "\\boxed{1/2}", "0.5", timeout_s=odd_timeout)
    with pytest.raises(ValueError, match="isolation='sometimes'"):
        timeouts.run_bounded(equivalence, "equivalent", ["1", "1"], 1.0, "sometimes")
    assert compute_score("math", "\\boxed{1/2}", "0.5", timeout_s="2.5")["score"] == 1.0


_FRAGMENTS = st.sampled_from(
    [
        "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "\\frac", "\\sqrt", "^", "_", "\\", "$", "####",
        "\\%", "\\text{", "\\left(", "\\right)", ",", ".", "-", "1", "0579", "2", "x", "=", " ", "\n",
        "\\pi", "\\infty", "(", "]", "\\{", "\\}", "\x00", "\u202e", "😀",
    ]
)
_HOSTILE_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(_FRAGMENTS, st.text(max_size=5)), max_size=60).map("".join),
)
_BOXED_TEXT = st.lists(st.one_of(_FRAGMENTS, st.text(max_size=3)), max_size=30).map(
    lambda parts: "\\boxed{" + "".join(parts).replace("{", "").replace("}", "") + "}"
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    source=st.sampled_from(["math", "gsm8k", "hacpo/arith", "aime25", "", "weird\x00source"]),
    response=st.one_of(_HOSTILE_TEXT, _BOXED_TEXT),
    gold=st.one_of(_HOSTILE_TEXT, _BOXED_TEXT, st.integers(), st.none()),
)
def test_property_arbitrary_text_never_raises(source, response, gold):
    start = time.monotonic()
    result = compute_score(source, response, gold, timeout_s=1.0)
    assert time.monotonic() - start < 2.5
    _check_result(result)
    assert 0.0 <= result["score"] <= 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_property_integers_match_their_formats(n):
    formatted = f"{n:,}"
    assert compute_score("gsm8k", f"#### {formatted}", f"#### {n}")["score"] == 1.0
    assert compute_score("math", f"\\boxed{{{formatted}}}", str(n))["score"] == 1.0
    assert compute_score("math", f"\\boxed{{{n + 1}}}", str(n))["score"] == 0.0


def test_results_stack_like_verl_reward_loop():
    rows = [("math", "\\boxed{1}", "1"), ("math", "nothing", "1"), ("gsm8k", "#### 3", "4"), ("hacpo/arith", "7", "7")]
    infos = [compute_score(*row) for row in rows]
    keys = list(infos[0])
    columns = {key: np.array([info[key] for info in infos]) for key in keys}
    assert columns["score"].dtype.kind == "f" and columns["acc"].dtype.kind == "f"
    assert float(np.mean(columns["acc"])) == 0.5
    assert columns["pred"].dtype.kind == "U" and columns["reason"].dtype.kind == "U"


def test_verl_loads_the_function_by_path_and_name():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": str(REWARD_FILE),
                    "name": "compute_score",
                    "reward_kwargs": {"timeout_s": 3.0},
                }
            }
        }
    )
    fn = get_custom_reward_fn(config)
    assert fn is not None
    extra_info = {"num_turns": None, "rollout_reward_scores": {}}
    result = fn(
        data_source="HuggingFaceH4/MATH-500",
        solution_str="Thus $\\boxed{\\dfrac{3}{4}}$.",
        ground_truth="0.75",
        extra_info=extra_info,
        reward_router_address="127.0.0.1:1",
        reward_model_tokenizer=None,
    )
    assert result["score"] == 1.0 and set(result) == RESULT_KEYS


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def test_verl_naive_reward_manager_scores_from_its_executor():
    """verl's reward loop runs a sync reward function in an executor thread (not main)."""
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create(
        {"reward": {"custom_reward_function": {"path": str(REWARD_FILE), "name": "compute_score"}}}
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        manager = NaiveRewardManager(config, _CharTokenizer(), get_custom_reward_fn(config))
        outputs = []
        for response, gold in [("so \\boxed{0.75}", "\\frac34"), ("so \\boxed{2}", "3")]:
            ids = torch.tensor([ord(c) for c in response])
            prompt = torch.tensor([ord("q")] * 3)
            data = DataProto.from_dict(
                tensors={
                    "prompts": prompt[None],
                    "responses": ids[None],
                    "attention_mask": torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
                },
                non_tensors={
                    "data_source": np.array(["math"], dtype=object),
                    "reward_model": np.array([{"ground_truth": gold}], dtype=object),
                    "extra_info": np.array([{}], dtype=object),
                },
            )
            outputs.append(loop.run_until_complete(manager.run_single(data)))
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert [o["reward_score"] for o in outputs] == [1.0, 0.0]
    assert outputs[1]["reward_extra_info"]["reason"] == "mismatch"
