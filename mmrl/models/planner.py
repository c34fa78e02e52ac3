"""The autoregressive half of a decoupled image generator: a causal LM that writes the decoder's prompt.

GLM-Image-style generators put an autoregressive model in front of a diffusion decoder: the
AR model decides *what* the image shows, the decoder *how* it looks. mmrl conditions the decoder
on the simplest thing the AR model can produce that is faithful to that split: **a rewritten
prompt** (the plan). The planner reads the user's request and writes a plan in words the decoder
understands; the decoder (any text-to-image pipeline) renders the plan. The plan is text, so it
can be read, logged and checked, and any causal LM can be the planner of any pipeline.

- `Planner` wraps a causal LM and its tokenizer: `sample` draws n plans per request (temperature
  sampling with a KV cache and a seeded generator, so a rollout is reproducible), and
  `logprobs` gives the per-token log-probs and entropies of stored plans under the current
  weights (the LM head in chunks: memory bounded at a 151,936-token vocabulary).
- A real planner is any local folder or hub id `AutoModelForCausalLM` loads (`load_planner`);
  with a chat template the request is sent as a user message built from `instruction`.
- The built-in one (`builtin_planner`) is a tiny Qwen2 built from config with a word-level
  tokenizer over the requests' and plans' words (`mmrl.datasets.paraphrase`), given a short
  supervised warm-up on (request, canonical prompt) pairs in which one synonym of every colour
  and of every shape never occurs (`withheld_synonyms`): it writes well-formed plans and knows
  the other words, and has to learn the withheld ones from the reward alone (GRPO's job).
  Cached under a key of everything that determines it, like the image base.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.models.base_cache import cache_root, cached_base
from mmrl.models.tiny_spec import decoder_dims

log = logging.getLogger(__name__)

PLANNER_VERSION = 1
"""Part of the built-in planner's cache key: bump it when its warm-up changes."""
PLANNER_FILE = "planner.json"
"""Saved next to the weights: how requests are put to the model (template, end token)."""
TINY_TEMPLATE = "{request} [plan]"
"""The built-in planner's prompt: the request's words, then the plan marker."""
DEFAULT_INSTRUCTION = (
    "Rewrite this image request as a short prompt for an image model, using only the words it knows "
    "(a colour and a shape): {request}"
)
"""The user message of a chat-template planner (`{request}` is filled)."""


@dataclass
class PlannerSpec:
    """Shape of the built-in planner (a tiny Qwen2 causal LM)."""

    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head size = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 128
    """MLP width."""


@dataclass
class PlannerWarmupConfig:
    """The supervised warm-up that makes the built-in planner."""

    max_steps: int = 300
    """Give up (keep the model as it is) after this many steps."""
    batch_size: int = 16
    """(request, plan) pairs per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    eval_every: int = 10
    """Steps between greedy evaluations on the validation requests."""
    target_accuracy: float = 0.95
    """Stop at the first evaluation whose greedy plans (of validation requests in known words)
    are this often exactly the target."""
    withheld_synonyms: int = 1
    """Synonyms per colour and per shape (the last ones of `mmrl.datasets.paraphrase`'s lists)
    kept out of the warm-up: the planner knows the format and the other words, and must learn
    these from the reward alone."""
    seed: int = 0
    """Seed of the initialisation and the data order."""


@dataclass
class PlanBatch:
    """n plans per request, prompt-major (rows i*n .. i*n+n-1 answer request i)."""

    prompt_ids: torch.Tensor
    """[N, P] left-padded prompt tokens."""
    prompt_mask: torch.Tensor
    """[N, P] 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """[N, R] sampled tokens (the end token included; padded with it after)."""
    response_mask: torch.Tensor
    """[N, R] 1 up to and including the first end token."""
    texts: list[str]
    """The decoded plans (end token and padding removed)."""
    old_logprobs: torch.Tensor | None = None
    """[N, R] log-probs of the policy that sampled them (float32), filled by the trainer."""

    def __len__(self) -> int:
        return len(self.texts)


def build_planner_tokenizer():
    """Word-level tokenizer over the built-in requests' and plans' words; `[end]` (id 0) ends a
    plan and pads, `[plan]` marks where the plan starts, other words are `[unk]`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mmrl.datasets.paraphrase import PLAN_VOCABULARY, REQUEST_VOCABULARY

    words = ["[end]", "[unk]", "[plan]", *REQUEST_VOCABULARY, *PLAN_VOCABULARY]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[end]", eos_token="[end]", unk_token="[unk]", padding_side="left"
    )


def build_tiny_planner(spec: PlannerSpec, seed: int = 0):
    """(model, tokenizer): a random-weight tiny Qwen2 causal LM over the planner's words."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_planner_tokenizer()
    config = Qwen2Config(
        **decoder_dims(spec, len(tokenizer)),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval(), tokenizer


class Planner:
    """A causal LM that writes plans (see the module docs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        template: str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        max_new_tokens: int = 8,
        autocast: Any = None,
    ):
        self.model = model
        self.autocast = autocast
        """A callable giving the forward's autocast context (`Precision.context`); None: none."""
        self.tokenizer = tokenizer
        self.template = template
        """`{request}` format of the prompt; None: the tokenizer's chat template with `instruction`."""
        self.instruction = instruction
        self.max_new_tokens = max_new_tokens
        end = tokenizer.eos_token_id
        if end is None:
            raise ValueError("planner: the tokenizer has no end-of-sequence token (eos_token_id)")
        self.end_id = int(end)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prompt_text(self, request: str) -> str:
        if self.template is not None:
            return self.template.format(request=request)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "planner: the tokenizer has no chat template; set planner.template (with {request})"
            )
        message = [{"role": "user", "content": self.instruction.format(request=request)}]
        return self.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)

    def encode(self, requests: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, P] left-padded prompt ids and mask on the planner's device."""
        rows = [self.tokenizer(self.prompt_text(r), add_special_tokens=False)["input_ids"] for r in requests]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        out = []
        for row, m in zip(ids.tolist(), mask.tolist()):
            kept = [t for t, keep in zip(row, m) if keep and t != self.end_id]
            out.append(self.tokenizer.decode(kept, skip_special_tokens=True).strip())
        return out

    def _context(self):
        import contextlib

        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def sample(self, *args, **kwargs) -> PlanBatch:
        """`_sample` (below) under the planner's autocast context."""
        with torch.no_grad(), self._context():
            return self._sample(*args, **kwargs)

    def _sample(
        self,
        requests: list[str],
        n: int = 1,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> PlanBatch:
        """n plans per request (prompt-major): temperature sampling (or greedy) with a KV cache;
        each row stops at its first end token (or after `max_new_tokens`)."""
        was_training = self.model.training
        self.model.eval()
        ids, mask = self.encode(requests)
        ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        N = ids.shape[0]
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        # logits of the last position only: a prompt's [N, P, V] logits at a 151,936-token vocabulary
        # would be gigabytes for nothing
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1
        )
        past, logits = out.past_key_values, out.logits[:, -1]
        next_pos = position[:, -1:] + 1
        done = torch.zeros(N, dtype=torch.bool, device=ids.device)
        tokens, keep = [], []
        attn = mask
        for _ in range(self.max_new_tokens):
            scores = logits.float()
            if greedy:
                tok = scores.argmax(-1)
            else:
                probs = torch.softmax(scores / temperature, dim=-1)
                tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(ids.device)
            tok = torch.where(done, torch.full_like(tok, self.end_id), tok)
            keep.append((~done).long())
            tokens.append(tok)
            done = done | (tok == self.end_id)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                past_key_values=past,
                use_cache=True,
            )
            past, logits = out.past_key_values, out.logits[:, -1]
            next_pos = next_pos + 1
        response = torch.stack(tokens, dim=1)
        response_mask = torch.stack(keep, dim=1)
        self.model.train(was_training)
        return PlanBatch(ids, mask, response, response_mask, self.decode(response, response_mask))

    def logprobs(
        self, batch: PlanBatch, rows: list[int] | torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[r, R] log-probs and entropies of the stored plans of `rows` under the current weights
        (the tempered distribution they were sampled from); the LM head runs in chunks of
        positions (`mmrl.algos.logprobs.module_head_logprobs`). Zero where the mask is 0."""

        with self._context():
            return self._logprobs(batch, rows, temperature)

    def _logprobs(
        self, batch: PlanBatch, rows: list[int] | torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from mmrl.algos.logprobs import module_head_logprobs

        rows = torch.as_tensor(rows, dtype=torch.long, device=batch.prompt_ids.device)
        p_ids, p_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]
        r_ids, r_mask = batch.response_ids[rows], batch.response_mask[rows]
        ids = torch.cat([p_ids, r_ids], dim=1)
        mask = torch.cat([p_mask, torch.ones_like(r_mask)], dim=1)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=position).last_hidden_state
        P, R = p_ids.shape[1], r_ids.shape[1]
        h = hidden[:, P - 1 : P + R - 1]  # the position before each response token predicts it
        lp, ent = module_head_logprobs(
            h.reshape(-1, h.shape[-1]),
            self.model.get_output_embeddings(),
            r_ids.reshape(-1),
            None,
            temperature,
        )
        m = r_mask.float()
        return lp.view(-1, R) * m, ent.view(-1, R) * m

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        from transformers import PreTrainedTokenizerFast

        meta = {
            "template": self.template,
            "max_new_tokens": self.max_new_tokens,
            # AutoTokenizer would pick the model type's tokenizer class (Qwen2's BPE) for a
            # word-level tokenizer file; this names the class that reads it back as it was
            "plain_tokenizer": type(self.tokenizer) is PreTrainedTokenizerFast,
        }
        (folder / PLANNER_FILE).write_text(json.dumps(meta, indent=2))


def load_planner(
    path: str | Path,
    dtype: torch.dtype | None = None,
    template: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    max_new_tokens: int = 0,
    revision: str | None = None,
) -> Planner:
    """A planner from a local folder or hub id (`AutoModelForCausalLM`, `AutoTokenizer`). A folder
    saved by `Planner.save` brings its template and length; `template` / `max_new_tokens` (> 0)
    override them; without a template the tokenizer's chat template is used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta: dict[str, Any] = {}
    local = Path(path) / PLANNER_FILE
    if local.is_file():
        meta = json.loads(local.read_text())
    if meta.get("plain_tokenizer"):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), revision=revision)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, revision=revision)
    return Planner(
        model.eval(),
        tokenizer,
        template=template if template is not None else meta.get("template"),
        instruction=instruction,
        max_new_tokens=max_new_tokens or int(meta.get("max_new_tokens", 16)),
    )


# --- the built-in planner ------------------------------------------------------------------------
def planner_key(spec: PlannerSpec, warmup: PlannerWarmupConfig) -> str:
    raw = {"version": PLANNER_VERSION, "spec": asdict(spec), "warmup": asdict(warmup)}
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def builtin_planner(spec: PlannerSpec, warmup: PlannerWarmupConfig, cache_dir: str | None = None) -> Path:
    """Path of the built-in planner, warming it up first if it is not cached."""
    path = cache_root(cache_dir) / "bases" / f"planner-{planner_key(spec, warmup)}"

    def build():
        planner, report = warm_up_planner(spec, warmup)
        return planner.save, report

    return cached_base(path, "the built-in planner (supervised warm-up)", build)


def plan_accuracy(plans: list[str], targets: list[str]) -> float:
    """Share of plans that are exactly their target prompt (whitespace-normalised)."""
    return float(np.mean([" ".join(p.split()) == t for p, t in zip(plans, targets)])) if plans else 0.0


def withheld_words(n: int) -> set[str]:
    """The last `n` synonyms of every colour and shape (kept out of the planner's warm-up)."""
    from mmrl.datasets.paraphrase import COLOUR_SYNONYMS, SHAPE_SYNONYMS

    if n <= 0:
        return set()
    return {w for ws in (*COLOUR_SYNONYMS.values(), *SHAPE_SYNONYMS.values()) for w in ws[-n:]}


def warm_up_planner(spec: PlannerSpec, w: PlannerWarmupConfig) -> tuple[Planner, dict]:
    """Teacher-forced cross-entropy on the plan tokens of (request, target) training pairs whose
    words are not withheld; stop at the first greedy validation accuracy >= `target_accuracy`
    (or after `max_steps`)."""
    from mmrl.datasets.paraphrase import paraphrase_requests

    model, tokenizer = build_tiny_planner(spec, w.seed)
    planner = Planner(model, tokenizer, template=TINY_TEMPLATE, max_new_tokens=4)
    withheld = withheld_words(w.withheld_synonyms)
    known = lambda r: not (set(r.request.split()) & withheld)  # noqa: E731
    train = [r for r in paraphrase_requests("train") if known(r)]
    validation = [r for r in paraphrase_requests("validation") if known(r)][:48]
    rng = np.random.default_rng([w.seed, 5])
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.0)
    start, history, reached, step = time.monotonic(), [], False, 0
    for step in range(1, w.max_steps + 1):
        pairs = [train[i] for i in rng.integers(len(train), size=w.batch_size)]
        ids, mask = planner.encode([p.request for p in pairs])
        target_rows = [
            tokenizer(p.target, add_special_tokens=False)["input_ids"] + [planner.end_id] for p in pairs
        ]
        width = max(map(len, target_rows))
        r_ids = torch.full((len(pairs), width), planner.end_id, dtype=torch.long)
        r_mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for i, r in enumerate(target_rows):
            r_ids[i, : len(r)] = torch.tensor(r)
            r_mask[i, : len(r)] = 1
        batch = PlanBatch(ids, mask, r_ids, r_mask, [p.target for p in pairs])
        model.train()
        lp, _ = planner.logprobs(batch, list(range(len(pairs))))
        loss = -(lp.sum() / r_mask.sum())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % w.eval_every == 0 or step == w.max_steps:
            plans = planner.sample([v.request for v in validation], greedy=True).texts
            accuracy = plan_accuracy(plans, [v.target for v in validation])
            history.append({"step": step, "loss": round(loss.item(), 5), "accuracy": accuracy})
            log.info(
                "planner warm-up step %d: loss %.4f, validation plan accuracy %.3f",
                step,
                loss.item(),
                accuracy,
            )
            if accuracy >= w.target_accuracy:
                reached = True
                break
    model.eval()
    report = {
        "steps": step,
        "reached_target": reached,
        "seconds": round(time.monotonic() - start, 1),
        "history": history,
    }
    return planner, report
