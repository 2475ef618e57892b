import pytest

from qlite.errors import QliteError
from qlite.tokenizer import StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt)


def test_chat_template_matches_transformers(tiny_ckpt, tok):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tiny_ckpt / "tokenizer.json"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the thin tin"}]
    expected = ref.apply_chat_template(messages, chat_template=tok.chat_template, tokenize=False,
                                       add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    ids = tok.encode(expected)
    assert tok.token_id("<|im_start|>") in ids and tok.decode(ids) == expected


def test_chat_template_runs_in_a_sandbox(tok):
    evil = Tokenizer.__new__(Tokenizer)
    evil.__dict__.update(tok.__dict__, _compiled=None,
                         chat_template="{{ messages.__class__.__init__.__globals__['os'].system('echo pwned') }}")
    with pytest.raises(QliteError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    mutate = Tokenizer.__new__(Tokenizer)
    mutate.__dict__.update(tok.__dict__, _compiled=None, chat_template="{{ messages.append(1) }}")
    with pytest.raises(QliteError, match="chat template"):
        mutate.apply_chat_template([{"role": "user", "content": "x"}])


def test_stream_decoder_never_splits_a_character(tok):
    text = "héllo 😀 世界 the end"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: several tokens per multi-byte character
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(QliteError, match="tokenizer.json: not found"):
        Tokenizer(tmp_path)
