"""Row selection and padding for rollout batches (mini-batches keep their images)."""

from __future__ import annotations

import torch

from mmrl.types import RolloutBatch, VisionLayout


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


def pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` padded with zeros at the end of every dimension but the first, up to `shape[1:]`."""
    if tuple(t.shape[1:]) == tuple(shape[1:]):
        return t
    out = t.new_zeros((t.shape[0], *shape[1:]))
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def concat_vision_inputs(
    parts: list[dict[str, torch.Tensor]], layouts: list[VisionLayout], prompt_width: int
) -> tuple[dict[str, torch.Tensor], VisionLayout]:
    """Join the vision inputs of several row chunks (`layouts` theirs): per-token ones left
    padded to `prompt_width`, the others' trailing dimensions padded with zeros to the largest
    (Idefics3's images per row, LLaVA-NeXT's tiles per image)."""
    out: dict[str, torch.Tensor] = {}
    first = layouts[0]
    for key in parts[0]:
        tensors = [p[key] for p in parts]
        if key in first.per_token:
            tensors = [pad_left(t, prompt_width, 0) for t in tensors]
        else:
            shape = tuple(max(sizes) for sizes in zip(*(t.shape for t in tensors)))
            tensors = [pad_to(t, shape) for t in tensors]
        out[key] = torch.cat(tensors, dim=0)
    extents = {k: [n for lay in layouts for n in lay.extents[k]] for k in first.extents}
    return out, VisionLayout(extents, first.per_token)


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The sub-batch of the given rows, with exactly those rows' vision inputs."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.prompt_ids.device)
    layout = batch.vision_layout
    layout.check(batch.vision_inputs, len(batch), "select_rows")
    vision: dict[str, torch.Tensor] = {}
    for key, value in batch.vision_inputs.items():
        extent = layout.extents.get(key)
        if extent is None:  # one entry per row
            vision[key] = value[index]
            continue
        starts = [0]
        for n in extent:
            starts.append(starts[-1] + n)
        pieces = [value[starts[r] : starts[r + 1]] for r in rows]
        vision[key] = torch.cat(pieces) if pieces else value[:0]
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
        vision_layout=layout.rows(rows),
        observation_mask=None if batch.observation_mask is None else batch.observation_mask[index],
        trajectories=None if batch.trajectories is None else [batch.trajectories[r] for r in rows],
        token_versions=None if batch.token_versions is None else batch.token_versions[index],
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
    # Observation tokens of a multi-turn response are attended to (the model saw them) though
    # they are not in the loss mask.
    attention_mask = torch.cat([batch.prompt_mask, batch.response_attention()], dim=1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    for key, value in batch.vision_inputs.items():
        if key in batch.vision_layout.per_token:  # responses are text: type 0
            value = pad_right(value, input_ids.shape[1], 0)
        inputs[key] = value
    return inputs
