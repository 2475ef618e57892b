"""qlite chat: each reply is the Python API's answer to the whole conversation so far; the history is
trimmed with a notice when it fills the context; /reset and /exit."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlite.chat import Conversation, run_chat
from qlite.errors import QliteError
from qlite.pipeline import load


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


def chat(lm, lines, context=256, max_new_tokens=6, system=None):
    out, err = io.StringIO(), io.StringIO()
    conv = Conversation(lm, lm.params(max_new_tokens=max_new_tokens), context, system)
    run_chat(conv, io.StringIO("".join(line + "\n" for line in lines)), out.write, err.write, interactive=False)
    return out.getvalue().splitlines(), err.getvalue(), conv


def test_replies_follow_the_conversation(lm):
    replies, err, conv = chat(lm, ["the", "he", "/reset", "in", "/exit", "never read"], system="be brief")
    assert err == "(history cleared)\n"
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the"}]
    first = lm.generate(history, max_new_tokens=6)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "he"}]
    second = lm.generate(history, max_new_tokens=6)
    third = lm.generate([{"role": "system", "content": "be brief"}, {"role": "user", "content": "in"}],
                        max_new_tokens=6)
    assert replies == [first, second, third]
    assert [t["content"] for t in conv.turns] == ["in", third]


def test_history_is_trimmed_with_a_notice(lm):
    one = len(lm.prompt_ids([{"role": "user", "content": "the the the"}]))
    replies, err, conv = chat(lm, ["the the the"] * 4, context=2 * one + 10, max_new_tokens=4)
    assert len(replies) == 4 and "history trimmed" in err
    assert len(conv.turns) <= 4  # never more than fits
    too_long = "the " * 300
    replies, err, _ = chat(lm, [too_long, "he"], context=64, max_new_tokens=4)
    assert "error: this message is" in err and len(replies) == 1  # that turn refused, the next one answered


def test_chat_command(tiny_ckpt):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "qlite", "chat", "-m", str(tiny_ckpt), "--max-new-tokens", "5",
                        "--dtype", "float32"], input="the\n/exit\n", capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    want = load(tiny_ckpt, dtype="float32").generate([{"role": "user", "content": "the"}], max_new_tokens=5)
    assert r.stdout == want + "\n"
    r = subprocess.run([sys.executable, "-m", "qlite", "chat", "-m", str(tiny_ckpt), "--max-new-tokens", "5",
                        "--dtype", "float32"], input=b"\xff\xfe\n/help\nthe\n/quit\nhe\n", capture_output=True,
                       env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0 and "error: stdin: that line is not UTF-8 text; skipped" in err, err  # the session goes on
    assert "/exit or /quit leaves" in err and r.stdout.decode() == want + "\n"  # /help answered; /quit before "he"


def test_a_megabyte_message_is_refused_by_the_context_not_the_template(lm):
    replies, err, _ = chat(lm, ["x " * 500_000, "the"], context=64, max_new_tokens=4)
    assert "error: this message is" in err and "template" not in err and len(replies) == 1
