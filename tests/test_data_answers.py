import pytest

from lightning_lazytrain.sft.data.answers import answers_match, extract_answer, normalize_answer, reference_answer


def test_extracts_last_answer_line():
    text = "First, 2 + 2 = 4. The answer is: 3\nWait. The answer is: 4\nDone"
    assert extract_answer(text) == "4"
    assert extract_answer("no answer here") is None
    assert extract_answer("the answer is 12.") == "12."


@pytest.mark.parametrize(("a", "b"), [("12", "12.0"), ("1,000", "1000"), ("$5$", "5"), ("\\boxed{7}", "7"),
                                      ("7.", "7"), (" x + 1 ", "x+1"), ("+3", "3")])
def test_normalisation_equates(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize(("a", "b"), [("12", "13"), ("1.5", "15"), ("-2", "2"), ("x", "y")])
def test_normalisation_distinguishes(a, b):
    assert normalize_answer(a) != normalize_answer(b)


def test_answers_match():
    assert answers_match("4 + 3 = 7. The answer is: 7", "7")
    assert not answers_match("4 + 3 = 7. The answer is: 8", "7")
    assert reference_answer("blah. The answer is: 42") == "42"
    assert reference_answer("free text") == "free text" and answers_match("free text", "free text")
