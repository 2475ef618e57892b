"""Tokenizer (HF `tokenizers`), the checkpoint's chat template (chat_template.py), streaming detokenizer."""
from __future__ import annotations

import functools
from pathlib import Path

from .errors import QliteError
from .files import read_checkpoint_json, read_text


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer.json as an HF `tokenizers` Tokenizer (read through files.read_text)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(model_dir) / "tokenizer.json"
    text = read_text(path, within=model_dir)
    try:
        return HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise QliteError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the rest
    for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tok = read_tokenizer(model_dir)
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_checkpoint_json(model_dir, cfg_path.name) or {}
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        self.template_origin = str(cfg_path)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and (jinja_file.exists() or jinja_file.is_symlink()):
            template, self.template_origin = read_text(jinja_file, within=model_dir), str(jinja_file)
        if template is not None and not isinstance(template, str):
            raise QliteError(f"{cfg_path}: chat_template is not a template string")
        self.chat_template: str | None = template
        self._compiled = None

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token's through GPT-2's byte alphabet, so half
        a character stays its bytes; other tokenizers' tokens decoded)."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = byte_alphabet()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the checkpoint's chat template, bounded (chat_template.py)."""
        if self.chat_template is None:
            raise QliteError("this checkpoint has no chat template (use --raw)")
        if self._compiled is None:
            from .chat_template import ChatTemplate
            self._compiled = ChatTemplate(self.chat_template, self.template_origin)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


class StreamDecoder:
    """Turns token ids, pushed one at a time, into text pieces; never emits half of a multi-byte
    character (a byte-level decode of an incomplete UTF-8 sequence ends in U+FFFD: wait for more)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are fully emitted
        self.read = 0  # ids in [prefix, read) decode to text already emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
