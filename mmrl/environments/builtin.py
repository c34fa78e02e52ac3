"""The built-in visual tools: zoom in, rotate, and the size of an image.

"Thinking with images": the model crops a region it cannot read at the prompt's resolution and
gets the crop back, enlarged, as a new image of the trajectory. Coordinates are pixels of the
image the call names, as Qwen2.5-VL's grounding writes them; `image_info` tells the model an
image's size so that it can write them.

Images are numbered in the order the trajectory holds them: 0 is the prompt's first image, the
observations' images follow; a negative index counts from the end (-1: the latest image).
"""

from __future__ import annotations

from PIL import Image

from mmrl.environments.tools import Observation, ToolArgumentError, ToolContext, register_tool

ZOOM_MIN_SIDE = 28
"""A crop's shorter side is enlarged to at least this many pixels (veRL's image zoom-in tool's
`MIN_DIMENSION`: Qwen2-VL's patch merger needs 28x28 pixels per visual token)."""
ZOOM_OUTPUT_SIDE: int | None = None
"""If set, a crop is resized, aspect kept, to this longer side. None (the default, as veRL's):
the crop keeps its pixels, only its shorter side is raised to ZOOM_MIN_SIDE; the model's own
processor then resizes it as it resizes any image (a real Qwen2-VL keeps up to ~1 megapixel, the
tiny built-in one makes every image 64x64), so a zoom never throws detail away."""


def _pick_image(context: ToolContext, image_index: int) -> tuple[int, Image.Image]:
    """The image the call names, with its index from the start (ToolArgumentError if none)."""
    count = len(context.images)
    if count == 0:
        raise ToolArgumentError("there is no image in this conversation.")
    if not -count <= image_index < count:
        raise ToolArgumentError(
            f"image_index {image_index} is out of range: the conversation has {count} "
            f"image{'s' if count > 1 else ''} (0 to {count - 1})."
        )
    index = image_index % count
    return index, context.images[index]


def _fit_crop(crop: Image.Image) -> Image.Image:
    """A crop resized to ZOOM_OUTPUT_SIDE on its longer side, then enlarged if its shorter side
    is under ZOOM_MIN_SIDE; aspect kept."""
    width, height = crop.size
    scale = 1.0
    if ZOOM_OUTPUT_SIDE is not None:
        scale = ZOOM_OUTPUT_SIDE / max(width, height)
    if min(width, height) * scale < ZOOM_MIN_SIDE:
        scale = ZOOM_MIN_SIDE / min(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    if size == crop.size:
        return crop
    return crop.resize(size, Image.Resampling.BICUBIC)


@register_tool("zoom_in")
def zoom_in(
    bbox_2d: list[int], label: str = "", image_index: int = 0, *, context: ToolContext
) -> Observation:
    """Zoom in on a region of an image: returns the region cropped and enlarged as a new image.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2] in pixels of that image: (x1, y1) its top-left corner, (x2, y2) its bottom-right corner.
        label: The name of the object in the region (optional).
        image_index: Which image of the conversation to zoom into: 0 is the first image (the default), -1 the latest.
    """
    index, image = _pick_image(context, image_index)
    width, height = image.size
    if len(bbox_2d) != 4:
        raise ToolArgumentError(f"bbox_2d must be 4 numbers [x1, y1, x2, y2], got {len(bbox_2d)}.")
    x1, y1, x2, y2 = bbox_2d
    if x2 <= x1 or y2 <= y1:
        raise ToolArgumentError(
            f"bbox_2d {list(bbox_2d)} is empty: x2 must be greater than x1 and y2 greater than y1."
        )
    if x2 <= 0 or y2 <= 0 or x1 >= width or y1 >= height:
        raise ToolArgumentError(
            f"bbox_2d {list(bbox_2d)} lies outside image {index} ({width}x{height} pixels)."
        )
    box = [max(x1, 0), max(y1, 0), min(x2, width), min(y2, height)]
    if box[2] - box[0] < 1 or box[3] - box[1] < 1:  # unreachable with integer corners; kept as a guard
        raise ToolArgumentError(f"bbox_2d {list(bbox_2d)} is less than 1 pixel wide or high.")
    crop = _fit_crop(image.crop(tuple(box)))
    text = f"Zoomed in on {box} of image {index}."
    if box != list(bbox_2d):
        text += f" The box {list(bbox_2d)} was clipped to the image ({width}x{height} pixels)."
    if label:
        text += f" Label: {label}."
    return Observation(text=text, images=[crop])


@register_tool("rotate")
def rotate(angle: int, image_index: int = 0, *, context: ToolContext) -> Observation:
    """Rotate an image counterclockwise by a multiple of 90 degrees: returns the rotated image.

    Args:
        angle: Degrees counterclockwise, a multiple of 90 (90, 180, 270; negative turns clockwise).
        image_index: Which image of the conversation to rotate: 0 is the first image (the default), -1 the latest.
    """
    if angle % 90 != 0:
        raise ToolArgumentError(f"angle must be a multiple of 90 degrees, got {angle}.")
    index, image = _pick_image(context, image_index)
    turns = (angle // 90) % 4
    ops = {1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180, 3: Image.Transpose.ROTATE_270}
    rotated = image.transpose(ops[turns]) if turns else image.copy()
    return Observation(text=f"Rotated image {index} by {angle} degrees counterclockwise.", images=[rotated])


@register_tool("image_info")
def image_info(image_index: int = 0, *, context: ToolContext) -> str:
    """Give an image's size in pixels, the coordinates zoom_in takes.

    Args:
        image_index: Which image of the conversation: 0 is the first image (the default), -1 the latest.
    """
    index, image = _pick_image(context, image_index)
    return f"image {index}: {image.width}x{image.height} pixels"
