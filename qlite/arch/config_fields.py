"""Every config.json field qlite knows, and what it does with each: read (ModelConfig.from_dict takes it
and checks it), accepted only at the values that mean what qlite runs, or ignored because it cannot
change a forward pass (said why). A field in no table is refused by name: a new transformers feature
is a refusal until someone implements it, never a silently different model. One table for what every
model type shares (COMMON), and each Architecture adds or overrides its own (`config_fields`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import QliteError


@dataclass(frozen=True)
class Read:
    """ModelConfig.from_dict reads it (strictly typed, validated there)."""
    what: str


@dataclass(frozen=True)
class Only:
    """Accepted at the values `ok` allows (what qlite runs, named by `runs`); any other is refused."""
    ok: Callable[[object], bool]
    runs: str


@dataclass(frozen=True)
class Ignored:
    """Not read: `why` it cannot change the logits."""
    why: str


def off(value) -> bool:
    return value in (None, False)


def full_attention_only(value) -> bool:
    return value is None or isinstance(value, list) and all(t == "full_attention" for t in value)


METADATA = Ignored("metadata: names and versions, no number of the model")
GENERIC = Ignored("transformers' generic PretrainedConfig field (outputs, training, generation defaults): "
                  "no effect on a forward pass")
COMMON = {
    "model_type": Read("the architecture (arch/)"),
    "vocab_size": Read("embedding and lm_head rows"),
    "hidden_size": Read("model width"),
    "intermediate_size": Read("MLP width"),
    "num_hidden_layers": Read("decoder layers"),
    "num_attention_heads": Read("query heads"),
    "num_key_value_heads": Read("key/value heads (GQA)"),
    "attention_bias": Read("q/k/v and o_proj with bias (Llama, Qwen3; Qwen2's table overrides it)"),
    "head_dim": Read("per-head width (default hidden_size / heads, as transformers)"),
    "max_position_embeddings": Read("context length"),
    "rms_norm_eps": Read("RMSNorm epsilon"),
    "rope_theta": Read("rotary base"),
    "rope_parameters": Read("rotary base and scaling (transformers 5), checked by arch/rope.py"),
    "rope_scaling": Read("rotary scaling (transformers 4), checked by arch/rope.py"),
    "original_max_position_embeddings": Read("a rope scaling's pretraining context"),
    "tie_word_embeddings": Read("lm_head shares the embedding table"),
    "bos_token_id": Read("generation's start token"),
    "eos_token_id": Read("generation's stop tokens"),
    "torch_dtype": Read("the stored float type"),
    "dtype": Read("the stored float type (transformers 5's name)"),
    "quantization_config": Read("qlite's quantization (qconfig.py); another tool's is named and refused"),
    "hidden_act": Only(lambda v: v in ("silu", "swish"), "silu (the SwiGLU MLP)"),
    "use_sliding_window": Only(off, "false (full attention in every layer)"),
    "layer_types": Only(full_attention_only, "full_attention in every layer"),
    "mlp_bias": Only(off, "false (no MLP bias)"),
    "sliding_window": Ignored("a window size, read by transformers only with use_sliding_window (refused)"),
    "max_window_layers": Ignored("which layers slide, read by transformers only with use_sliding_window (refused)"),
    "pad_token_id": Ignored("no model number uses it (transformers' embedding padding_idx only affects training)"),
    "use_cache": Ignored("whether transformers returns a cache; qlite always caches, the logits are the same"),
    "initializer_range": Ignored("random initialisation only; every weight is loaded"),
    "attention_dropout": Ignored("dropout: training only, off at inference"),
    "_attn_implementation": Ignored("transformers' attention backend: the same math"),
    "_attn_implementation_autoset": Ignored("transformers' attention backend: the same math"),
    "auto_map": Ignored("remote code for transformers; qlite runs its own implementation of model_type"),
    "tokenizer_class": Ignored("the tokenizer is read from its own files"),
    "qlite_export": Ignored("qlite's notes on an export"),
    **{name: METADATA for name in ("architectures", "transformers_version", "_name_or_path", "name_or_path")},
    **{name: GENERIC for name in (
        "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
        "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
        "cross_attention_hidden_size", "tie_encoder_decoder", "id2label", "label2id", "problem_type",
        "finetuning_task", "prefix", "pruned_heads", "task_specific_params", "keys_to_ignore_at_inference",
        "use_bfloat16", "tf_legacy_loss", "output_scores", "return_dict_in_generate", "max_length",
        "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
        "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "sep_token_id",
        "decoder_start_token_id")},
}


def check_fields(d: dict, table: dict, model_type: str, source: str) -> None:
    """Refuse, by name, a field the table does not know and a value an Only rule does not allow."""
    for name, value in d.items():
        rule = table.get(name)
        if rule is None:
            raise QliteError(f"{source}: field {name[:80]!r}: qlite does not know what it does to a {model_type} "
                             f"model, so it does not run it (remove the field if it changes nothing)")
        if isinstance(rule, Only) and not rule.ok(value):
            raise QliteError(f"{source}: {name} {value!r}"[:200] + f": qlite does not implement it (it runs {rule.runs} "
                             f"only)")
