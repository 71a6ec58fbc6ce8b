from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcrl.reward.builtin import extract_answer, math_verify_reward, mod10


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [("7", "7", 1.0), (" 7 and more", "7", 1.0), ("\n7", "7", 1.0), ("8", "7", 0.0), ("", "7", 0.0), ("17", "7", 0.0)],
)
def test_mod10(completion, answer, reward):
    assert mod10("3+4=", completion, answer) == reward


def test_mod10_refuses_an_empty_answer():
    with pytest.raises(ValueError, match="reference answer is empty"):
        mod10("3+4=", "7", " ")


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "$\\frac{1}{2}$"),
        ("\\boxed{1} then \\boxed{x^{2}+1}", "$x^{2}+1$"),
        ("40 + 2 = 42\n#### 42", "42"),
        ("#### 1,000.\nthanks", "1,000"),
        ("I count 3 apples and 1,234 pears", "1234"),
        ("it is -3.5", "-3.5"),
        ("half: 1 / 2", "1 / 2"),
        ("no numbers here", None),
        ("48/2 = <<48/2=24>>24 in May, 48+24 = <<48+24=72>>72 in all.\n#### 72", "72"),  # a GSM8K solution
    ],
)
def test_extract_answer(text, found):
    assert extract_answer(text) == found


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("The answer is 0.5", "1/2"),
        ("The answer is 1/2", "0.5"),
        ("so \\boxed{\\frac{1}{2}}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("She pays 40 + 2 = 42 dollars.\n#### 42", "42"),
        ("#### 1,000", "1000"),
        ("\\boxed{x^2+1}", "1+x^2"),
        ("3", "Natalia sold 1 + 2 = 3 clips.\n#### 3"),
        ("3", "$\\boxed{3}$"),
        ("\\boxed{1,000}", "1000"),
        ("1000", "Betty saves 250 * 4 = <<250*4=1000>>1000.\n#### 1,000"),
        ("so \\boxed{72}", "48+24 = <<48+24=72>>72 clips.\n#### 72"),
        ("#### 0.5", "4/8 = <<4/8=0.5>>0.5 of it.\n#### 1/2"),
    ],
)
def test_math_verify_matches_equal_answers(completion, answer):
    assert math_verify_reward("", completion, answer) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("The answer is 0.6", "1/2"),
        ("#### 41", "42"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("13", "3"),
        ("I don't know", "42"),
        ("#### 71", "48+24 = <<48+24=72>>72 clips.\n#### 72"),
        ("48 is the first number", "48+24 = <<48+24=72>>72 clips.\n#### 72"),
        ("\\boxed{100}", "#### 1,000"),
    ],
)
def test_math_verify_rejects_wrong_or_missing_answers(completion, answer):
    assert math_verify_reward("", completion, answer) == 0.0


def test_math_verify_refuses_an_empty_reference():
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_verify_reward("", "3", "")


def test_math_verify_works_outside_the_main_thread():
    # math-verify's own SIGALRM timeouts only work in the main thread; elsewhere they are turned off
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verify_reward, "", "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0
