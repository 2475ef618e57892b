"""eval.benchmarks.bench's bandwidth cap (the bytes one decode step reads), its AVX2 runs and its rounds."""
from qlite import native
from qlite.checkpoint import CheckpointDir
from quantize.convert import convert
from tiny_models import make_checkpoint

from eval.benchmarks.bench import (AVX2_TORCH_ENV, avx2_variants, decode_bytes, interleaved, kernel_variants, kv_cache_variants,
                        measure, pool)


def test_decode_bytes_count_the_table_only_when_it_is_the_head(tmp_path):
    tied = make_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True, intermediate_size=192)
    shared = convert(tied, tmp_path / "shared", bits=4, group_size=32, embed_bits=8, progress=False).out_dir
    own = convert(tied, tmp_path / "own", bits=4, group_size=32, embed_bits=4, progress=False).out_dir
    for path, table_read in ((tied, True), (shared, True), (own, False)):
        tensors = CheckpointDir(path).tensors
        table = sum(t.nbytes for n, t in tensors.items() if n.startswith("model.embed_tokens."))
        everything = sum(t.nbytes for t in tensors.values())
        assert decode_bytes({"engine": "qlite", "path": str(path)}) == everything - (0 if table_read else table)


def test_avx2_variants_rerun_qlite_and_llama_cpp_as_on_an_avx2_cpu(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny", seed=1)
    jobs = [("tiny", {"engine": "qlite", "path": str(ckpt), "prompt_tokens": 16, "new_tokens": 4, "repeats": 1,
                      "threads": 1}),
            ("tiny torch-kernels", {"engine": "qlite", "path": str(ckpt), "env": {"QLITE_NATIVE": "0"}}),
            ("q4_0.gguf", {"engine": "llama.cpp", "path": "q4_0.gguf"}),
            ("tiny bf16", {"engine": "transformers", "path": str(ckpt)})]
    variants = dict(avx2_variants(jobs, tmp_path / "lib"))
    assert sorted(variants) == ["q4_0.gguf avx2", "tiny avx2"]  # torch's kernels and transformers: nothing native
    assert variants["tiny avx2"]["env"] == AVX2_TORCH_ENV
    assert variants["q4_0.gguf avx2"]["env"] == {"LLAMA_CPP_LIB_PATH": str((tmp_path / "lib").resolve())}
    if "avx2" in native.ISAS and native.ISAS["avx2"][0] <= native.cpu_flags():
        result = measure(variants["tiny avx2"])  # a fresh process with those variables runs
        assert "error" not in result and result["runs"][0]["decode_tps"] > 0, result


def test_rounds_interleave_the_jobs_and_pool_their_runs():
    assert interleaved(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert interleaved(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    one = {"load_s": 0.5, "runs": [{"decode_tps": 10}], "rss_above_torch": 5, "anon_above_torch": 1, "peak_rss": 9}
    two = {"load_s": 0.7, "runs": [{"decode_tps": 12}, {"decode_tps": 11}], "rss_above_torch": 4,
           "anon_above_torch": 2, "peak_rss": 8}
    assert pool([one, two]) == {"load_s": 0.6, "runs": [{"decode_tps": 10}, {"decode_tps": 12}, {"decode_tps": 11}],
                                "rss_above_torch": 5, "anon_above_torch": 2, "peak_rss": 9}
    assert pool([one, {"error": "boom"}]) == {"error": "boom"}


def test_kernel_variants_run_each_dir_with_each_backend(tmp_path):
    jobs = kernel_variants([tmp_path / "a", tmp_path / "b"], "native-a16,aten", {"threads": 1})
    assert [(label, spec["kernel"]) for label, spec in jobs] == [("a native-a16", "native-a16"), ("b native-a16", "native-a16"),
                                                                 ("a aten", "aten"), ("b aten", "aten")]
    ckpt = make_checkpoint(tmp_path / "tiny", seed=1)
    spec = {"engine": "qlite", "path": str(ckpt), "kernel": "nope", "prompt_tokens": 8, "new_tokens": 2, "repeats": 1,
            "threads": 1}
    assert "--kernel nope" in measure(spec)["error"]  # the backend reaches the load


def test_kv_cache_variants_run_each_dir_with_each_kind(tmp_path):
    jobs = kv_cache_variants([tmp_path / "a"], "int8,int4", {"threads": 1})
    assert [(label, spec["kv_cache"]) for label, spec in jobs] == [("a kv int8", "int8"), ("a kv int4", "int4")]
    ckpt = make_checkpoint(tmp_path / "tiny", seed=1)  # head_dim 16: a quantized cache is refused at load
    spec = {"engine": "qlite", "path": str(ckpt), "kv_cache": "int8", "prompt_tokens": 8, "new_tokens": 2, "repeats": 1,
            "threads": 1}
    assert "--kv-cache int8" in measure(spec)["error"]


def test_a_json_schema_run_decodes_under_the_grammar(tmp_path):
    """The constrained job decodes its tokens (all new_tokens: past the document's end it feeds eos,
    the one token the grammar then allows, so the timing covers every step)."""
    import json
    ckpt = make_checkpoint(tmp_path / "tiny", seed=1)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    spec = {"engine": "qlite", "path": str(ckpt), "json_schema": str(schema), "prompt_tokens": 8, "new_tokens": 12,
            "repeats": 1, "threads": 1, "dtype": "float32"}
    result = measure(spec)
    assert "error" not in result and result["runs"][0]["decode_tps"] > 0, result


def test_decode_bytes_count_a_mixtures_experts_by_the_share_a_token_reads(tmp_path):
    """k of E experts a token: the same bytes from qlite's checkpoint and from its GGUF (merged expert stacks)."""
    from quantize.gguf_export import export_gguf
    from tiny_models import MOE
    src = make_checkpoint(tmp_path / "moe", seed=4, model_type="qwen3_moe", **MOE["qwen3_moe"])
    ckpt = CheckpointDir(src)
    share = ckpt.config.experts.per_token / ckpt.config.experts.count
    experts = sum(t.nbytes for n, t in ckpt.tensors.items() if ".mlp.experts." in n)
    everything = sum(t.nbytes for n, t in ckpt.tensors.items() if not n.startswith("model.embed_tokens."))
    assert 0 < share < 1 and experts > 0
    assert decode_bytes({"engine": "qlite", "path": str(src)}) == round(everything - experts * (1 - share))
    gguf = tmp_path / "moe.gguf"
    export_gguf(ckpt, gguf, force=False, progress=False)
    assert abs(decode_bytes({"engine": "llama.cpp", "path": str(gguf)}) - decode_bytes({"engine": "qlite", "path": str(src)})) < 64
