"""Response parsers (MEGA-Bench's answer_string, json, raw), with hand-worked responses."""

from __future__ import annotations

import pytest

from mmrl.eval.parsers import (
    extract_answer_content,
    extract_code_block,
    first_paragraph_if_short,
    parse_answer_string,
    parse_json_response,
    parse_json_value,
    parse_response,
    unquote,
)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The shapes are red. Answer: 4", "4"),
        ("Answer: 3\nwait, no.\nAnswer: 5", "5"),  # the last Answer: wins
        ("answer: yes", "yes"),  # any case
        ("**Answer:** B", "B"),  # bold marker (MEGA-Bench's regex reads "" here)
        ("**Answer: C** because it is larger", "C"),
        ("no marker at all  ", "no marker at all"),
    ],
)
def test_answer_content_is_what_follows_the_last_answer_marker(response, expected):
    assert extract_answer_content(response) == expected


def test_code_block_content_is_unwrapped():
    assert extract_code_block("```python\nprint(1)\n```") == ("print(1)", True)
    assert extract_code_block("```\n[1, 2]\n```") == ("[1, 2]", True)
    assert extract_code_block("plain") == ("plain", False)


def test_short_first_paragraph_is_the_answer_only_when_set_off_by_a_blank_line():
    assert first_paragraph_if_short("B\n\nBecause the dog is brown.") == "B"
    assert first_paragraph_if_short("(B)\n\nexplanation") == "(B)"
    assert first_paragraph_if_short("a, b, c\n\nthe three") == "a, b, c"
    # A multi-line first paragraph is a multi-line answer: kept whole.
    assert first_paragraph_if_short("line one\nline two\n\nmore") == "line one\nline two\n\nmore"
    # Not a short answer (starts with a symbol).
    assert first_paragraph_if_short("$x$\n\nmore") == "$x$\n\nmore"


def test_answer_string_parser_end_to_end():
    # Single-line reference: the short first paragraph after the marker.
    assert parse_answer_string("Reasoning...\nAnswer: B\n\nThe dog is brown.", "A").fields == {"A": "B"}
    # Multi-line reference: the whole content is kept.
    multi = parse_answer_string("Answer: B\n\nThe dog is brown.", "A", single_line=False)
    assert multi.fields == {"A": "B\n\nThe dog is brown."}
    # A quoted string loses its quotes; a list goes through as its Python repr.
    assert parse_answer_string("Answer: 'tree'", "A").fields == {"A": "tree"}
    assert parse_answer_string('Answer: ["a", "b"]', "A").fields == {"A": "['a', 'b']"}
    # A bracket that does not parse stays raw text.
    assert parse_answer_string("Answer: [1, 2", "A").fields == {"A": "[1, 2"}
    # An explicit empty list is a real answer.
    assert parse_answer_string("Answer: []", "A").fields == {"A": "[]"}
    # Code block after the marker.
    assert parse_answer_string("Answer:\n```\n[[0.1, 0.2, 0.3, 0.4]]\n```", "A").fields == {
        "A": "[[0.1, 0.2, 0.3, 0.4]]"
    }


def test_json_value_is_the_last_valid_object_tolerating_fences_single_quotes_and_python():
    assert parse_json_value('first {"a": 1} then {"a": 2}') == {"a": 2}
    assert parse_json_value('```json\n{"x": [1, 2]}\n```') == {"x": [1, 2]}
    assert parse_json_value("{'name': 'Bob', 'ok': True}") == {"name": "Bob", "ok": True}
    assert parse_json_value("{'name': 'Bob', 'ok': true}") == {"name": "Bob", "ok": True}
    # A broken outer object still yields the valid object nested in it.
    assert parse_json_value('{"outer": {"inner": 1}, oops}') == {"inner": 1}
    assert parse_json_value("Answer: [1, 2, 3]") == [1, 2, 3]
    assert parse_json_value("nothing here") is None


def test_json_parser_reads_fields_and_falls_back_to_raw_when_malformed():
    ok = parse_json_response('Sure: {"A": 3, "B": "\'x\'"}', ["A", "B"])
    assert ok.parse_ok and ok.fields == {"A": 3, "B": "x"}
    bad = parse_json_response('{"A": 3, "B": ', ["A", "B"])
    assert not bad.parse_ok
    assert bad.fields == {"A": '{"A": 3, "B": ', "B": '{"A": 3, "B": '}
    # A list is not an object: raw fallback too.
    assert not parse_json_response("[1, 2]", ["A"]).parse_ok
    # An empty object is a failed parse as well (MEGA-Bench).
    assert not parse_json_response("{}", ["A"]).parse_ok


def test_dispatch_by_parser_name():
    answer = {"Answer": "B"}
    assert parse_response("Answer: B", "answer_string", answer, ["Answer"]).fields == {"Answer": "B"}
    assert parse_response("  raw text  ", "dummy", answer, ["Answer"]).fields == {"Answer": "raw text"}
    assert parse_response("  raw text  ", "raw", answer, ["Answer"]).fields == {"Answer": "raw text"}
    verbatim = parse_response("Answer:\n  x\n   y", "verbatim_answer_string", answer, ["Answer"])
    assert verbatim.fields == {"Answer": "  x\n   y"}
    with pytest.raises(ValueError, match="one answer field"):
        parse_response("x", "answer_string", {"a": 1, "b": 2}, ["a", "b"])
    with pytest.raises(ValueError, match="unknown response parser"):
        parse_response("x", "odd_one_out", answer, ["Answer"])


def test_unquote_only_unwraps_string_literals():
    assert unquote("'abc'") == "abc"
    assert unquote('"x"') == "x"
    assert unquote("[1, 2]") == "[1, 2]"
    assert unquote(5) == 5
    assert unquote("not a literal") == "not a literal"


def test_huge_responses_parse_promptly():
    # Many unmatched brackets: the scan is bounded, not quadratic without end.
    response = "[" * 50_000 + "Answer: 3"
    assert parse_json_response(response, ["A"]).parse_ok is False
    assert parse_answer_string("x" * 200_000 + " Answer: 7", "A").fields == {"A": "7"}
