"""MEGA-Bench's task-specific scorers: `program_judge`, `symbolic_planning_test` and
`constrained_generation` (39 of its 505 tasks use them). Their definitions are MEGA-Bench's
(`metrics/scoring/program_judge.py`, `symbolic_planning.py`, `constrained_generation.py`),
reproduced here with their quirks; they are registered under the same names for both scoring
modes. Each takes what MEGA-Bench hands it: the field's parsed answer (the whole parsed response
for `constrained_generation`) and the query's `eval_context`.

- `program_judge`: the program runs once per test case (`eval_context["test_case"]`) in
  `mmrl.eval.sandbox` (MEGA-Bench runs it in a bare subprocess); the score is the fraction of
  cases whose output equals the expected text (right-stripped).
- `symbolic_planning_test`: 1 when the plan's actions (lines starting with `(`) are applicable in
  turn from the task's `:init` state under the domain's PDDL actions and reach the goal, else 0.
  As in MEGA-Bench, negative preconditions are never violated, and a domain with a single
  action, an unknown action or a wrong number of objects scores 0.
- `constrained_generation`: the minimum over the constraints in `eval_context` (each 0 or 1):
  `length` (`<N` / `>N` words), `acrostic`, `acrostic_alliteration`, `syllables` (per-line
  ranges), `rhyming_scheme`, `poetry_meter` (iambic), via the CMU pronouncing dictionary; the
  `contain*` constraints need NLTK's `punkt_tab` and `wordnet` data (else its queries are skipped).
"""

from __future__ import annotations

import collections
import itertools
import re
from typing import Any

from mmrl.eval.megabench import MetricUnavailable, _reference, str_to_iterable
from mmrl.eval.metrics import FieldContext, register_metric


def _both(name: str):
    def wrap(fn):
        register_metric(name)(fn)
        return _reference(name)(fn)

    return wrap


# --------------------------------------------------------------------------- program_judge


def _input_lines(input_data: Any) -> list[str]:
    # MEGA-Bench: "\n".join(input) + "\n", served line by line (a string input joins its chars).
    return ("\n".join(input_data) + "\n").splitlines()


@_both("program_judge")
def program_judge(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Fraction of `eval_context["test_case"]` (a list, or one dict) whose expected output the
    program prints; each run in a fresh sandbox."""
    from mmrl.eval.sandbox import SandboxUnavailable, run_program

    cases = (ctx.eval_context if ctx else {})["test_case"]
    if isinstance(cases, dict):
        cases = [cases]
    if not cases:
        return 0.0
    if not isinstance(response, str):
        return 0.0  # exec() of a non-string raises inside the program: every case fails
    passed = 0
    for case in cases:
        try:
            run = run_program(response, _input_lines(case["input"]))
        except SandboxUnavailable as exc:
            raise MetricUnavailable(f"program_judge needs the sandbox, unavailable here: {exc}") from None
        passed += run.output == case["expected"].rstrip()
    return passed / len(cases)


# --------------------------------------------------------------------------- symbolic planning

_PARAM_LIST = re.compile(r"((?:\?\S+\s*)+)(?:-\s+([^\?$]+)\s*)?")
_PARAM_NAME = re.compile(r"\?([^\s\?\)]+)\s*")


def _param_types(text: str) -> dict[str, Any]:
    text = text.strip()
    if not (text[0] == "(" and text[-1] == ")"):
        raise AssertionError("a parameter list must be parenthesised")
    out: dict[str, Any] = {}
    for names, kind in _PARAM_LIST.findall(text[1:-1]):
        for name in _PARAM_NAME.findall(names):
            kind = kind.strip()
            if kind.startswith("("):
                kind = kind[1:-1].strip()
                out[name] = re.split(r"\s+", kind)[1:]
            else:
                out[name] = kind
    return out


def _outer_inner(text: str, ender: str, opener: str = "(", closer: str = ")") -> tuple[str, list[str], int]:
    """The text up to the first `ender` at depth 0, the depth-1 groups before it, and its end."""
    depth, start, groups = 0, 0, []
    for i, c in enumerate(text):
        if depth == 0 and c == ender:
            return text[: i + 1], groups, i + 1
        if c == opener:
            if depth == 0:
                start = i
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                groups.append(text[start : i + 1])
    return text, groups, len(text)


def _attr(text: str, starter: str) -> tuple[Any, Any]:
    """MEGA-Bench's `parse_pddl_attr_from_string` (non-overlapping): one occurrence gives
    (its text, its groups); several give (their texts, {name: groups})."""
    parts = text.split(starter)
    if len(parts) == 1:
        return "", []
    if len(parts) == 2:
        outer, groups, _ = _outer_inner(parts[1], ")")
        return starter + outer, groups
    named: dict[str, list[str]] = {}
    outers = []
    while len(text.split(starter)) > 1:
        text = text.split(starter, 1)[1]
        name = re.split(r"\s+", text.strip())[0]
        outer, groups, end = _outer_inner(text, ")")
        outers.append(starter + outer)
        named[name] = groups
        text = text[end:]
    return outers, named


def _strip_types(clause: str) -> str:
    pieces = clause.split(" - ")
    if len(pieces) == 1:
        return clause
    for i in range(1, len(pieces)):
        if len(pieces[i].strip().split(")")[0].split()) == 1:
            pieces[i] = ")" + pieces[i].strip().split(")", 1)[1]
        else:
            pieces[i] = " " + pieces[i].strip().split(" ", 1)[1]
    return "".join(pieces).strip()


def _conjuncts(text: str) -> set[str]:
    if not text.startswith("(and"):
        raise AssertionError("not a conjunction")
    found, depth, start = set(), 0, 0
    for i, c in enumerate(text):
        if c == "(":
            depth += 1
            if depth == 2:
                start = i
        elif c == ")":
            depth -= 1
            if depth == 0:
                break
            if depth == 1:
                found.add(_strip_types(text[start : i + 1]))
    return found


class _Domain:
    """A PDDL domain's actions: parameter order and pre/post conditions (negations first)."""

    def __init__(self, pddl: str):
        actions, groups = _attr(pddl, "(:action")
        self.names: list[str] = []
        self.params: list[dict[str, Any]] = []
        for _, (name, attrs) in zip(actions, groups.items()):  # one action: groups is a list -> error
            if len(attrs) != 3:
                raise AssertionError("an action needs parameters, precondition and effect")
            self.names.append(name)
            self.params.append(_param_types(attrs[0]))
        self.conditions: dict[str, list[str]] = {}
        for name in self.names:
            body = pddl.split(f"(:action {name}")[1]
            for suffix, tag in (("pre", ":precondition"), ("post", ":effect")):
                cond = body.split(tag)[1].strip()
                clauses = _conjuncts(cond) if cond.startswith("(and") else {cond.split(")")[0].strip() + ")"}
                self.conditions[f"{name}_{suffix}"] = sorted(
                    clauses, key=lambda c: 0 if c.startswith("(not ") else 1
                )


def _bind(domain: _Domain, action: str) -> tuple[dict[str, str], str]:
    action = action[1:-1]
    name = action.split(" ")[0].strip()
    objects = action.split(" ")[1:]
    params = domain.params[domain.names.index(name)]  # unknown action: ValueError
    if len(objects) != len(params):
        raise AssertionError("wrong number of objects")
    return dict(zip(params, objects)), name


def _ground(condition: str, binding: dict[str, str]) -> str:
    for param, obj in binding.items():
        condition = re.sub(rf"\?{param}(?=[^\w-])", obj, condition)
    return condition


def _holds(state: list[str], conditions: list[str], binding: dict[str, str]) -> bool:
    for cond in conditions:
        cond = _ground(cond, binding)
        negated = cond.startswith("(not ")
        if (negated and cond in state) or (not negated and cond not in state):
            return False
    return True


def _apply(state: list[str], effects: list[str], binding: dict[str, str]) -> list[str]:
    for effect in effects:
        effect = _ground(effect, binding)
        _, removed = _attr(effect, "(not ")
        if removed:
            if len(removed) != 1:
                raise AssertionError("one atom per negation")
            if removed[0] in state:
                state.remove(removed[0])
        elif effect.strip() not in state:
            state.append(effect)
    return state


@_both("symbolic_planning_test")
def symbolic_planning_test(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 when the plan is valid from the task's initial state and reaches its goal."""
    context = ctx.eval_context if ctx else {}
    domain = _Domain(context["domain_pddl"])
    if isinstance(response, str):
        lines = response.split("\n")
    elif isinstance(response, (list, tuple)):
        lines = list(response)
    else:
        raise ValueError(f"a plan must be text or a list, got {type(response).__name__}")
    plan = [line.strip() for line in lines if line.startswith("(")]
    try:
        task = context["task_pddl"]
        state = _attr(task, "(:init")[1]
        goal = _attr(task, "(and")[1]
    except IndexError:
        return 0.0
    try:
        for action in plan:
            binding, name = _bind(domain, action)
            if not _holds(state, domain.conditions[f"{name}_pre"], binding):
                return 0.0
            state = _apply(state, domain.conditions[f"{name}_post"], binding)
        for g in goal:
            negated = g.startswith("(not ")
            if (negated and g in state) or (not negated and g not in state):
                return 0.0
    except (ValueError, AssertionError):
        return 0.0
    return 1.0


# --------------------------------------------------------------------------- constrained generation

_CUSTOM_PHONES = {
    "'gainst": ["G EH1 N S T", "G EY1 N S T"],
    "'midst": ["M IH1 D S T"],
    "'mongst": ["M AH1 NG S T"],
    "'neath": ["N IY1 TH"],
    "beguiles": ["B IH0 G AY1 L Z"],
    "cerulean": ["S ER0 UW1 L IY0 AH0 N"],
    "doggo": ["D AO1 G OW0"],
    "downtorn": ["D AW1 N T AO2 R N"],
    "enthrall": ["EH0 N TH R AO1 L"],
    "fam'ly": ["F AE1 M L IY0"],
    "fiery": ["F AY1 ER0 IY0", "F AY1 R IY0"],
    "flits": ["F L IH1 T S"],
    "furred": ["F ER1 D"],
    "kneels": ["N IY1 L Z"],
    "o'er": ["OW1 ER0"],
    "orbs": ["AO1 R B Z"],
    "quenched": ["K W EH1 N CH D"],
    "quietude": ["K W AY1 AH0 T UW0 D"],
    "retold": ["R IY0 T OW1 L D"],
    "scurries": ["S K ER1 IY0 Z"],
    "sunbeams": ["S AH1 N B IY2 M Z"],
    "syncs": ["S IH1 NG K S"],
    "'twixt": ["T W IH1 K S T"],
}
"""MEGA-Bench's pronunciations for words the CMU dictionary lacks."""


def _pronouncing():
    try:
        import pronouncing
    except ImportError:
        raise MetricUnavailable(
            "constrained_generation needs the pronouncing package (pip install 'mmrl[megabench]')"
        ) from None
    return pronouncing


def phones_for_word(word: str) -> list[str]:
    """CMU pronunciations, with MEGA-Bench's guesses for possessives, -ed, -s/-es, un- and '-."""
    p = _pronouncing()
    word = word.replace("’", "'").lower()
    suffixes, prefixes, drop = [""], [""], [""]
    if word.endswith("'s"):
        suffixes = [" Z"]
        word = word.removesuffix("'s")
    if word in _CUSTOM_PHONES:
        return [pr + s for pr, s in itertools.product(_CUSTOM_PHONES[word], suffixes)]
    found = p.phones_for_word(word)
    if not found:
        if suffixes[0] != "":
            return []
        if word.endswith("ed"):
            suffixes = [" D", " T", " AH0 D", " IH0 D"]
            word = word.removesuffix("ed")
        elif word.endswith("s"):
            if p.phones_for_word(word.removesuffix("s")):
                suffixes = [" S", " Z", " AH0 Z", " IH0 Z"] if word.endswith("es") else [" S", " Z"]
                word = word.removesuffix("s")
            elif word.endswith("es"):
                suffixes = [" AH0 Z", " IH0 Z"]
                word = word.removesuffix("es")
        if word.startswith("un"):
            prefixes = ["AH0 N "]
            word = word.removeprefix("un")
        elif word.startswith("'") and p.phones_for_word("a" + word.removeprefix("'")):
            drop = ["AH0 "]
            word = "a" + word.removeprefix("'")
        found = p.phones_for_word(word)
    return [
        (pre + pr + suf).removeprefix(d)
        for pre, pr, suf, d in itertools.product(prefixes, found, suffixes, drop)
    ]


def _rhyming_part(phones: str) -> str:
    parts = phones.split()
    for i in range(len(parts) - 1, 0, -1):
        if parts[i][-1] in "012":
            phones = " ".join(parts[i:])
            break
    return re.sub(r"\d", "", phones)


def count_syllables(text: str) -> list[int]:
    """The syllable count of every combination of the words' pronunciations."""
    p = _pronouncing()
    options = [phones_for_word(w) for w in text.split()]
    return [sum(p.syllable_count(x) for x in combo) for combo in itertools.product(*options)]


def syllable_ranges(text: str) -> list[list[int]]:
    """`[7,10][5]7 ` -> [[7, 10], [5, 5], [7, 7], [0, 0]] (a space is an empty line)."""

    def one(chunk: str) -> list[int]:
        chunk = chunk.strip("[]")
        if "," in chunk:
            low, high = map(int, chunk.split(","))
            return [low, high]
        if chunk == " ":
            return [0, 0]
        return [int(chunk), int(chunk)]

    return [one(c) for c in re.findall(r"(?:\[\d+(?:,\s*\d+)?\]|\d| )", text.strip())]


def _stresses(word: str) -> list[list[int]]:
    p = _pronouncing()
    return [list(s) for s in {tuple(int(x) for x in p.stresses(pr)) for pr in phones_for_word(word)}]


_IAMBIC = {(2, 1), (0, 2), (0, 1), (0, 0), (1, 1), (2, 2)}


def is_line_iambic(line: str) -> bool:
    """Is there a choice of pronunciations that makes the line iambic (MEGA-Bench's search)?"""
    words = line.split()
    options = [_stresses(w) for w in words]

    def search(w: int, syllable: int, previous: int) -> bool:
        if w == len(words):
            return syllable % 2 == 0
        for pattern in options[w]:
            k = 0
            if syllable % 2 != 0:
                if (previous, pattern[k]) not in _IAMBIC:
                    continue
                k += 1
            ok = True
            for a, b in zip(*[iter(pattern[k:])] * 2):
                if (a, b) not in _IAMBIC:
                    ok = False
                    break
                k += 2
            if not ok:
                continue
            if k < len(pattern):
                if search(w + 1, syllable + k + 1, pattern[k]):
                    return True
            elif search(w + 1, syllable + k, -1):
                return True
        return False

    return search(0, 0, -1)


def _nltk():
    try:
        import nltk
        from nltk.corpus import wordnet
        from nltk.stem import WordNetLemmatizer
        from nltk.tokenize import sent_tokenize, word_tokenize

        nltk.data.find("tokenizers/punkt_tab")
        nltk.data.find("corpora/wordnet")
    except (ImportError, LookupError):
        raise MetricUnavailable(
            "constrained_generation's contain constraints need nltk with its punkt_tab and wordnet data "
            "(python -m nltk.downloader punkt_tab wordnet)"
        ) from None
    return sent_tokenize, word_tokenize, WordNetLemmatizer(), wordnet


def _occurrences(text: str, phrase: str) -> tuple[int, list[tuple[int, int]]]:
    sent_tokenize, word_tokenize, lemmatizer, wordnet = _nltk()

    def lemma(word: str) -> str:
        out = lemmatizer.lemmatize(word, wordnet.NOUN)
        if word.endswith("ies") and out.endswith("y"):
            out = out[:-1] + "y"
        elif word.endswith("ves") and out.endswith("f"):
            out = out[:-1] + "f"
        return out

    def phrase_lemmas(s: str) -> str:
        return " ".join(lemma(w) for w in word_tokenize(s.lower()))

    target = phrase_lemmas(phrase)
    found, total = [], 0
    for i, sentence in enumerate(sent_tokenize(text), 1):
        n = phrase_lemmas(sentence).count(target)
        if n:
            found.append((i, n))
            total += n
    return total, found


def _parse_constraint(key: str, value: str) -> dict[str, Any]:
    keys = [re.sub(r"\d+$", "", k) for k in key.strip().split("##")]
    values: list[Any] = [v.strip().strip('"').strip() for v in value.strip().split("##")]
    values = [int(v) if v.isdigit() else v for v in values]
    if len(keys) != len(values):
        raise ValueError("mismatch between number of keys and values")
    return {k.lower(): v for k, v in zip(keys, values)}


def _nested_words(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(re.sub(r"(\w+)", r'"\1"', text))
    except (ValueError, SyntaxError):
        return text


def check_constraint(response: str, constraint: str, value: str) -> float:
    """One constraint of MEGA-Bench's constrained generation: 1 or 0."""
    if value.strip() == "":
        return 1.0
    if "contain" in constraint:
        parsed = _parse_constraint(constraint, value)
        response = response.replace("**", "")
        records: dict[tuple, list] = {}
        if "contain_only" in parsed:
            satisfied = 0
            for cond in _nested_words(parsed["contain_only"]):
                count, where = 0, []
                for item in cond:
                    n, places = _occurrences(response, item)
                    if n > 0:
                        count += n
                        where.extend(places)
                if count > 0:
                    satisfied += 1
                    records[tuple(cond)] = where
            score = 1.0 if satisfied == 1 else 0.0
        else:
            items = str_to_iterable(list, parsed["contain"])
            count, where = 0, []
            for item in items:
                n, places = _occurrences(response, item)
                if n > 0:
                    count += n
                    where.extend(places)
            if count > 0:
                records[tuple(items)] = where
            score = 0.0 if count == 0 else 1.0
        if score > 0:
            where = list(records.values())[0]
            if "position_only" in parsed:
                return 1.0 if len(where) == 1 and where[0][0] == parsed["position_only"] else 0.0
            if "position" in parsed:
                score = 1.0 if parsed["position"] in [w[0] for w in where] else 0.0
            if "times" in parsed:
                score = 1.0 if sum(w[1] for w in where) == parsed["times"] else 0.0
        return score
    if "length" in constraint:
        try:
            limit = int(value[1:])
        except ValueError:
            return 0.0
        words = re.findall(r"\b\w+\b", response)
        if value[0] == "<":
            return 1.0 if len(words) < limit else 0.0
        if value[0] == ">":
            return 1.0 if len(words) > limit else 0.0
        raise ValueError(f"unknown length constraint {value!r}")  # MEGA-Bench: an unset score
    if "acrostic" in constraint:
        lines = response.replace("**", "").strip().lower().split("\n")
        if len(lines) != len(value):
            return 0.0
        for line, letter in zip(lines, value.lower()):
            line = line.strip()
            if letter == " ":
                if line != "":
                    return 0.0
            elif "acrostic_alliteration" in constraint:
                if not line or not all(word[0] == letter for word in line.split(" ")):
                    return 0.0
            elif not line or line[0] != letter:
                return 0.0
        return 1.0
    text = response.strip()
    for ch in '.,!?:;"':
        text = text.replace(ch, "")
    text = text.replace("-", " ").replace("—", " ")
    text = re.sub(r" *\(\w\) *(?=\n|$)", "", text)
    lines = text.lower().split("\n")
    if constraint == "syllables":
        ranges = syllable_ranges(value)
        if len(lines) != len(ranges):
            return 0.0
        try:
            ok = all(
                any(low <= n <= high for n in count_syllables(line))
                for line, (low, high) in zip(lines, ranges)
            )
        except IndexError:
            ok = False
        return 1.0 if ok else 0.0
    if constraint == "rhyming_scheme":
        if len(lines) != len(value):
            return 0.0
        last_words = [line.split()[-1] if line != "" else "" for line in lines]
        by_letter: dict[str, set[str]] = collections.defaultdict(set)
        for letter, word in zip(value, last_words):
            if letter == " ":
                if word != "":
                    return 0.0
            else:
                by_letter[letter].add(word)
        parts: dict[str, set[str]] = {}
        for letter, words in by_letter.items():
            common = set.intersection(*[{_rhyming_part(pr) for pr in phones_for_word(w)} for w in words])
            if not common:
                return 0.0
            parts[letter] = common
        for a, b in itertools.combinations(parts, 2):
            if parts[a] & parts[b]:
                return 0.0
        return 1.0
    if constraint == "poetry_meter":
        return 1.0 if all(is_line_iambic(line) for line in lines) else 0.0
    return 0.0


@_both("constrained_generation")
def constrained_generation(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """The minimum over every constraint in `eval_context` of `check_constraint` on the whole
    parsed response (MEGA-Bench's tasks parse it with `dummy`: the stripped text)."""
    constraints = ctx.eval_context if ctx else {}
    whole = ctx.parsed if ctx is not None and ctx.parsed is not None else response
    return min(check_constraint(whole, c, v) for c, v in constraints.items())
