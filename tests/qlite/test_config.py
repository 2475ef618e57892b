import pytest

from qlite.config import Qwen2Config
from qlite.errors import QliteError

BASE = dict(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_reads_rope_theta_from_either_place_and_eos_list():
    old = Qwen2Config.from_dict(dict(BASE, rope_theta=5e5, eos_token_id=7))
    new = Qwen2Config.from_dict(dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                     eos_token_id=[7, 8]))
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.eos_token_ids == (7,) and new.eos_token_ids == (7, 8)
    assert old.head_dim == 16


@pytest.mark.parametrize("change, message", [
    (dict(model_type="mistral"), "model_type is 'mistral'"),
    (dict(num_attention_heads=5), "not divisible by num_attention_heads"),
    (dict(num_key_value_heads=3), "not divisible by num_key_value_heads"),
    (dict(hidden_size=0), "hidden_size must be positive"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive number"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive number"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a small positive number"),
])
def test_invalid_configs_are_named(change, message):
    d = {k: v for k, v in dict(BASE, **change).items() if v is not None}
    with pytest.raises(QliteError, match=message):
        Qwen2Config.from_dict(d)
