"""What every model type must do, checked on a tiny random checkpoint transformers writes for it
(tests/qlite/test_arch_*.py call these): logits and greedy tokens equal transformers', int4 quantize,
generate and serve work, and a GGUF written as llama.cpp's converter writes that type imports back to the
same logits."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import torch

from qlite.cli import main
from qlite.decode import generate_tokens
from qlite.generate import SamplingParams
from qlite.loader import load_model
from tiny_models import hf_model

IDS = torch.randint(0, 260, (2, 23), generator=torch.Generator().manual_seed(1))


def assert_logits_match(path, ours=None, tolerance=1e-4):
    ours = ours or load_model(path, dtype="float32")
    with torch.no_grad():
        diff = (ours(IDS) - hf_model(path)(IDS).logits).abs().max().item()
    assert diff <= tolerance, f"max abs logit difference {diff}"


def assert_greedy_matches(path, n=12):
    ours, ref = load_model(path, dtype="float32"), hf_model(path)
    prompt = [5, 17, 99, 3, 250, 41]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, ref(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    got = [int(t[0]) for t in generate_tokens(ours, [prompt], SamplingParams(max_new_tokens=n), eos_ids=())]
    assert got == ids[0, len(prompt):].tolist()


def assert_int4_quantizes_generates_and_serves(path, tmp_path, capsys):
    out = tmp_path / "int4"
    assert main(["quantize", str(path), "--bits", "4", "--group-size", "32", "--out", str(out)]) == 0
    assert main(["generate", "-m", str(out), "-p", "the thin tin", "--max-new-tokens", "6", "--raw"]) == 0
    assert main(["info", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "int4-g32" in printed and "fidelity" in printed
    serve_once(out)


def serve_once(model_dir):
    """One chat request through the OpenAI server equals the Python API's answer."""
    import http.client

    import uvicorn

    from qlite.serve.engine import Engine
    from qlite.pipeline import load
    from qlite.serve.server import Limits, make_app, server_config

    lm = load(model_dir, dtype="float32")
    want = lm.generate("hi there", max_new_tokens=8)
    limits = Limits(max_body_bytes=64 * 1024, timeout_s=5.0, max_connections=8)
    engine = Engine(lm, max_batch=2, ctx=128).start()
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(server_config(make_app(lm, engine, "tiny", limits), "127.0.0.1", port, limits))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not srv.started and time.time() < deadline:
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}))
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 200, body
        assert body["choices"][0]["message"]["content"] == want
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.stop()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """How llama.cpp's convert_hf_to_gguf.py reorders Llama's q/k rows (LlamaModel.permute): within each
    head, the two halves of the rotation interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def assert_gguf_round_trip(path, tmp_path, gguf_arch: str, permuted_heads=None):
    """export --to gguf, then the file's tensors as llama.cpp's converter writes them (names; q/k rows
    permuted for the types it permutes), then import-gguf gives transformers' logits again."""
    from gguf import GGUFReader

    from qlite.checkpoint import CheckpointDir

    gguf = tmp_path / "model.gguf"
    assert main(["export", str(path), "--to", "gguf", "--out", str(gguf)]) == 0
    reader = GGUFReader(gguf)
    assert reader.fields["general.architecture"].contents() == gguf_arch
    src, tensors = CheckpointDir(path), {t.name: t for t in reader.tensors}
    for layer in range(src.config.num_hidden_layers):
        for short, n_head in (("q", src.config.num_attention_heads), ("k", src.config.num_key_value_heads)):
            hf = src.read(f"model.layers.{layer}.self_attn.{short}_proj.weight").float().numpy()
            want = llama_cpp_permute(hf, n_head) if permuted_heads else hf
            got = np.asarray(tensors[f"blk.{layer}.attn_{short}.weight"].data, dtype=np.float32).reshape(hf.shape)
            assert np.allclose(got, want, atol=1e-3), f"blk.{layer}.attn_{short}.weight"
    assert_llama_cpp_agrees(path, gguf)
    back = tmp_path / "back"
    assert main(["import-gguf", str(gguf), str(back), "--dtype", "float32"]) == 0
    assert json.loads((back / "config.json").read_text())["model_type"] == src.config.model_type
    assert_logits_match(path, load_model(back, dtype="float32"))  # float32 in the file, as stored


def assert_llama_cpp_agrees(path, gguf):
    """Where llama-cpp-python is installed (the bench extra): llama.cpp runs the exported file to
    transformers' logits (it reads the names, the row order, the norms as its converter writes them)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    llm = Llama(model_path=str(gguf), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=1)
    ids = IDS[0].tolist()
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)]))
    with torch.no_grad():
        ref = hf_model(path)(IDS[:1]).logits[0]
    assert (theirs - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
