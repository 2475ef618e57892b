"""`qlite chat`: a multi-turn conversation in the terminal. The whole history is rendered by the chat
template every turn; when it no longer fits the context (with room for the reply), the oldest turns
are dropped (the system message stays) and a notice says so. /reset clears the history, /exit (or
end of input) leaves, /help lists the commands. A line that is not UTF-8 is skipped with a notice."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, TextIO

from .errors import QliteError
from .decode import stream_text
from .generate import SamplingParams
from .pipeline import TextModel


@dataclass
class Conversation:
    lm: TextModel
    params: SamplingParams
    context: int  # tokens the prompt and the reply may take together
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user/assistant messages, oldest first
    speculation: object = None  # a speculate.Speculation, or None

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def fit(self) -> tuple[list[int], int]:
        """The prompt ids for the current turns, the oldest exchanges dropped until there is room for
        max_new_tokens more; (ids, exchanges dropped). The newest message alone needs room for one."""
        dropped = 0
        ids = self.lm.prompt_ids(self.messages())
        while len(ids) + self.params.max_new_tokens > self.context and len(self.turns) > 1:
            del self.turns[:2]  # the oldest user message and its reply
            dropped += 1
            ids = self.lm.prompt_ids(self.messages())
        if len(ids) >= self.context:
            raise QliteError(f"this message is {len(ids)} tokens with the history dropped; the context is "
                             f"{self.context}")
        return ids, dropped

    def reply(self, text: str, write: Callable[[str], None], notice: Callable[[str], None]) -> str:
        self.turns.append({"role": "user", "content": text})
        try:
            ids, dropped = self.fit()
        except QliteError:
            self.turns.pop()
            raise
        if dropped:
            notice(f"(history trimmed: the {dropped} oldest exchange{'s' if dropped > 1 else ''} no longer fit "
                   f"the {self.context}-token context)")
        room = min(self.params.max_new_tokens, self.context - len(ids))
        pieces = []
        for piece in stream_text(self.lm.model, self.lm.tokenizer, ids, replace(self.params, max_new_tokens=room),
                                 self.lm.eos_ids, speculation=self.speculation):
            pieces.append(piece)
            write(piece)
        answer = "".join(pieces)
        self.turns.append({"role": "assistant", "content": answer})
        return answer


HELP = "/reset clears the history, /exit or /quit leaves, /help shows this"


def run_chat(conv: Conversation, stdin: TextIO, out: Callable[[str], None], err: Callable[[str], None],
             interactive: bool) -> None:
    """Read user lines until /exit or end of input; stream each reply to `out`."""
    if conv.lm.tokenizer.chat_template is None:
        raise QliteError("qlite chat needs a checkpoint with a chat template; use qlite generate --raw")
    if interactive:
        err(f"qlite chat: {HELP}\n")
    while True:
        if interactive:
            err("> ")
        line = stdin.readline()
        if not line:
            return
        try:
            line.encode("utf-8")  # a stdin decoded with surrogateescape holds undecodable bytes as surrogates
        except UnicodeEncodeError:
            err("error: stdin: that line is not UTF-8 text; skipped\n")
            continue
        text = line.rstrip("\n")
        command = text.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/help":
            err(HELP + "\n")
            continue
        if command == "/reset":
            conv.turns.clear()
            err("(history cleared)\n")
            continue
        if not text.strip():
            continue
        try:
            conv.reply(text, out, lambda m: err(m + "\n"))
        except QliteError as e:  # one turn that cannot run; the conversation goes on
            err(f"error: {e}\n")
            continue
        out("\n")
