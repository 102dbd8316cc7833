"""examples/llama_decoder.py: the static-cache decoder computes what a decoder without a cache
computes, compiles once for every decode position, and quantizes the same way whole or in parts.

The reference here is written independently of the example: the whole sequence at once,
causal attention by ``is_causal``, every KV head repeated for its query heads (the example
instead folds the query heads of one KV head into rows, and reads a masked cache).
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama_decoder.py"


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("llama_decoder", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_decoder"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["llama_decoder"]


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of every position of ``tokens`` [batch, seq], no cache, from ``model``'s weights."""
    c = model.config
    b, s = tokens.shape
    inv_freq = 1.0 / c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()

    def rope(x):  # pairs (i, i + head_dim/2) rotated by angle i
        x1, x2 = x[..., : c.head_dim // 2], x[..., c.head_dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * weight

    x = model.tok_embeddings.weight[tokens]
    for layer in model.layers:
        att = layer.attention
        h = norm(x, layer.attention_norm.weight)
        w = att.wqkv.weight
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = (h @ w[:q_dim].t()).view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = (h @ w[q_dim:q_dim + kv_dim].t()).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = (h @ w[q_dim + kv_dim:].t()).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + out.transpose(1, 2).reshape(b, s, -1) @ att.wo.weight.t()
        h = norm(x, layer.ffn_norm.weight)
        ff = layer.feed_forward
        x = x + (F.silu(h @ ff.w1.weight.t()) * (h @ ff.w3.weight.t())) @ ff.w2.weight.t()
    return norm(x, model.norm.weight) @ model.output.weight.t()


def tiny(ex, batch: int, max_len: int):
    model = ex.Decoder(ex.TINY).init_weights(seed=3).eval()
    model.setup_cache(batch, max_len)
    return model


@pytest.mark.parametrize("batch", [1, 3])
def test_cached_decode_matches_a_full_forward_without_cache(ex, batch):
    """Prefill then one token at a time: every step's logits are the full forward's at that
    position, and the greedy tokens are the reference's greedy tokens."""
    prompt_len, steps = 5, 12
    model = tiny(ex, batch, prompt_len + steps)
    prompt = torch.randint(ex.TINY.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        tokens = ex.generate(model, prompt, steps)
        sequence = torch.cat([prompt, tokens], dim=1)
        full = reference_logits(model, sequence)
        assert torch.equal(tokens, full[:, prompt_len - 1:-1].argmax(-1))
        model.setup_cache(batch, prompt_len + steps)
        cached = [model.prefill(prompt)]
        for i in range(steps - 1):
            pos = torch.tensor([prompt_len + i])
            cached.append(model.decode_step(tokens[:, i:i + 1], pos))
    torch.testing.assert_close(torch.cat(cached, dim=1), full[:, :-1], rtol=1e-4, atol=1e-4)


def test_a_reused_cache_gives_what_a_fresh_one_gives(ex):
    """Positions beyond the current one hold an earlier sequence's keys: the mask hides them."""
    model = tiny(ex, 2, 24)
    first, second = (torch.randint(ex.TINY.vocab_size, (2, 6), generator=torch.Generator().manual_seed(s))
                     for s in (0, 1))
    with torch.no_grad():
        ex.generate(model, first, 16)
        reused = ex.generate(model, second, 10)
        model.setup_cache(2, 24)
        fresh = ex.generate(model, second, 10)
    assert torch.equal(reused, fresh)


def test_decode_compiles_once_for_every_position(ex):
    """The position is a tensor: one Dynamo graph, no graph break, serves every decode step."""
    from torch._dynamo.testing import CompileCounter

    model = tiny(ex, 2, 20)
    counter = CompileCounter()
    decode = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    prompt = torch.randint(ex.TINY.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = ex.generate(model, prompt, 12, decode)
            model.setup_cache(2, 20)
            eager = ex.generate(model, prompt, 12)
    finally:
        torch._dynamo.reset()
    assert (counter.frame_count, counter.op_count > 0) == (1, True)
    assert torch.equal(compiled, eager)


def test_parameter_count_is_the_modules(ex):
    with torch.device("meta"):
        full = ex.Decoder(ex.Config())
    assert sum(p.numel() for p in full.parameters()) == ex.Config().parameters()
    assert sum(p.numel() for p in ex.Decoder(ex.TINY).parameters()) == ex.TINY.parameters()


@pytest.mark.parametrize("mode", ["int8_weight_only", "int4_weight_only"])
def test_quantizing_in_parts_is_quantizing_the_whole_decoder(ex, mode):
    """``quantize`` (each linear part captured alone) quantizes every linear layer that
    ``quantize_model`` finds when it captures the whole decoder, cache writes included,
    and both compute the same logits."""
    import torch.fx as fx

    import fxopt.quant as fq

    model = tiny(ex, 1, 16)
    tokens, pos = torch.randint(ex.TINY.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)), torch.arange(6)
    whole = fq.quantize_model(model, (tokens, pos), mode)
    summary = fq.summary_of(whole)
    parts = ex.quantize(copy.deepcopy(model), mode)
    part_sites = sum(len(fq.summary_of(m).sites) for m in parts.modules() if isinstance(m, fx.GraphModule))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert (summary.coverage, len(summary.sites), part_sites) == (1.0, linears, linears)
    assert not any(isinstance(m, torch.nn.Linear) for m in parts.modules())
    with torch.no_grad():
        expected = whole(tokens, pos)
        parts.setup_cache(1, 16)
        got = parts(tokens, pos)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
