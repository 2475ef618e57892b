"""The whole model: embedding -> N x DecoderLayer -> norm -> lm_head (`CausalLM`), for every model type of
arch/ (Qwen2, Qwen3, Llama, their mixtures of experts), and its forward over a KV cache."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..qembedding import QuantEmbedding
from .kv_cache import KVCache
from .layers import DecoderLayer, RMSNorm, Rotary
from .linear import make_linear
from .ops import Step, TorchOps, apply_rope, attention_mask, key_starts

class Decoder(nn.Module):
    fused_layers = None  # a backend's one-call decode step over every layer (fused.FusedLayers), or None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        fmt = cfg.quantization.embeddings if cfg.quantization else None
        if fmt is not None:
            fmt.check(cfg.hidden_size, "model.embed_tokens")
        # the table is the loader's to fill: no random init (on the meta device nn.Embedding's
        # normal_ would import torch._dynamo, 2 s of a 16-bit model's load)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
                             if fmt is None else QuantEmbedding(cfg.vocab_size, cfg.hidden_size, fmt))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class CausalLM(nn.Module):
    ops = TorchOps  # for what decoding does with the logits (argmax_rows)
    # tokens per forward when a prompt goes into a cache: its activations (the MLP's T x 2 intermediate
    # above all) are bounded by this, not by the prompt's length; as llama.cpp's default micro-batch
    prefill_chunk = 512
    kv_bits = 16  # the KV cache's: 16 (the model's dtype), 8 or 4 (kv_quant's records); --kv-cache sets it
    KEY_OFFSET_SPAN = 4096  # positions the key offsets average over

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = make_linear(cfg, "", cfg.hidden_size, {"lm_head": cfg.vocab_size}, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """A tied head uses the embedding table when both have one format (qconfig.shares_table)."""
        q, embed = self.config.quantization, self.model.embed_tokens
        if not self.config.tie_word_embeddings or q is not None and not q.shares_table(True):
            return
        if isinstance(embed, QuantEmbedding):
            for name, t in embed.stored().items():
                setattr(self.lm_head, name, t)
        else:
            self.lm_head.weight = embed.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, batch: int, capacity: int, limit: int | None = None) -> KVCache:
        offsets = None if self.kv_bits == 16 else self.key_offsets()
        return KVCache(self.config, batch, capacity, self.dtype, self.device, limit, self.kv_bits, offsets)

    def key_offsets(self) -> torch.Tensor | None:
        """Per layer and kv head, the rotated k bias averaged over positions 0..KEY_OFFSET_SPAN-1,
        float32 (layers, n_kv, head_dim); None for a model without k bias. A quantized cache stores the
        keys less it: Qwen2's k biases give every key a large, nearly constant part (key norms of
        100-280 in the demo model's first layers) that per-token scales would spend their range on, and
        softmax does not see a constant added to all of a head's keys. Computed once."""
        if getattr(self, "_key_offsets", False) is False:
            biases = [layer.self_attn.key_bias() for layer in self.model.layers]
            self._key_offsets = None if any(b is None for b in biases) else self._rotated_mean(biases)
        return self._key_offsets

    @torch.no_grad()
    def _rotated_mean(self, biases: list[torch.Tensor]) -> torch.Tensor:
        attn = self.model.layers[0].self_attn
        positions = torch.arange(self.KEY_OFFSET_SPAN, device=self.device)[None]  # (1, span)
        cos, sin = self.model.rotary(positions)  # (1, 1, span, head_dim)
        b = torch.stack(biases).float().view(len(biases), attn.n_kv, 1, attn.head_dim)  # (layers, n_kv, 1, hd)
        return apply_rope(b, cos[0], sin[0]).mean(dim=2).contiguous()  # (layers, n_kv, head_dim)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, last_only: bool = False, exact: bool = False,
                head: bool = True) -> torch.Tensor | None:
        """Logits (B, T or 1, vocab) for input_ids (B, T), appended to `cache` if given (then in
        forwards of at most prefill_chunk tokens). key_mask (B, cache.length + T), True for real tokens,
        is needed only for padded batches; positions (B, T) default to cache.length + 0..T-1. head=False:
        the cache filled, no logits (None): a prompt's chunks before its last.
        Where the products are row-exact and attention reads the cache back as a step does (backends.exact_prefill:
        the native bf16 run), every logit is bitwise what one-token steps give, however the tokens are cut.
        exact (unpadded rows, a cache, T <= native.MAX_ROWS): the rotary angles token by token too, as steps
        compute them (they differ for dynamic NTK), and the fused decode layers may take the T tokens
        (speculative decoding's verify pass, speculate.py)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.reserve(start + T)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if exact:
            if cache is None or key_mask is not None or T > self.prefill_chunk:
                raise ValueError("exact: unpadded rows appended to a cache, in one chunk")
            angles = [self.model.rotary(positions[:, t:t + 1]) for t in range(T)]  # each as its step has it
            cos, sin = torch.cat([c for c, _ in angles], 2), torch.cat([s for _, s in angles], 2)
        else:
            cos, sin = self.model.rotary(positions)  # (B, 1, T, head_dim): all at once, as one forward has them
        chunk, kept = T if cache is None else self.prefill_chunk, []
        for a in range(0, T, chunk):
            x = self.hidden_states(input_ids[:, a:a + chunk], cos[:, :, a:a + chunk], sin[:, :, a:a + chunk], cache,
                                   None if key_mask is None else key_mask[:, :start + a + chunk], exact)  # (B, chunk, hidden)
            kept += [] if last_only or not head else [x]
        if not head:
            return None
        x = x[:, -1:] if last_only else torch.cat(kept, dim=1)  # (B, T or 1, hidden)
        return self.lm_head(self.model.norm(x))

    def hidden_states(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                      key_mask: torch.Tensor | None, one_at_a_time: bool = False) -> torch.Tensor:
        """The decoder layers' output (B, T, hidden) for input_ids (B, T) after the cache's tokens."""
        T, start = input_ids.shape[1], cache.length if cache is not None else 0
        step = Step(cos, sin, cache, attention_mask(T, start, key_mask, input_ids.device), start,
                    key_starts(key_mask[:, :start + T]) if key_mask is not None else None, one_at_a_time,
                    padded=key_mask is not None)
        x = self.model.embed_tokens(input_ids).to(self.dtype)  # (B, T, hidden)
        fused = self.model.fused_layers
        if fused is not None and fused.takes(x, step):
            x = fused(x, step)
        else:
            for layer in self.model.layers:
                x = layer(x, step)
        if cache is not None:
            cache.length += T
        return x
