"""llama.cpp GGUF files as `qlite eval` peers: the same token ids run through llama.cpp (by
llama-cpp-python, the bench extra) with logits for every position, so a GGUF's row stands in the
same table as qlite's checkpoints, scored against the same baseline on the same tokens."""
from __future__ import annotations

from pathlib import Path

import torch

from qlite.errors import QliteError
from qlite.files import open_regular
from qlite.tokenizer import Tokenizer

PROBE = "def add(a, b):\n    return a + b  # the sum, 2 ways\n"  # tokenized alike, or the vocabularies differ


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def describe_gguf(path: Path) -> tuple[str, float, float]:
    """(format, bits per weight of the decoder's linears, size in MiB), as describe_model gives them."""
    from gguf import GGUFReader, LlamaFileType

    open_regular(path).close()  # a FIFO or device is an error, not a hang
    try:
        reader = GGUFReader(path)
        file_type = LlamaFileType(int(reader.fields["general.file_type"].contents())).name.removeprefix("MOSTLY_")
    except Exception as e:  # a file from anywhere: whatever gguf's reader trips on is one line
        raise QliteError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    bits = 8 * sum(int(t.n_bytes) for t in linears) / max(sum(int(t.n_elements) for t in linears), 1)
    return f"llama.cpp {file_type}", bits, path.stat().st_size / 2**20


class GgufPeer:
    """Logits (B, T, vocab) float32 for token ids (B, T), each row from an empty context."""

    def __init__(self, path: Path, ctx: int, tokenizer: Tokenizer, vocab_size: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise QliteError(f"{path}: scoring a GGUF needs llama-cpp-python (pip install 'qlite[bench]')") from None
        describe_gguf(path)  # a file gguf's own reader cannot parse never reaches llama.cpp
        self.llm = Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                         n_threads=torch.get_num_threads(), verbose=False)
        if self.llm.n_vocab() != vocab_size:
            raise QliteError(f"{path}: vocabulary of {self.llm.n_vocab()} tokens, the baseline's has {vocab_size}")
        if self.llm.tokenize(PROBE.encode(), add_bos=False, special=False) != tokenizer.encode(PROBE):
            raise QliteError(f"{path}: its tokenizer differs from the baseline's; the models must score the same tokens")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in ids.tolist():
            self.llm.reset()
            self.llm.eval(row)
            rows.append(torch.from_numpy(self.llm.scores[:len(row)].copy()))  # (T, vocab)
        return torch.stack(rows)

    def greedy(self, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
        """llama.cpp's greedy continuation of the prompt's ids (each token the argmax of its logits, as its
        greedy sampler takes): at most max_new_tokens, ending before a stop id."""
        self.llm.reset()
        self.llm.eval(prompt)
        answer = []
        while len(answer) < max_new_tokens:
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())  # the last position's logits
            if token in stop:
                break
            answer.append(token)
            self.llm.eval([token])
        return answer
