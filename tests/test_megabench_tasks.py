"""MEGA-Bench's task-specific scorers: `program_judge` in a sandbox that model-written code
cannot escape, `symbolic_planning_test` and `constrained_generation`, each case worked out from
MEGA-Bench's definitions (and checked against its code run on the same inputs)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mmrl.eval import megabench as mb
from mmrl.eval.metrics import FieldContext, score_field
from mmrl.eval.sandbox import run_program

REPO = Path(__file__).resolve().parents[1]


# -- the sandbox: each escape attempt fails inside it, and nothing changes outside


def test_the_program_runs_and_reads_its_input():
    run = run_program("a = input()\nb = input()\nprint(int(a) + int(b))", ["2", "3"])
    assert (run.status, run.output) == ("ok", "5")


@pytest.mark.parametrize(
    "code",
    [
        'print(open("/etc/passwd").read())',
        f"print(open({str(REPO / 'README.md')!r}).read())",
        f"import os\nprint(os.listdir({str(REPO)!r}))",
        'import os\nprint(os.listdir("/home"), os.listdir("/tmp"))',
        'print(open("/proc/self/environ").read())',
    ],
)
def test_nothing_of_the_host_is_readable(code):
    run = run_program(code, [])
    assert run.status == "error" and "No such file or directory" in run.output


def test_only_the_runtime_and_the_scratch_folder_are_there():
    run = run_program("import os\nprint(sorted(os.listdir('/')), os.getcwd())", [])
    listing, cwd = run.output.rsplit(" ", 1)
    assert cwd == "/work"
    assert not {"etc", "home", "tmp", "proc", "sys"} & set(eval(listing))


def test_writes_outside_the_scratch_folder_fail_and_the_scratch_folder_is_removed(tmp_path):
    marker = tmp_path / "escaped"
    code = (
        "import os\n"
        "open('mine.txt', 'w').write('ok')\n"
        "for target in ['/usr/evil', '/evil', '/work/../evil', " + repr(str(marker)) + "]:\n"
        "    try:\n"
        "        open(target, 'w').write('x')\n"
        "        print('wrote', target)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "print(os.getcwd(), open('mine.txt').read())"
    )
    run = run_program(code, [])
    assert "wrote" not in run.output and run.output.endswith("/work ok")
    assert not marker.exists() and not Path("/usr/evil").exists()


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
        "import socket\nsocket.getaddrinfo('pypi.org', 443)",
    ],
)
def test_there_is_no_network(code):
    # its own network namespace: no interface but a loopback that is down
    run = run_program(code, [])
    assert run.status == "error", run.output


def test_a_fork_bomb_a_memory_hog_and_an_infinite_loop_are_stopped():
    t0 = time.monotonic()
    bomb = run_program("import os\nwhile True:\n    os.fork()", [])
    assert bomb.status in ("timeout", "error", "killed")
    hog = run_program("x = bytearray(4 * 1024**3)\nprint(len(x))", [])
    assert hog.status == "error" and hog.output == "ERROR during execution: "  # MemoryError()
    loop = run_program("while True:\n    pass", [], time_limit_s=1.0)
    assert loop.status == "timeout" and loop.output == "ERROR: Code execution exceeded the time limit."
    assert time.monotonic() - t0 < 60  # generous: the limits are 2 s and 1 s of program time
    # Every sandboxed process (the bomb's too) ends with the sandbox's PID 1. The kernel kills
    # a PID namespace's processes as its PID 1 exits, which can finish after the launcher has
    # been reaped, and a test on another worker may have a sandbox of its own running at any
    # moment: the machine must reach a moment with none left (ours never ending never would).
    for _ in range(600):
        left = [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox(p)]
        if not left:
            break
        time.sleep(0.1)
    assert not left, left


def _is_sandbox(pid: str) -> bool:
    try:
        return b"_sandbox_child.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_megabench_code_tester_semantics():
    # sys.exit after a correct print: MEGA-Bench's queue stays empty
    assert (
        run_program("print(1)\nimport sys\nsys.exit(0)", []).output
        == "ERROR: No output was produced before timeout."
    )
    # running out of input: mock's StopIteration, an empty message
    assert run_program("input()\ninput()", ["a"]).output == "ERROR during execution: "
    # without `if __name__ == "__main__":` the program runs in a function's namespace
    helper = "def helper():\n    return 1\ndef main():\n    print(helper())\nmain()"
    assert run_program(helper, []).output == "ERROR during execution: name 'helper' is not defined"
    as_main = 'def helper():\n    return 1\ndef main():\n    print(helper())\nif __name__ == "__main__":\n    main()'
    assert run_program(as_main, []).output == "1"
    # sys.stdin is empty; print goes to the output, right-stripped
    assert run_program("import sys\nprint(repr(sys.stdin.read()), '  ')", ["x"]).output == "''"


def test_program_judge_scores_the_fraction_of_test_cases():
    code = "n = int(input())\nprint(n * 2)"
    cases = [
        {"input": ["2"], "expected": "4\n"},
        {"input": ["3"], "expected": "6"},
        {"input": ["5"], "expected": "11"},
    ]
    ctx = FieldContext(eval_context={"test_case": cases})
    assert mb.score_reference("program_judge", code, None, ctx) == (pytest.approx(2 / 3), None)
    assert score_field("program_judge", code, None, ctx) == pytest.approx(2 / 3)
    single = FieldContext(eval_context={"test_case": {"input": ["1"], "expected": "2"}})  # one dict
    assert score_field("program_judge", code, None, single) == 1.0
    assert score_field("program_judge", None, None, ctx) == 0.0


# -- symbolic planning

DOMAIN = """(define (domain move)
 (:action move
  :parameters (?from - room ?to - room)
  :precondition (and (robot-at ?from))
  :effect (and (robot-at ?to) (not (robot-at ?from))))
 (:action pick
  :parameters (?b - ball ?r - room)
  :precondition (and (at ?b ?r) (robot-at ?r) (free))
  :effect (and (not (at ?b ?r)) (not (free))))
 (:action drop
  :parameters (?b - ball ?r - room)
  :precondition (and (robot-at ?r) (not (free)))
  :effect (and (at ?b ?r) (free)))
)"""
TASK = "(define (problem p) (:init (robot-at a) (at ball1 a) (free)) (:goal (and (at ball1 b))))"


@pytest.mark.parametrize(
    ("plan", "score", "why"),
    [
        ("(pick ball1 a)\n(move a b)\n(drop ball1 b)", 1.0, "applicable actions reaching the goal"),
        (
            "Plan:\n(pick ball1 a)\n(move a b)\n(drop ball1 b)\ndone",
            1.0,
            "only lines starting with ( are actions",
        ),
        ("(pick ball1 a)\n(move a b)", 0.0, "the goal is not reached"),
        ("(pick ball1 b)\n(move a b)\n(drop ball1 b)", 0.0, "a precondition fails"),
        ("(move a b)\n(drop ball1 b)", 1.0, "MEGA-Bench never checks a negative precondition ((not (free)))"),
        ("(fly a b)", 0.0, "an unknown action"),
        ("(move a)", 0.0, "a wrong number of objects"),
        ("(move  a b)", 0.0, "a double space counts as an empty object"),
    ],
)
def test_symbolic_planning(plan, score, why):
    ctx = FieldContext(eval_context={"domain_pddl": DOMAIN, "task_pddl": TASK})
    assert mb.score_reference("symbolic_planning_test", plan, None, ctx)[0] == score, why


def test_symbolic_planning_with_a_single_action_domain_scores_0():
    # MEGA-Bench's domain reader returns a list, not a dict, for one action: its zip fails.
    domain = (
        "(define (domain d) (:action move :parameters (?x) :precondition (and (p ?x)) :effect (and (q ?x))))"
    )
    ctx = FieldContext(eval_context={"domain_pddl": domain, "task_pddl": "(:init (p x)) (:goal (and (q x)))"})
    assert mb.score_reference("symbolic_planning_test", "(move x)", None, ctx)[0] == 0.0


# -- constrained generation


@pytest.mark.parametrize(
    ("text", "constraints", "score"),
    [
        ("cat sat on\nthe mat with\na hat", {"syllables": "332"}, 1.0),
        ("cat sat on\nthe mat with\na hat", {"syllables": "333"}, 0.0),  # "a hat" has 2
        ("cat sat on\nthe mat with\na hat", {"syllables": "[3,4]34"}, 0.0),
        ("The cat is fat\nA dog on a log\nThe bat", {"rhyming_scheme": "ABA"}, 1.0),
        ("The cat is fat\nA dog on a log\nThe frog", {"rhyming_scheme": "ABA"}, 0.0),
        ("Apples are red\nBananas are yellow\nCherries", {"acrostic": "abc"}, 1.0),
        ("Apples all\nBig bears\nCool cats", {"acrostic_alliteration": "abc"}, 1.0),
        ("one two three four", {"length": "<5"}, 1.0),
        ("one two three four", {"length": ">5"}, 0.0),
        ("one two three four", {"length": "=4"}, 0.0),  # MEGA-Bench: an unset score raises -> 0
        ("anything", {"length": ""}, 1.0),  # an empty constraint is a placeholder
        ("shall i compare thee to a summer's day", {"poetry_meter": "iambic"}, 1.0),
        ("Apples are red\nBananas", {"acrostic": "ab", "length": "<3"}, 0.0),  # the minimum
    ],
)
def test_constrained_generation(text, constraints, score):
    ctx = FieldContext(eval_context=constraints, parsed=text)
    assert mb.score_reference("constrained_generation", text, None, ctx)[0] == score
