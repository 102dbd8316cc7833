"""A Llama-shaped decoder with a static KV cache, in plain PyTorch, and how to quantize it.

Random weights, nothing downloaded. The full size is Llama 3.2 1B's layer shapes with a
32000-token vocabulary: d_model 2048, 16 layers, grouped-query attention (32 query heads,
8 KV heads, head dim 64), rotary embeddings, RMSNorm, a SwiGLU MLP of hidden 8192, untied
embedding and output head: 1,104,218,112 parameters (``Config().parameters()``).

    python examples/llama_decoder.py --tiny                  # CPU, a second or two
    python examples/llama_decoder.py --device cuda --quant int8_weight_only --compile

One ``forward(tokens, input_pos)`` serves prefill and decode: ``tokens`` [batch, seq] sit
at the positions ``input_pos`` [seq] (a tensor). The KV cache is preallocated
([batch, kv_heads, max_len, head_dim] per layer, ``setup_cache``) and written in place with
``index_copy_`` at ``input_pos``; attention reads the whole cache under a mask
(``position <= input_pos``). So every decode step has the same shapes and the same Python
path whatever the position: ``torch.compile`` compiles it once, and
``mode="reduce-overhead"`` replays one CUDA graph per step.

Quantization with fxopt (``quantize``): ``fxopt.quant.quantize_model`` captures a module with
``torch.fx.symbolic_trace`` and returns a GraphModule. It takes this whole decoder (the
trace records the cache writes), but the result has only ``forward`` and keeps the cache
buffers it saw: no ``setup_cache`` for another batch size, no ``generate``. So each
layer's linear parts are quantized on their own and swapped in (the attention's fused
``wqkv`` and ``wo``, the whole SwiGLU MLP, and the output head, as fxopt's defaults
quantize every linear layer); the model keeps its methods and its cache, and computes what
the whole-model capture computes. For int8 the MLP also gets fxopt's
``merge_sibling_linears`` + ``fuse_swiglu`` (gate and up as one quantized matmul with
SiLU-and-multiply in its kernel).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    vocab_size: int = 32000
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    hidden: int = 8192
    max_seq_len: int = 4096  # length of the rotary tables: the longest cache setup_cache accepts
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def parameters(self) -> int:
        """Parameter count of a ``Decoder(self)``, from the shapes alone."""
        qkv = self.d_model * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        layer = qkv + self.n_heads * self.head_dim * self.d_model + 3 * self.d_model * self.hidden + 2 * self.d_model
        return self.n_layers * layer + 2 * self.vocab_size * self.d_model + self.d_model


#: a model of the same structure that runs on a CPU in milliseconds (tests, --tiny)
TINY = Config(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, max_seq_len=256)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean of squares in float32, as Llama does, whatever the model's dtype
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, [max_seq_len, head_dim] (each angle
    twice: the two halves of a head are rotated as pairs (i, i + head_dim/2))."""
    inv_freq = config.rope_base ** -(torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    angles = torch.outer(torch.arange(config.max_seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, heads, seq, head_dim] by the angles of its positions ([seq, head_dim])."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache(nn.Module):
    """Keys and values of every position so far, preallocated: [batch, kv_heads, max_len, head_dim]."""

    def __init__(self, batch: int, max_len: int, config: Config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [batch, kv_heads, seq, head_dim] at ``input_pos``; the whole cache back."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        heads = config.n_heads + 2 * config.n_kv_heads
        self.wqkv = nn.Linear(config.d_model, heads * config.head_dim, bias=False)  # q, k, v in one matmul
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                      c.n_kv_heads * c.head_dim], dim=-1)
        q = q.view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self.cache.update(input_pos, k, v)
        # Grouped-query attention without copying the cache: query head h reads KV head
        # h // rep, so the rep query heads of one KV head become rep * seq query rows of it
        # (row r * seq + i is head r's position i, whose mask row is i).
        rep = c.n_heads // c.n_kv_heads
        q = q.reshape(b, c.n_kv_heads, rep * s, c.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(rep, 1))
        return self.wo(out.view(b, c.n_heads, s, c.head_dim).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.hidden, bias=False)  # up
        self.w2 = nn.Linear(config.hidden, config.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, config: Config = Config()) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int = 0) -> Decoder:
        """Random weights of a trained model's scale (normal, std 0.02; norms at 1), from
        ``seed``, drawn on the weights' device (1.1B draws on a CPU take seconds)."""
        generator = torch.Generator(self.output.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("norm.weight"):  # RMSNorm weights stay at 1
                    p.normal_(0.0, 0.02, generator=generator)
        return self

    def setup_cache(self, batch: int, max_len: int) -> None:
        """A zeroed KV cache for ``batch`` sequences of up to ``max_len`` tokens, in the model's
        dtype and device; a new one replaces the old (a compiled model then recompiles once)."""
        if max_len > self.config.max_seq_len:
            raise ValueError(f"max_len {max_len} > config.max_seq_len {self.config.max_seq_len}")
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.cache = KVCache(batch, max_len, self.config, weight.dtype, weight.device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] of ``tokens`` [batch, seq] at positions ``input_pos`` [seq],
        whose keys and values go into the cache (prefill: ``arange(seq)``; decode: one position)."""
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[input_pos].to(x.dtype), self.rope_sin[input_pos].to(x.dtype)
        max_len = self.layers[0].attention.cache.k.shape[2]
        mask = torch.arange(max_len, device=tokens.device) <= input_pos[:, None]  # [seq, max_len]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self(tokens, torch.arange(tokens.shape[1], device=tokens.device))

    def decode_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self(token, pos)

    def generate(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        return generate(self, prompt, steps)


def generate(model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], prompt: torch.Tensor, steps: int,
             decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Greedy: the ``steps`` tokens [batch, steps] that follow ``prompt`` [batch, seq].

    ``model`` prefills the prompt; ``decode`` (default: ``model``) takes each step, e.g. a
    compiled model (prefill shapes vary with the prompt, decode shapes never do). Both are
    called as ``forward(tokens, input_pos)`` on a model whose cache holds ``seq + steps``.
    """
    decode = model if decode is None else decode  # not `or`: a compiled module has no truth value
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    token = model(prompt, pos)[:, -1].argmax(-1, keepdim=True)
    out = [token]
    pos = pos[-1:] + 1
    for _ in range(steps - 1):
        token = decode(token, pos)[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        pos = pos + 1
    return torch.cat(out, dim=1)


def quantize(model: Decoder, mode: str = "int8_weight_only") -> Decoder:
    """``model`` with its linear parts quantized by fxopt, in place (see the module docstring).

    ``mode``: a weight-only mode of ``fxopt.quant`` (``int8_weight_only``, ``int4_weight_only``).
    Each part is captured on an example input on the model's device and dtype.
    """
    import fxopt
    import fxopt.quant as fq

    weight = model.tok_embeddings.weight
    c = model.config

    def quantized(module: nn.Module, features: int, fuse: bool = False) -> nn.Module:
        x = torch.randn(1, 1, features, dtype=weight.dtype, device=weight.device)
        q = fq.quantize_model(module, (x,), mode)
        return fxopt.optimize(q, ["merge_sibling_linears", "fuse_swiglu"], example_inputs=(x,)) if fuse else q

    for layer in model.layers:
        layer.attention.wqkv = quantized(layer.attention.wqkv, c.d_model)
        layer.attention.wo = quantized(layer.attention.wo, c.n_heads * c.head_dim)
        layer.feed_forward = quantized(layer.feed_forward, c.d_model, fuse=mode == "int8_weight_only")
    model.output = quantized(model.output, c.d_model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny configuration (CPU, tests)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--quant", choices=["int8_weight_only", "int4_weight_only"], help="quantize with fxopt")
    parser.add_argument("--compile", action="store_true", help='decode with torch.compile(mode="reduce-overhead")')
    args = parser.parse_args()
    config = TINY if args.tiny else Config()
    if args.tiny:
        torch.set_num_threads(1)  # matrices of 64: more threads cost more than they save
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    print(f"{config.parameters():,} parameters")
    with torch.device(args.device):
        model = Decoder(config).to(dtype).init_weights().eval()
    model.setup_cache(args.batch, args.prompt_len + args.steps)
    if args.quant:
        quantize(model, args.quant)
    decode = torch.compile(model, mode="reduce-overhead") if args.compile else None
    prompt = torch.randint(config.vocab_size, (args.batch, args.prompt_len), device=args.device)
    with torch.no_grad():
        generate(model, prompt, 4, decode)  # warm-up: compiles; reduce-overhead records its CUDA graph
        start = time.perf_counter()
        tokens = generate(model, prompt, args.steps, decode)
        seconds = time.perf_counter() - start
    print(f"{args.batch * args.steps / seconds:.1f} tokens/s (prefill included); first tokens {tokens[0, :8].tolist()}")


if __name__ == "__main__":
    main()
