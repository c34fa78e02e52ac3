"""Response parsing as MEGA-Bench defines it: from a free-form response to per-field answers.

A task's `metric_info.response_parse_function` names the parser:

- `answer_string` (and `ascii_answer_string`, `verbatim_answer_string`): one answer field. The
  content after the **last** `Answer:` (bold `**Answer:** x` and `**Answer: x**` too; the whole
  response when there is none), the inside of a code block if it is wrapped in one, and, when the
  reference is a single line, only the first paragraph if that looks like a short answer
  (`B\\n\\nBecause ...` -> `B`). Content that starts with `{` or `[` is read as JSON/Python and
  passed on as the Python repr of the value; quoted strings lose their quotes.
- `json`: the **last** valid JSON object in the response, tolerant of code fences, single quotes
  and Python literals (`True`, `None`, tuples). When no object can be read, the raw response
  stands for every field (and the query records `parse_ok = False`).
- `dummy` / `raw`: the stripped response for every field.

Deliberate differences from MEGA-Bench's code, where it is a bug rather than a definition:
`**Answer:** B` reads `B` (theirs reads an empty string); see also `metrics.exact_str_match`.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

SINGLE_FIELD_PARSERS = ("answer_string", "ascii_answer_string", "verbatim_answer_string")
PARSERS = (*SINGLE_FIELD_PARSERS, "json", "dummy", "raw")
"""Every response parser name a task may give."""

MAX_JSON_CHARS = 100_000
"""Longest response scanned for JSON values (the scan is quadratic in the worst case)."""
MAX_JSON_CANDIDATES = 200
"""Most bracketed spans tried as JSON per response."""

_ANSWER = re.compile(r"answer:", re.IGNORECASE)
_CODE_BLOCK = re.compile(r"```[\w+-]*[ \t]*\n?(.*?)\s*```", re.DOTALL)
_SHORT_ANSWER = re.compile(r"^(?:[\w-]+(?:,\s*[\w-]+)*|[\w-]+\.|\([\w-]+\)$)")


@dataclass
class ParsedResponse:
    """The per-field answers read from one response."""

    fields: dict[str, Any]
    """Answer per field name (strings, or JSON values from the `json` parser)."""
    parse_ok: bool = True
    """False when the parser could not read the expected structure and fell back to the raw text."""


def extract_answer_content(response: str, strip: bool = True) -> str:
    """The text after the last `Answer:` (case-insensitive), bold markers removed; else all of it."""
    matches = list(_ANSWER.finditer(response))
    if not matches:
        return response.strip() if strip else response
    start = matches[-1].start()
    bold = response[:start].rstrip(" ").endswith("*")
    after = response[matches[-1].end() :]
    if after.startswith("*"):  # `**Answer:** x`: the bold closes right after the marker
        after = after.lstrip("*")
    elif bold and "*" in after:  # `**Answer: x**`: the answer ends where the bold does
        after = after[: after.index("*")]
    return after.strip() if strip else after.strip("\n")


def extract_code_block(text: str) -> tuple[str, bool]:
    """The inside of the first ``` code block (stripped) and True, or the text and False."""
    match = _CODE_BLOCK.search(text)
    if match is None:
        return text, False
    return match.group(1).strip(), True


def first_paragraph_if_short(text: str) -> str:
    """The first paragraph when it is a short answer (`B`, `B.`, `(B)`, `a, b`) set off by a
    blank line from what follows; else the text unchanged (MEGA-Bench's single-line heuristic)."""
    first = text.split("\n\n")[0].strip()
    if not first or not _SHORT_ANSWER.search(first):
        return text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip():
            # Single-line answer: the first non-empty line is followed by a blank line.
            if i + 1 < len(lines) and not lines[i + 1].strip():
                return first
            return text
    return text


def unquote(value: Any) -> Any:
    """A string holding a quoted Python string literal (`"'B'"`) becomes its content (`B`)."""
    if not isinstance(value, str):
        return value
    try:
        evaluated = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return evaluated if isinstance(evaluated, str) else value


def parse_answer_string(response: str | None, answer_key: str, single_line: bool = True) -> ParsedResponse:
    """MEGA-Bench's `answer_string` parser: one field, always a string."""
    content = extract_answer_content(response or "")
    content, is_code = extract_code_block(content)
    if not is_code and single_line:
        content = first_paragraph_if_short(content)
    if content.startswith(("{", "[")):
        value = parse_json_value(content)
        empty = value is None or value == {} or value == []
        if empty and "{}" not in content and "[]" not in content:
            return ParsedResponse({answer_key: content})
        return ParsedResponse({answer_key: str(value if value is not None else content)})
    return ParsedResponse({answer_key: unquote(content)})


def _after_answer_at_line_start(response: str) -> str:
    match = re.search(
        r"^(?:\*\*)?answer:(?:\*\*)?\s*(.+)", response, re.MULTILINE | re.IGNORECASE | re.DOTALL
    )
    return match.group(1).strip() if match else response.strip()


def _last_valid(text: str) -> Any:
    """The last bracketed span (`{...}` / `[...]`, matched by depth) that reads as a value.

    Top-level spans are tried right to left; when one does not read, the spans nested in it are
    tried (right to left) before the spans to its left. Linear bracket matching and a budget of
    `MAX_JSON_CANDIDATES` reads keep this prompt on hostile inputs.
    """
    close: dict[int, int] = {}
    parent_at_open: dict[int, int | None] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c == "{" or c == "[":
            parent_at_open[i] = stack[-1] if stack else None
            stack.append(i)
        elif (c == "}" or c == "]") and stack:
            close[stack.pop()] = i
    # Each span's parent is its nearest *matched* enclosing opening (memoised walk up).
    resolved: dict[int | None, int | None] = {None: None}

    def matched_parent(o: int | None) -> int | None:
        path = []
        while o not in resolved and o not in close:
            path.append(o)
            o = parent_at_open[o]
        result = o if o in close else resolved[o]
        for p in path:
            resolved[p] = result
        return result

    children: dict[int | None, list[int]] = {}
    for o in sorted(close):
        children.setdefault(matched_parent(parent_at_open[o]), []).append(o)
    todo = list(children.get(None, []))
    tried = 0
    while todo and tried < MAX_JSON_CANDIDATES:
        o = todo.pop()
        tried += 1
        value = _load_tolerant(text[o : close[o] + 1])
        if value is not None:
            return value
        todo.extend(children.get(o, []))
    return None


def _load_tolerant(span: str) -> Any:
    """JSON, then JSON with single quotes made double, then a Python literal; None if none reads."""
    try:
        return json.loads(span)
    except (json.JSONDecodeError, RecursionError):
        pass
    swapped = re.sub(r"(?<!\w)'|'(?!\w)", '"', span)
    try:
        return json.loads(swapped)
    except (json.JSONDecodeError, RecursionError):
        pass
    try:
        value = ast.literal_eval(span)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, (dict, list, tuple)) else None


def parse_json_value(response: str) -> Any:
    """The last valid JSON object or array in the response (fences, `Answer:` and single quotes
    tolerated); None when there is none."""
    text = _after_answer_at_line_start(response[:MAX_JSON_CHARS])
    fenced = re.search(r"```(?:json)?\s*\n*(.*?)\s*```", text, re.DOTALL)
    if fenced:
        text = fenced.group(1)
    return _last_valid(text)


def parse_json_response(response: str | None, fields: list[str]) -> ParsedResponse:
    """MEGA-Bench's `json` parser: the last object's values (quoted strings unquoted); when no
    object reads, the raw response stands for every field, with `parse_ok = False`."""
    response = response or ""
    value = parse_json_value(response)
    if not isinstance(value, dict) or not value:
        return ParsedResponse({f: response for f in fields}, parse_ok=False)
    return ParsedResponse({str(k): unquote(v) for k, v in value.items()})


def parse_response(
    response: str | None, parser: str, answer: dict[str, Any], answer_fields: list[str]
) -> ParsedResponse:
    """Dispatch on the task's parser name. `answer` is the reference (its values decide whether a
    single-field answer is one line); `answer_fields` are the fields that must be read."""
    if parser in SINGLE_FIELD_PARSERS:
        if len(answer_fields) != 1:
            raise ValueError(f"parser {parser!r} reads one answer field, the task has {answer_fields}")
        key = answer_fields[0]
        single_line = "\n" not in str(answer.get(key, ""))
        if parser == "answer_string":
            return parse_answer_string(response, key, single_line)
        # ASCII-art and verbatim answers keep their inner layout: no paragraph heuristic.
        content = extract_answer_content(response or "", strip=parser != "verbatim_answer_string")
        content, _ = extract_code_block(content)
        return ParsedResponse({key: content})
    if parser == "json":
        return parse_json_response(response, answer_fields)
    if parser in ("dummy", "raw"):
        return ParsedResponse({f: (response or "").strip() for f in answer_fields})
    raise ValueError(f"unknown response parser {parser!r} (known: {', '.join(PARSERS)})")
