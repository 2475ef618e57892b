import pytest

from qlite.config import ModelConfig
from qlite.errors import QliteError

BASE = dict(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_reads_rope_theta_from_either_place_and_eos_list():
    old = ModelConfig.from_dict(dict(BASE, rope_theta=5e5, eos_token_id=7))
    new = ModelConfig.from_dict(dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
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
        ModelConfig.from_dict(d)


# --- the config-field table (arch/config_fields.py) --------------------------------------------------

def transformers_fields(model_type: str) -> set[str]:
    """Every field transformers' config class for the type writes, defaults and all."""
    from transformers import AutoConfig
    return set(AutoConfig.for_model(model_type).to_dict())


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_every_field_of_transformers_config_has_a_rule(model_type):
    from qlite.arch import architecture
    from qlite.arch.config_fields import COMMON
    table = {**COMMON, **architecture(model_type, "test").config_fields}
    assert transformers_fields(model_type) <= set(table), transformers_fields(model_type) - set(table)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="relu"), "hidden_act 'relu': qlite does not implement it \\(it runs silu"),
    (dict(model_type="llama", hidden_act="gelu"), "hidden_act 'gelu': qlite does not implement it"),
    (dict(final_logit_softcapping=30.0), "field 'final_logit_softcapping': qlite does not know"),
    (dict(partial_rotary_factor=0.5), "field 'partial_rotary_factor'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}), "field 'low_freq_factor'"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(use_sliding_window=True), "use_sliding_window True"),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias True"),
])
def test_fields_qlite_does_not_run_are_refused_by_name(change, message):
    with pytest.raises(QliteError, match=message):
        ModelConfig.from_dict(dict(BASE, **change))


def test_hidden_act_changes_transformers_logits_and_qlite_refuses_it(tmp_path):
    """The reproduction: a relu Qwen2 ran as SiLU with exit 0 (logits off by up to 1.0)."""
    import json

    import torch

    from qlite.loader import load_model
    from tiny_models import hf_model, make_checkpoint
    relu = make_checkpoint(tmp_path / "relu", hidden_act="relu")
    ids = torch.tensor([[1, 5, 9, 300]])
    with torch.no_grad():
        theirs = hf_model(relu)(ids).logits
        config = json.loads((relu / "config.json").read_text())
        (relu / "config.json").write_text(json.dumps(dict(config, hidden_act="silu")))
        assert (hf_model(relu)(ids).logits - theirs).abs().max() > 1e-3  # the field matters
        (relu / "config.json").write_text(json.dumps(config))
    with pytest.raises(QliteError, match="hidden_act 'relu'"):
        load_model(relu)


@pytest.mark.parametrize("model_type, changes", [
    ("qwen2", dict(attention_bias=False, pad_token_id=3, use_cache=False, initializer_range=0.5,
                   attention_dropout=0.5, sliding_window=2, max_window_layers=0, hidden_act="swish",
                   _attn_implementation="sdpa", tokenizer_class="x", output_attentions=False)),
    ("llama", dict(pretraining_tp=2, pad_token_id=3, attention_dropout=0.5)),
])
def test_ignored_fields_do_not_change_transformers_logits(tmp_path, model_type, changes):
    """What the table ignores, transformers ignores too (at inference): its logits stay bitwise the same."""
    import json

    import torch

    from qlite.arch import architecture
    from qlite.arch.config_fields import COMMON, Ignored, Only
    from tiny_models import hf_model, make_checkpoint
    table = {**COMMON, **architecture(model_type, "test").config_fields}
    assert all(isinstance(table[k], (Ignored, Only)) for k in changes)
    path = make_checkpoint(tmp_path / "m", model_type=model_type)
    ids = torch.tensor([[1, 5, 9, 300, 7, 7, 2]])
    with torch.no_grad():
        before = hf_model(path)(ids).logits
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, **changes)))
        ModelConfig.from_dict(json.loads((path / "config.json").read_text()))  # qlite takes them
        assert torch.equal(hf_model(path)(ids).logits, before)
