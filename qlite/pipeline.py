"""A loaded checkpoint with its tokenizer: prompt formatting and text generation in one object."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from .errors import QliteError
from .fields import field_of, is_int
from .files import read_checkpoint_json
from .decode import stream_text
from .generate import SamplingParams
from .messages import check_messages, checked_text
from .tokenizer import Tokenizer


def sampling_defaults(model_dir: Path) -> dict:
    """Sampling settings from generation_config.json; greedy unless it asks for sampling."""
    path = model_dir / "generation_config.json"
    gen = read_checkpoint_json(model_dir, path.name) or {}
    if not field_of(gen, "do_sample", bool, str(path), False):
        return {}
    keys = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float}
    defaults = {k: field_of(gen, k, kind, str(path), None) for k, kind in keys.items()}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    try:
        SamplingParams(**defaults)  # checked here, so that a bad value names this file
    except (TypeError, ValueError, QliteError) as e:
        raise QliteError(f"{path}: {e}") from None
    return defaults


def eos_token_ids(model_dir: Path, config_eos, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = set(config_eos)
    gen_eos = (read_checkpoint_json(model_dir, "generation_config.json") or {}).get("eos_token_id")
    gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    if not all(is_int(e) for e in gen_eos):
        raise QliteError(f"{model_dir / 'generation_config.json'}: eos_token_id must be an integer or a list of "
                         f"integers, got {gen_eos!r}"[:300])
    ids.update(gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@dataclass
class TextModel:
    model: object
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    defaults: dict = field(default_factory=dict)

    def prompt_ids(self, prompt: str | list[dict], chat: bool | None = None, system: str | None = None,
                   tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt. A string in chat mode (default: when the checkpoint has a template)
        is a user message after an optional system message; a list of messages (messages.py) is a whole
        conversation, rendered by the chat template, with `tools` (function schemas) where given."""
        if isinstance(prompt, list):
            messages = check_messages(prompt)
            if system:
                messages = [{"role": "system", "content": system}] + messages
            if self.tokenizer.chat_template is None:
                raise QliteError("a list of messages needs a chat template, and this checkpoint has none")
            extra = {"tools": tools} if tools else {}
            return self._encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": prompt}]
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self._encode(checked_text(prompt, "the prompt"))

    def _encode(self, text: str) -> list[int]:
        """Token ids, each one the model has: a tokenizer.json that makes ids past config.json's
        vocab_size is an error naming both, not an index past the embedding table."""
        ids = self.tokenizer.encode(text)
        vocab = self.model.config.vocab_size
        if ids and max(ids) >= vocab:
            raise QliteError(f"tokenizer.json gave token id {max(ids)}, past the model's vocab_size {vocab} "
                             "(config.json): the tokenizer is not this model's")
        return ids

    def params(self, **overrides) -> SamplingParams:
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(SamplingParams(), **{**self.defaults, **given})

    def stream(self, prompt: str | list[dict], chat: bool | None = None, system: str | None = None,
               speculate: str | None = None, draft_tokens: int = 7, json_schema=None, **sampling) -> Iterator[str]:
        """speculate: "lookup" or a draft model's dir for speculative decoding (speculate.py: the same text,
        fewer forwards). json_schema: a JSON schema (dict; True: any JSON object) the output is
        constrained to (constrain.py)."""
        from .speculate import speculation
        ids = self.prompt_ids(prompt, chat, system)
        constraint = None
        if json_schema is not None:
            from .constrain import json_schema_grammar
            constraint = self.constraint(json_schema_grammar(json_schema))
        return stream_text(self.model, self.tokenizer, ids, self.params(**sampling), self.eos_ids,
                           speculation=speculation(speculate, self, draft_tokens), constraint=constraint)

    def generate(self, prompt: str | list[dict], chat: bool | None = None, system: str | None = None,
                 speculate: str | None = None, draft_tokens: int = 7, json_schema=None, **sampling) -> str:
        return "".join(self.stream(prompt, chat, system, speculate, draft_tokens, json_schema, **sampling))

    def constraint(self, grammar: str):
        """A constrain.Constraint of `grammar` for one sequence of this model."""
        from .constrain import Constraint
        return Constraint(grammar, self.tokenizer, self.model.config.vocab_size, self.eos_ids)


THREADS_PER_CPU = 8  # the most threads a run may ask for per CPU: more only oversubscribes (and from
# ~20,000 OpenMP aborts or the process crashes)


def checked_threads(threads) -> int:
    """--threads: a positive integer, at most THREADS_PER_CPU per CPU of this machine."""
    import os

    limit = THREADS_PER_CPU * (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise QliteError(f"--threads {threads!r}: must be an integer from 1 to {limit} "
                         f"({THREADS_PER_CPU} per CPU of this machine)")
    return threads


def load(model_dir: str | Path, dtype: str = "auto", device: str = "cpu", kernel: str = "auto",
         threads: int | None = None, kv_cache: str = "bf16") -> TextModel:
    """Load a checkpoint dir (16-bit or quantized by qlite) with its tokenizer. `threads`: CPU threads
    for torch and qlite's kernels (default: torch's, one per core); kv_cache: bf16, int8 or int4."""
    import torch

    from .loader import load_model

    if threads is not None:
        torch.set_num_threads(checked_threads(threads))
    model_dir = Path(model_dir).expanduser()
    model = load_model(model_dir, dtype=dtype, device=device, kernel=kernel, kv_cache=kv_cache)
    tokenizer = Tokenizer(model_dir)
    return TextModel(model, tokenizer, eos_token_ids(model_dir, model.config.eos_token_ids, tokenizer),
                     sampling_defaults(model_dir))
