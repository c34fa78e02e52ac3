"""Row selection and padding for rollout batches (mini-batches keep their images)."""

from __future__ import annotations

import torch

from mmrl.types import RolloutBatch

# Processor outputs that are per image (concatenated over images), keyed to their grid tensor.
_PER_IMAGE = {"pixel_values": "image_grid_thw"}


def pad_left(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)


def pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def concat_vision_inputs(parts: list[dict[str, torch.Tensor]], prompt_width: int) -> dict[str, torch.Tensor]:
    """Concatenate processor outputs of several row chunks; per-token ones are left padded."""
    out: dict[str, torch.Tensor] = {}
    for key in parts[0]:
        tensors = [p[key] for p in parts]
        if key == "mm_token_type_ids":
            tensors = [pad_left(t, prompt_width, 0) for t in tensors]
        out[key] = torch.cat(tensors, dim=0)
    return out


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The sub-batch of the given rows, with exactly those rows' image patches."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.prompt_ids.device)
    vision: dict[str, torch.Tensor] = {}
    image_starts = [0]
    for n in batch.images_per_row:
        image_starts.append(image_starts[-1] + n)
    image_index = [i for r in rows for i in range(image_starts[r], image_starts[r + 1])]
    for key, value in batch.vision_inputs.items():
        if key in _PER_IMAGE:
            grid = batch.vision_inputs[_PER_IMAGE[key]]
            sizes = grid.prod(dim=-1).tolist()
            offsets = [0]
            for s in sizes:
                offsets.append(offsets[-1] + s)
            pieces = [value[offsets[i] : offsets[i + 1]] for i in image_index]
            vision[key] = torch.cat(pieces) if pieces else value[:0]
        elif key in _PER_IMAGE.values():
            vision[key] = value[image_index]
        else:  # per-row tensors
            vision[key] = value[index]
    return RolloutBatch(
        samples=[batch.samples[r] for r in rows],
        prompt_ids=batch.prompt_ids[index],
        prompt_mask=batch.prompt_mask[index],
        response_ids=batch.response_ids[index],
        response_mask=batch.response_mask[index],
        rollout_logprobs=batch.rollout_logprobs[index],
        vision_inputs=vision,
        texts=[batch.texts[r] for r in rows],
        truncated=batch.truncated[index],
        images_per_row=[batch.images_per_row[r] for r in rows],
        group_size=batch.group_size,
    )


def prompt_groups(batch: RolloutBatch) -> tuple[list[int], torch.Tensor] | None:
    """Rows that share a prompt: the first row of each distinct prompt, and for every row the
    index [N] of its prompt among those; None when every row's prompt is distinct.

    Rows share a prompt when they come from the same sample object (hence the same images)
    and have the same prompt token ids (the G responses of a group).
    """
    first: list[int] = []
    seen: dict[tuple[int, bytes], int] = {}
    inverse = []
    ids = batch.prompt_ids.cpu().numpy()
    for row, sample in enumerate(batch.samples):
        key = (id(sample), ids[row].tobytes())
        index = seen.get(key)
        if index is None:
            index = seen[key] = len(first)
            first.append(row)
        inverse.append(index)
    if len(first) == len(inverse):
        return None
    return first, torch.tensor(inverse, dtype=torch.long, device=batch.prompt_ids.device)


def model_inputs(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """Forward inputs for prompt + response: the exact token layout seen during generation."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    # Positions after a stop token are padding; causal attention means they never affect the
    # response tokens that count, and masking them keeps position ids identical to generation.
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    for key, value in batch.vision_inputs.items():
        if key == "mm_token_type_ids":
            value = pad_right(value, input_ids.shape[1], 0)
        inputs[key] = value
    return inputs
