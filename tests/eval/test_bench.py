"""eval.bench's bandwidth cap: the bytes one decode step reads."""
from qlite.checkpoint import CheckpointDir
from quantize.convert import convert
from tiny_models import make_checkpoint

from eval.bench import decode_bytes


def test_decode_bytes_count_the_table_only_when_it_is_the_head(tmp_path):
    tied = make_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True, intermediate_size=192)
    shared = convert(tied, tmp_path / "shared", bits=4, group_size=32, embed_bits=8, progress=False).out_dir
    own = convert(tied, tmp_path / "own", bits=4, group_size=32, embed_bits=4, progress=False).out_dir
    for path, table_read in ((tied, True), (shared, True), (own, False)):
        tensors = CheckpointDir(path).tensors
        table = sum(t.nbytes for n, t in tensors.items() if n.startswith("model.embed_tokens."))
        everything = sum(t.nbytes for t in tensors.values())
        assert decode_bytes({"engine": "qlite", "path": str(path)}) == everything - (0 if table_read else table)
