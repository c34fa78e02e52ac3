"""The tool layer of multi-turn rollouts: parsing calls, the built-in visual tools, the executor's
limits against hostile tools and inputs, and veRL tools run unchanged through the adapter."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import pytest
from PIL import Image
from transformers.utils import get_json_schema

from mmrl.environments import (
    Observation,
    ToolCall,
    ToolContext,
    ToolLimits,
    VerlToolAdapter,
    builtin,
    get_tool,
    merge_observations,
    parse_tool_calls,
    register_tool,
    register_verl_tool,
    release_all,
    release_batches,
    run_tool_batches,
    run_tool_calls,
    tool_call_text,
    tool_names,
    tool_schemas,
    unregister_tool,
)

RED = (255, 0, 0)
WHITE = (255, 255, 255)


def _image(
    size: tuple[int, int] = (256, 256), square: tuple[int, int, int, int] = (100, 100, 150, 150)
) -> Image.Image:
    """A white image with a red square at `square` (x1, y1, x2, y2)."""
    image = Image.new("RGB", size, WHITE)
    image.paste(RED, square)
    return image


def _run(calls: list[ToolCall], context: ToolContext | None = None, **limits: Any) -> list[Observation]:
    return run_tool_batches([(calls, context or ToolContext(images=[_image()]))], ToolLimits(**limits))[0]


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, raw="")


@pytest.fixture()
def temp_tools():
    """Register test tools under fresh names; unregistered after the test."""
    names: list[str] = []

    def add(obj: Any, name: str | None = None) -> str:
        name = name or f"t_{uuid.uuid4().hex[:8]}"
        register_tool(name)(obj)
        names.append(name)
        return name

    yield add
    for name in names:
        unregister_tool(name)


# ---------------------------------------------------------------------------------------------
# Schemas


def test_zoom_in_schema_is_transformers_get_json_schema():
    schema = get_tool("zoom_in").schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "zoom_in"
    assert fn["description"].startswith("Zoom in on a region")
    props = fn["parameters"]["properties"]
    assert list(props) == ["bbox_2d", "label", "image_index"]  # `context` is not the model's to fill
    assert props["bbox_2d"]["type"] == "array" and props["bbox_2d"]["items"] == {"type": "integer"}
    assert props["image_index"]["type"] == "integer" and props["label"]["type"] == "string"
    assert fn["parameters"]["required"] == ["bbox_2d"]

    # The same as transformers' own output for the same signature and docstring.
    def zoom_in(bbox_2d: list[int], label: str = "", image_index: int = 0):
        pass

    zoom_in.__doc__ = builtin.zoom_in.__doc__
    assert get_json_schema(zoom_in) == schema
    assert tool_schemas(["zoom_in", "image_info"])[1]["function"]["name"] == "image_info"
    assert {"zoom_in", "rotate", "image_info"} <= set(tool_names())


def test_class_tool_keeps_per_trajectory_state(temp_tools):
    class Counter:
        """Count the calls of this trajectory."""

        def __call__(self, step: int = 1, *, context: ToolContext) -> str:
            """Add to the trajectory's counter.

            Args:
                step: How much to add.
            """
            context.state["count"] = context.state.get("count", 0) + step
            return f"count {context.state['count']}"

        def release(self, context: ToolContext) -> float:
            return float(context.state.pop("count", 0))

    name = temp_tools(Counter)
    assert get_tool(name).schema["function"]["parameters"]["properties"]["step"]["type"] == "integer"
    a, b = ToolContext(images=[]), ToolContext(images=[])
    out = run_tool_batches([([_call(name), _call(name, step=2)], a), ([_call(name)], b)], ToolLimits())
    assert [o.text for o in out[0]] == ["count 1", "count 3"] and out[1][0].text == "count 1"
    assert release_batches([a, b]) == [{name: 3.0}, {name: 1.0}]


def test_registering_a_taken_name_fails(temp_tools):
    def dup(x: int) -> str:
        """Echo.

        Args:
            x: a number
        """
        return str(x)

    name = temp_tools(dup)
    with pytest.raises(ValueError, match="already registered"):
        register_tool(name)(dup)
    assert register_tool(dup) is dup and get_tool("dup").name == "dup"  # bare, named by __name__
    unregister_tool("dup")

    def undocumented(x: int) -> str:
        return str(x)

    with pytest.raises(Exception, match="no docstring"):  # a schema needs a docstring: fails at once
        register_tool(undocumented)
    assert "undocumented" not in tool_names()


# ---------------------------------------------------------------------------------------------
# Parsing


def test_parse_two_calls_in_one_turn():
    text = (
        "<think>look closer</think>\n"
        '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 30, 40], "label": "cat"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "image_info", "arguments": {}}\n</tool_call>'
    )
    turn = parse_tool_calls(text)
    assert turn.errors == [] and turn.error_kinds == []
    assert [c.name for c in turn.calls] == ["zoom_in", "image_info"]
    assert turn.calls[0].arguments == {"bbox_2d": [1, 2, 30, 40], "label": "cat"}
    assert turn.calls[0].raw.startswith("<tool_call>") and turn.calls[0].raw.endswith("</tool_call>")
    assert parse_tool_calls("no tools here, just an answer: 42").calls == []
    assert parse_tool_calls("no tools here").errors == []


def test_parse_arguments_given_as_json_string():
    turn = parse_tool_calls('<tool_call>{"name": "rotate", "arguments": "{\\"angle\\": 90}"}</tool_call>')
    assert turn.errors == [] and turn.calls[0].arguments == {"angle": 90}


def test_tool_call_text_round_trips():
    call = {"name": "zoom_in", "arguments": {"bbox_2d": [10, 20, 60, 80], "label": "红色 sign"}}
    text = tool_call_text(call)
    assert (
        text
        == '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [10, 20, 60, 80], "label": "红色 sign"}}\n</tool_call>'
    )
    back = parse_tool_calls("I will zoom. " + text).calls
    assert [(c.name, c.arguments) for c in back] == [(call["name"], call["arguments"])]
    assert tool_call_text(back[0]) == text


def test_malformed_calls_are_errors_with_kinds():
    text = (
        '<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2 3]}}</tool_call>'  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>'  # no name
        '<tool_call>{"name": "rotate", "arguments": [90]}</tool_call>'  # arguments not an object
        '<tool_call>{"name": "rotate", "arguments": "{angle: 90"}</tool_call>'  # arguments bad JSON string
        '<tool_call>{"name": "image_info", "arguments": {}}</tool_call>'  # fine
        '<tool_call>{"name": "zoom_in", "argu'  # cut off: unclosed
    )
    turn = parse_tool_calls(text)
    assert [c.name for c in turn.calls] == ["image_info"]
    assert turn.error_kinds == ["bad_json", "no_name", "bad_arguments", "bad_arguments", "bad_json"]
    assert turn.errors[0].startswith("tool call 1: bad JSON (Expecting ',' delimiter")
    assert turn.errors[1].startswith("tool call 2: no tool name")
    assert turn.errors[4] == "tool call 6: bad JSON (unclosed <tool_call>, no </tool_call>)"
    assert turn.error_indices == [0, 1, 2, 3, 5]
    # One observation per block written, in order: the run call's answer between the errors.
    merged = merge_observations(turn, _run(turn.calls))
    assert [o.error for o in merged] == [
        "bad_json",
        "no_name",
        "bad_arguments",
        "bad_arguments",
        None,
        "bad_json",
    ]
    assert merged[4].text == "image 0: 256x256 pixels"


# ---------------------------------------------------------------------------------------------
# Built-in tools


def test_zoom_in_crops_the_right_pixels():
    context = ToolContext(images=[_image()])
    (obs,) = _run([_call("zoom_in", bbox_2d=[110, 110, 140, 140], label="red square")], context)
    assert obs.error is None
    assert obs.text == "Zoomed in on [110, 110, 140, 140] of image 0. Label: red square."
    (crop,) = obs.images
    assert crop.mode == "RGB" and crop.size == (30, 30)  # its own pixels (ZOOM_OUTPUT_SIDE None)
    assert set(crop.getdata()) == {RED}  # wholly inside the square
    (obs,) = _run([_call("zoom_in", bbox_2d=[0, 0, 60, 60])], context)
    assert set(obs.images[0].getdata()) == {WHITE}  # wholly outside it
    # A crop of an observation's image: image_index counts the trajectory's images in order.
    context.images.append(_image((64, 64), (0, 0, 32, 64)))
    (obs,) = _run([_call("zoom_in", bbox_2d=[0, 0, 16, 16], image_index=1)], context)
    assert set(obs.images[0].getdata()) == {RED}
    (obs,) = _run([_call("zoom_in", bbox_2d=[40, 0, 64, 64], image_index=-1)], context)
    assert set(obs.images[0].getdata()) == {WHITE}


def test_zoom_in_output_sizes(monkeypatch):
    context = ToolContext(images=[_image()])
    (obs,) = _run([_call("zoom_in", bbox_2d=[100, 100, 110, 120])], context)
    assert obs.images[0].size == (28, 56)  # min side 28, as veRL's zoom-in tool, aspect kept
    assert set(obs.images[0].getdata()) == {RED}
    (obs,) = _run([_call("zoom_in", bbox_2d=[0, 0, 60, 90])], context)
    assert obs.images[0].size == (60, 90)  # large enough: its own pixels
    monkeypatch.setattr(builtin, "ZOOM_OUTPUT_SIDE", 64)
    (obs,) = _run([_call("zoom_in", bbox_2d=[0, 0, 30, 60])], context)
    assert obs.images[0].size == (32, 64)  # longer side to ZOOM_OUTPUT_SIDE, aspect kept
    (obs,) = _run([_call("zoom_in", bbox_2d=[0, 0, 10, 100])], context)
    assert obs.images[0].size == (28, 280)  # then the shorter side up to 28


def test_zoom_in_invalid_boxes_are_bad_arguments():
    context = ToolContext(images=[_image()])
    cases = {
        "outside": ([300, 300, 400, 400], 0, "lies outside image 0 (256x256 pixels)"),
        "negative side": ([-50, -50, -10, -10], 0, "lies outside image 0"),
        "x2 <= x1": ([50, 10, 50, 40], 0, "x2 must be greater than x1"),
        "y2 <= y1": ([10, 40, 50, 30], 0, "y2 greater than y1"),
        "3 numbers": ([10, 20, 30], 0, "must be 4 numbers"),
        "image index": ([0, 0, 10, 10], 3, "image_index 3 is out of range"),
    }
    calls = [_call("zoom_in", bbox_2d=box, image_index=i) for box, i, _ in cases.values()]
    for obs, (case, (_, _, message)) in zip(_run(calls, context, max_calls_per_turn=10), cases.items()):
        assert obs.error == "bad_arguments", case
        assert obs.text.startswith("zoom_in: ") and message in obs.text, (case, obs.text)
        assert obs.images == []


def test_zoom_in_box_partly_outside_is_clipped():
    (obs,) = _run([_call("zoom_in", bbox_2d=[120, 120, 400, 300])])
    assert obs.error is None
    assert obs.text.startswith("Zoomed in on [120, 120, 256, 256] of image 0.")
    assert "clipped" in obs.text and "[120, 120, 400, 300]" in obs.text
    assert obs.images[0].getpixel((0, 0)) == RED


def test_rotate_and_image_info():
    image = Image.new("RGB", (20, 10), WHITE)
    image.putpixel((0, 0), RED)  # top-left
    context = ToolContext(images=[image])
    rotated, bad, info = _run(
        [_call("rotate", angle=90), _call("rotate", angle=45), _call("image_info", image_index=0)], context
    )
    assert rotated.error is None and rotated.images[0].size == (10, 20)
    assert rotated.images[0].getpixel((0, 19)) == RED  # counterclockwise: top-left goes bottom-left
    assert bad.error == "bad_arguments" and "multiple of 90" in bad.text
    assert info.text == "image 0: 20x10 pixels" and info.images == []
    (none,) = _run([_call("image_info")], ToolContext(images=[]))
    assert none.error == "bad_arguments" and "no image" in none.text


# ---------------------------------------------------------------------------------------------
# Hostile calls and tools


def test_unknown_tool():
    (obs,) = _run([_call("teleport", where="moon")])
    assert obs.error == "unknown_tool" and "'teleport'" in obs.text and "zoom_in" in obs.text
    # A registered tool the sample does not list is unknown to its trajectory.
    (obs,) = _run([_call("rotate", angle=90)], ToolContext(images=[_image()], tools=["zoom_in"]))
    assert obs.error == "unknown_tool" and "available tools: zoom_in." in obs.text


def test_missing_wrong_type_and_extra_arguments():
    missing, wrong, item, extra, integral = _run(
        [
            _call("zoom_in", label="x"),
            _call("zoom_in", bbox_2d="10,10,50,50"),
            _call("zoom_in", bbox_2d=[10, "a", 50, 50]),
            _call("zoom_in", bbox_2d=[10, 10, 50, 50], zoom=4),
            _call("zoom_in", bbox_2d=[10.0, 10, 50, 50], image_index=0.0),  # 10.0 is an integer
        ],
        max_calls_per_turn=5,
    )
    assert missing.error == "bad_arguments" and "missing required argument 'bbox_2d'" in missing.text
    assert wrong.error == "bad_arguments" and "'bbox_2d' must be an array, got str" in wrong.text
    assert item.error == "bad_arguments" and "'bbox_2d'[1] must be an integer, got str" in item.text
    assert extra.error == "bad_arguments" and "unknown argument 'zoom'" in extra.text
    assert "bbox_2d, label, image_index" in extra.text
    assert integral.error is None


def test_a_tool_that_raises_or_misbehaves_is_a_tool_error(temp_tools):
    def broken(x: int) -> str:
        """Divide by zero.

        Args:
            x: a number
        """
        return str(x / 0)

    def garbage(x: int) -> object:
        """Return something that is not an observation.

        Args:
            x: a number
        """
        return object()

    def quitter(x: int) -> str:
        """Call sys.exit.

        Args:
            x: a number
        """
        raise SystemExit(3)

    async def async_broken(x: int) -> str:
        """Raise, asynchronously.

        Args:
            x: a number
        """
        raise KeyError("nope")

    names = [temp_tools(fn) for fn in (broken, garbage, quitter, async_broken)]
    out = _run([_call(n, x=1) for n in names])
    assert [o.error for o in out] == ["tool_error"] * 4
    assert "ZeroDivisionError" in out[0].text and out[0].text.startswith(f"{names[0]} failed: ")
    assert "not an observation" in out[1].text and "SystemExit" in out[2].text and "KeyError" in out[3].text
    (obs,) = _run([_call("image_info")])  # the tools' loop survived all of it
    assert obs.error is None


def test_hung_tools_time_out_without_blocking(temp_tools):
    def hang_sync(x: int) -> str:
        """Sleep for 5 seconds.

        Args:
            x: a number
        """
        time.sleep(5)
        finished.set()
        return "late"

    async def hang_async(x: int) -> str:
        """Sleep for 5 seconds, asynchronously.

        Args:
            x: a number
        """
        await asyncio.sleep(5)
        return "late"

    finished = threading.Event()  # set only once the 5 s sleep is over
    sync_name, async_name = temp_tools(hang_sync), temp_tools(hang_async)
    limits = ToolLimits(timeout_s=0.2)
    out = run_tool_batches(
        [
            ([_call(sync_name, x=1)], ToolContext(images=[])),
            ([_call(async_name, x=1), _call("image_info")], ToolContext(images=[_image()])),
        ],
        limits,
    )
    assert not finished.is_set()  # returned at the time limit, while the sync tool still sleeps
    assert [o.error for o in out[0]] == ["timeout"] and out[0][
        0
    ].text == f"{sync_name} timed out after 0.2 s."
    assert [o.error for o in out[1]] == ["timeout", None]  # the trajectory's next call still ran
    assert out[1][1].text == "image 0: 256x256 pixels"


def test_huge_text_is_capped(temp_tools):
    def chatty(n: int) -> str:
        """Say a lot.

        Args:
            n: how many characters
        """
        return "x" * n

    name = temp_tools(chatty)
    long, short = _run([_call(name, n=100_000), _call(name, n=10)])
    assert long.error == "text_too_long" and len(long.text) == 2000
    assert long.text.startswith("xxx") and long.text.endswith("[cut: 100000 characters in all]")
    assert short.error is None and short.text == "x" * 10


def test_huge_and_many_images_are_capped(temp_tools):
    def big(count: int) -> tuple[str, list[Image.Image]]:
        """Return large images.

        Args:
            count: how many
        """
        return "here", [Image.new("L", (2000, 1500), 128) for _ in range(count)]

    name = temp_tools(big)
    (obs,) = _run([_call(name, count=3)])
    assert obs.error is None  # downscaled and noted, not an error
    assert len(obs.images) == 2 and "[kept the first 2 of 3 images]" in obs.text
    for image in obs.images:
        assert image.mode == "RGB"
        assert image.width * image.height <= 1_048_576
        assert abs(image.width / image.height - 4 / 3) < 0.01
    assert "downscaled from 2000x1500 to" in obs.text and obs.text.startswith("here\n")


def test_too_many_calls_in_one_turn():
    out = _run([_call("image_info")] * 6)
    assert [o.error for o in out] == [None] * 4 + ["too_many_calls"] * 2
    assert out[4].text == "tool call 5 (image_info) not run: at most 4 tool calls per turn."


def test_run_tool_batches_from_threads_and_run_tool_calls_from_a_loop():
    results: list[list[list[Observation]]] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                run_tool_batches([([_call("image_info")], ToolContext(images=[_image()]))], ToolLimits())
            )
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r[0][0].text for r in results] == ["image 0: 256x256 pixels"] * 3
    out = asyncio.run(
        run_tool_calls([_call("rotate", angle=180)], ToolContext(images=[_image()]), ToolLimits())
    )
    rotated = out[0].images[0]
    assert (
        out[0].error is None and rotated.getpixel((120, 120)) == RED and rotated.getpixel((101, 101)) == WHITE
    )


def test_add_observations_appends_images_in_order():
    context = ToolContext(images=[_image()])
    out = _run([_call("zoom_in", bbox_2d=[0, 0, 64, 64]), _call("rotate", angle=90)], context)
    assert len(context.images) == 1  # the executor leaves the trajectory's images to the caller
    context.add_observations(out)
    assert len(context.images) == 3 and context.images[1] is out[0].images[0]


# ---------------------------------------------------------------------------------------------
# veRL tools, unchanged


class _Schema:
    """Stands in for veRL's pydantic OpenAIFunctionToolSchema (it has `model_dump`)."""

    def __init__(self, data: dict):
        self.data = data

    def model_dump(self, **kwargs: Any) -> dict:
        return json.loads(json.dumps(self.data))


class _Response:
    """Stands in for veRL's ToolResponse (text, image, video)."""

    def __init__(self, text: str | None = None, image: list | None = None):
        self.text, self.image, self.video = text, image, None


class VerlStyleCropTool:
    """A tool written the way veRL's BaseTool subclasses are (as its image zoom-in tool): the
    image comes in through `create`, state lives per instance id, and every call pays a step
    reward while `calc_reward` reports the accumulated one."""

    def __init__(self, config: dict, tool_schema: Any, new_api: bool = True):
        self.config = config
        self.tool_schema = tool_schema
        self.name = "crop_tool"
        self.new_api = new_api
        self._instance_dict: dict[str, dict] = {}
        self.created = 0
        self.released: list[str] = []

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        create_kwargs = kwargs.get("create_kwargs", {})
        if create_kwargs:
            kwargs.update(create_kwargs)
        self._instance_dict[instance_id] = {"image": kwargs["image"], "reward": 0.0}
        self.created += 1
        return (instance_id, _Response()) if self.new_api else instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict]:
        bbox = parameters.get("bbox_2d")
        if not bbox or len(bbox) != 4:
            return {"text": "Error: bbox_2d is missing or not 4 numbers."}, -0.05, {"success": False}
        data = self._instance_dict[instance_id]
        data["reward"] += 0.5
        crop = data["image"].crop(tuple(bbox))
        text = f"Zoomed in on the image to the region {bbox}."
        if self.new_api:
            return _Response(text=text, image=[crop]), 0.1, {"success": True}
        return {"text": text, "image": [crop]}, 0.1, {"success": True}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.released.append(instance_id)
        self._instance_dict.pop(instance_id, None)


_CROP_SCHEMA = {
    "type": "function",
    "function": {
        "name": "crop_tool",
        "description": "Crop the image.",
        "parameters": {
            "type": "object",
            "properties": {
                "bbox_2d": {"type": "array", "items": {"type": "number"}, "description": "[x1, y1, x2, y2]"},
                "label": {"type": "string", "description": "the object"},
            },
            "required": ["bbox_2d"],
        },
    },
}


@pytest.mark.parametrize("new_api", [True, False])
def test_verl_tool_runs_unchanged_through_the_adapter(new_api):
    tool = VerlStyleCropTool({}, _Schema(_CROP_SCHEMA), new_api=new_api)
    name = f"crop_{uuid.uuid4().hex[:8]}"
    try:
        adapter = register_verl_tool(tool, name=name)
        assert isinstance(adapter, VerlToolAdapter) and get_tool(name) is adapter
        assert tool_schemas([name])[0]["function"]["parameters"] == _CROP_SCHEMA["function"]["parameters"]
        a, b = ToolContext(images=[_image()], sample_id="a"), ToolContext(images=[_image()], sample_id="b")
        crop = _call(name, bbox_2d=[110, 110, 140, 140])
        turn1 = run_tool_batches(
            [([crop, _call(name, bbox_2d=[0, 0, 10, 10])], a), ([crop], b)], ToolLimits()
        )
        turn2 = run_tool_batches([([crop, _call(name, bbox="oops")], a)], ToolLimits())
        assert tool.created == 2  # once per trajectory, not per call or per turn
        first = turn1[0][0]
        assert (
            first.error is None and first.text == "Zoomed in on the image to the region [110, 110, 140, 140]."
        )
        assert set(first.images[0].getdata()) == {RED} and first.metrics == {"success": True}
        assert first.reward == pytest.approx(0.1 + 0.5)  # step reward + calc_reward's gain
        assert turn2[0][1].error == "bad_arguments"  # checked against the veRL schema before execute
        total = sum(o.reward for o in turn1[0] + turn2[0])
        assert total == pytest.approx(3 * 0.1 + 1.5)  # the accumulated reward counted once
        assert release_batches([a, b]) == [{name: 1.5}, {name: 0.5}]
        assert len(tool.released) == 2 and tool._instance_dict == {}
        assert asyncio.run(release_all(a)) == {}  # released once only
    finally:
        unregister_tool(name)
