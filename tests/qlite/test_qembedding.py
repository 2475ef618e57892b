"""QuantEmbedding: a lookup equals the dequantized table's rows and dequantizes only those rows."""
import pytest
import torch

from qlite.formats import Int4, format_named
from qlite.qembedding import QuantEmbedding


def table_of(fmt_name: str, vocab: int = 300, dim: int = 64) -> tuple[QuantEmbedding, torch.Tensor]:
    fmt = format_named(fmt_name)
    embedding = QuantEmbedding(vocab, dim, fmt)
    stored = fmt.quantize(torch.randn(vocab, dim, generator=torch.Generator().manual_seed(1)))
    for name, t in stored.items():
        setattr(embedding, name, t)
    return embedding, fmt.dequantize(stored, dim)


@pytest.mark.parametrize("fmt_name", ["int8", "int8-g32", "int4-g32", "int4-g64-sym", "nf4-b64", "llm.int8"])
def test_lookup_equals_the_dequantized_tables_rows(fmt_name):
    embedding, table = table_of(fmt_name)
    ids = torch.tensor([[0, 299, 5, 5], [17, 1, 2, 298]])
    assert torch.equal(embedding(ids), table[ids])  # (2, 4, 64), bit for bit
    assert embedding(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 64)


def test_only_the_looked_up_rows_are_dequantized(monkeypatch):
    embedding, _ = table_of("int4-g32")
    rows_seen = []
    original = Int4.dequantize
    monkeypatch.setattr(Int4, "dequantize", lambda self, stored, k: rows_seen.append(stored["qweight"].shape[0])
                        or original(self, stored, k))
    embedding(torch.tensor([[3, 4, 5]]))
    assert rows_seen == [3]  # never the 300-row table


def test_an_id_out_of_range_is_an_index_error():
    embedding, _ = table_of("int8")
    with pytest.raises(IndexError):
        embedding(torch.tensor([[300]]))
    with pytest.raises(IndexError):
        embedding(torch.tensor([[-1]]))


@pytest.mark.parametrize("fmt_name", ["int4h-g128", "int3h-g128"])
def test_a_rotated_table_looks_up_the_weights_it_stands_for(fmt_name):
    """A rotated format's rows come back turned back (W R R^T): the table's rows, not the stored basis."""
    embedding, table = table_of(fmt_name, dim=256)
    ids = torch.tensor([[0, 299, 5, 5], [17, 1, 2, 298]])
    torch.testing.assert_close(embedding(ids), table[ids], atol=1e-6, rtol=0)
    source = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))
    assert torch.nn.functional.cosine_similarity(embedding(ids).flatten(), source[ids].flatten(), dim=0) > 0.97
