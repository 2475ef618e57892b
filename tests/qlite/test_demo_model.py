"""The real demo model (Qwen2.5-Coder-0.5B-Instruct, dequantized from its GGUF) against transformers
loading the same GGUF."""
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from qlite.loader import load_model
from qlite.tokenizer import Tokenizer
from tiny_models import PRIME_PROMPT, check_prime_code

pytestmark = pytest.mark.demo

STRINGS = [
    "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * 2; }  // C++",
    "你好，世界！这是一个测试。机器学习",
    "emoji 🤖🎉👍🏽 and a family 👨‍👩‍👧 and flags 🇯🇵",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "a    b\n\n\n\tc   \n  \r\n    \n",
    "numbers 1234567890 3.14159 -1e-6 0xFF",
    "Ça va? naïve café — «quotes» ‘single’",
    "<tool_call>{\"name\": \"f\"}</tool_call><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
    "   leading and trailing spaces   ",
    "",
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(demo_gguf):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name)


def test_tokenizer_matches_transformers_on_the_gguf(demo_dir, hf_gguf_tokenizer):
    ours = Tokenizer(demo_dir)
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == hf_gguf_tokenizer.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == s


def test_logits_match_transformers_on_the_gguf(demo_dir, demo_gguf):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([Tokenizer(demo_dir).encode(inspect.getsource(textwrap))[:512]])
    with torch.no_grad():
        ours = load_model(demo_dir, dtype="float32")(ids)
        ref = AutoModelForCausalLM.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name,
                                                   dtype=torch.float32).eval()
        theirs = ref(ids).logits
    diff = (ours - theirs).abs().max().item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"\ndemo logits vs transformers (GGUF, fp32), 512 tokens: max abs diff {diff:.4g}, "
          f"argmax agreement {agree:.2%} (qlite reads the float16 import)")
    assert agree >= 0.999
    assert diff < 0.05  # the float16 rounding of the imported weights, nothing more


def test_greedy_chat_writes_a_working_prime_function(demo_dir):
    r = subprocess.run([sys.executable, "-m", "qlite", "generate", "-m", str(demo_dir), "-p", PRIME_PROMPT,
                        "--temperature", "0", "--max-new-tokens", "400"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    check_prime_code(r.stdout)
