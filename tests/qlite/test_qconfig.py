"""QuantConfig: every per-module rule, the flags' lm_head rule, and config.json round trips."""
import dataclasses

import pytest

from qlite.errors import QliteError
from qlite.formats import Int4, Int8, format_named
from qlite.qconfig import QuantConfig

LEGACY_INT4 = {"quant_method": "qlite", "format_version": 1, "method": "rtn", "scheme": "int", "bits": 4,
               "group_size": 64, "symmetric": True, "modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"], "lm_head_bits": 4, "skip": []}


def test_format_for_each_module():
    q = QuantConfig.from_options(bits=4, group_size=64, skip=("layers.1.mlp",))
    assert q.format_for("model.layers.0.self_attn.q_proj") == Int4(64)
    assert q.format_for("model.layers.0.mlp.down_proj") == Int4(64)
    assert q.format_for("model.layers.1.mlp.down_proj") is None  # skipped
    assert q.format_for("model.layers.1.self_attn.o_proj") == Int4(64)
    assert q.format_for("lm_head") == Int8()  # the default: int8 per output row
    assert q.format_for("model.embed_tokens") == Int8()  # the default: int8 per row
    assert QuantConfig.from_options(scheme="nf4").format_for("model.embed_tokens") is None


@pytest.mark.parametrize("options, head", [
    (dict(bits=8, group_size=None, lm_head_bits=4), "int4-g128"),
    (dict(bits=8, group_size=64, lm_head_bits=4, symmetric=True), "int4-g64-sym"),  # from the flags, not silently g128
    (dict(bits=4, group_size=32, lm_head_bits=4), "int4-g32"),
    (dict(bits=4, group_size=32, lm_head_bits=8), "int8"),
    (dict(bits=4, group_size=32, lm_head_bits=16), None),
    (dict(scheme="nf4", group_size=None), None),  # bitsandbytes formats keep lm_head 16-bit by default
    (dict(scheme="llm.int8", bits=4), None),  # --bits does not apply to bitsandbytes' formats
])
def test_lm_head_follows_the_flags(options, head):
    q = QuantConfig.from_options(**options)
    assert (q.lm_head.name if q.lm_head else None) == head


def test_config_json_round_trip_and_legacy_lm_head():
    q = QuantConfig.from_options(bits=8, group_size=64, lm_head_bits=4, method="gptq", params={"damp": 0.02})
    d = q.to_dict()
    assert d["lm_head_format"] == "int4-g64" and d["damp"] == 0.02 and d["bits"] == 8
    assert QuantConfig.from_dict(d, "c.json") == q
    legacy = QuantConfig.from_dict(LEGACY_INT4, "c.json")  # written before lm_head_format existed
    assert legacy.linear == legacy.lm_head == Int4(64, True)
    assert QuantConfig.from_dict({**LEGACY_INT4, "bits": 8}, "c.json").lm_head == Int4(128, False)
    assert QuantConfig.from_dict({**LEGACY_INT4, "lm_head_bits": 8}, "c.json").lm_head == Int8()
    assert format_named(q.suffix.removeprefix("gptq-")) == q.linear
    assert d["embed_format"] == "int8" and "embed_format" not in QuantConfig.from_options(embed_bits=16).to_dict()
    assert QuantConfig.from_dict(LEGACY_INT4, "c.json").embeddings is None  # written before embed_format


@pytest.mark.parametrize("options, table, shared", [
    (dict(bits=4, group_size=32, embed_bits=8), "int8", True),  # the int8 head is the same format
    (dict(bits=4, group_size=32, embed_bits=4), "int4-g32", False),
    (dict(bits=4, group_size=32, embed_bits=4, lm_head_bits=4), "int4-g32", True),
    (dict(bits=4, group_size=32, embed_bits=8, lm_head_bits=16), "int8", False),
    (dict(bits=4, group_size=32, lm_head_bits=16, embed_bits=16), None, True),  # one float table, as before
])
def test_embeddings_follow_the_flags_and_round_trip(options, table, shared):
    q = QuantConfig.from_options(**options)
    assert (q.embeddings.name if q.embeddings else None) == table == (q.format_for("model.embed_tokens").name
                                                                       if table else None)
    assert q.shares_table(True) == shared and not q.shares_table(False)
    assert QuantConfig.from_dict(q.to_dict(), "c.json") == q
    assert (f"embeddings {table}" in q.describe()) == (table is not None)
    with pytest.raises(QliteError, match="--embed-bits 6: choose 4, 8 or 16"):
        QuantConfig.from_options(embed_bits=6)


def test_module_formats_take_precedence_and_round_trip():
    mixed = (("model.layers.0.mlp.down_proj", format_named("int8")), ("model.layers.1.self_attn.q_proj", None))
    q = dataclasses.replace(QuantConfig.from_options(bits=4, group_size=64), module_formats=mixed,
                            params={"target_bpw": 5.5})
    assert q.format_for("model.layers.0.mlp.down_proj") == format_named("int8")
    assert q.format_for("model.layers.1.self_attn.q_proj") is None
    assert q.format_for("model.layers.1.mlp.down_proj") == format_named("int4-g64")  # not named: the main format
    d = q.to_dict()
    assert d["format_version"] == 3 and d["module_formats"] == {"model.layers.0.mlp.down_proj": "int8",
                                                                 "model.layers.1.self_attn.q_proj": None}
    assert QuantConfig.from_dict(d, "c.json") == q
    assert QuantConfig.from_dict({**d, "input_order": True}, "c.json").input_order  # both features: version 3
    assert q.suffix == "bpw5.5" and "rtn mixed: 16-bit, int8 (2 linears by name), lm_head int8" in q.describe()


@pytest.mark.parametrize("change, message", [
    ({"format_version": 4}, "format_version 4 is unknown"),
    ({"format_version": 2}, "format_version 2 does not match"),
    ({"format_version": 3}, "format_version 3 does not match"),
    ({"input_order": True}, "format_version 1 does not match"),
    ({"module_formats": {"model.layers.0.mlp.down_proj": "int8"}}, "format_version 1 does not match"),
    ({"format_version": 3, "module_formats": {"lm_head": "int8"}}, "module_formats must map decoder linears"),
    ({"format_version": 3, "module_formats": {"model.layers.0.mlp.down_proj": "int9"}}, "format 'int9': unknown"),
    ({"quant_method": "awq"}, "quantization method 'awq'"),
    ({"bits": 5}, "c.json: bits 5: the int scheme has 4 and 8 bits"),
    ({"bits": "x"}, "quantization_config: bits must be an integer, got .x."),
    ({"bits": 4.0}, "bits must be an integer"),
    ({"symmetric": "false"}, "symmetric must be true or false"),
    ({"group_size": "128"}, "group_size must be an integer"),
    ({"lm_head_format": "int9"}, "format 'int9': unknown"),
    ({"embed_format": "int4-g0"}, "group size 0"),
    ({"modules": ["conv"]}, "modules must be among"),
])
def test_bad_quantization_configs_are_refused(change, message):
    """(An older qlite refuses format_version 2 and 3, so it never runs an input_order or mixed checkpoint wrong.)"""
    with pytest.raises(QliteError, match=message):
        QuantConfig.from_dict({**LEGACY_INT4, **change}, "c.json")
