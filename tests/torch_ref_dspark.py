"""A torch reference of the DSpark draft's block pass, written from docs/architecture.md §3.3/§3.4 alone (it does not
import dspark_jax), used to check our JAX draft after conversion.

Module names are the checkpoint's tensor names (docs/architecture.md §3.2), so `load_state_dict` on the tensors of
a draft's model.safetensors (minus `embed_tokens.weight`) is strict. Attention is computed in the
expanded form (per-head k_nope/v from kv_b_proj), the most literal reading of docs/architecture.md §3.3.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms(x, self.weight, self.eps)


def yarn_mscale(s: float, m: float) -> float:
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def yarn_tables(cfg: dict) -> tuple[torch.Tensor, float, float, int, int]:
    """(inv_freq [R/2], cos/sin multiplier, softmax scale, low, high) from docs/architecture.md §3.4."""
    rp = cfg["rope_parameters"]
    r = cfg["qk_rope_head_dim"]
    base, s = rp["rope_theta"], rp["factor"]
    orig, bf, bs = rp["original_max_position_embeddings"], rp["beta_fast"], rp["beta_slow"]
    pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    extrap, interp = 1.0 / pos_freqs, 1.0 / (s * pos_freqs)

    def corr_dim(rot):
        return r * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(bf)), 0)
    high = min(math.ceil(corr_dim(bs)), r - 1)
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp
    inv_freq = interp * (1 - mask) + extrap * mask
    mult = yarn_mscale(s, rp["mscale"]) / yarn_mscale(s, rp["mscale_all_dim"])
    qk = cfg["qk_nope_head_dim"] + r
    scale = qk ** -0.5 * yarn_mscale(s, rp["mscale_all_dim"]) ** 2
    return inv_freq, mult, scale, low, high


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mult: float) -> torch.Tensor:
    """x [..., T, (heads,) R] rotated at pos [T] with GPT-J pairs (x[2i], x[2i+1])."""
    ang = pos.float()[:, None] * inv_freq[None]              # [T, R/2]
    cos, sin = torch.cos(ang) * mult, torch.sin(ang) * mult
    if x.dim() == 3:                                          # [T, heads, R]
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, n = cfg["hidden_size"], cfg["num_attention_heads"]
        self.n, self.c = n, cfg["kv_lora_rank"]
        self.dn, self.dr, self.dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        eps = cfg["rms_norm_eps"]
        self.q_a_proj = nn.Linear(h, cfg["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(cfg["q_lora_rank"], n * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.c + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.c, eps)
        self.kv_b_proj = nn.Linear(self.c, n * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(n * self.dv, h, bias=False)
        self.inv_freq, self.mult, self.scale, _, _ = yarn_tables(cfg)

    def latent(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[rms(c_kv) | RoPE(k_pe)] per row, [S, C+R]."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :self.c])
        k_pe = rope_interleaved(kv[:, self.c:], pos, self.inv_freq, self.mult)
        return torch.cat([c_kv, k_pe], -1)

    def forward(self, a: torch.Tensor, pos: torch.Tensor, ctx_latent: torch.Tensor) -> torch.Tensor:
        t = a.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(a))).view(t, self.n, self.dn + self.dr)
        q_nope, q_rope = q[..., :self.dn], rope_interleaved(q[..., self.dn:], pos, self.inv_freq, self.mult)
        lat = torch.cat([ctx_latent, self.latent(a, pos)], 0)            # context rows, then the block
        s = lat.shape[0]
        kvb = self.kv_b_proj(lat[:, :self.c]).view(s, self.n, self.dn + self.dv)
        k_nope, v = kvb[..., :self.dn], kvb[..., self.dn:]
        k_pe = lat[:, self.c:]
        scores = (torch.einsum("tnh,snh->nts", q_nope, k_nope)
                  + torch.einsum("tnr,sr->nts", q_rope, k_pe)) * self.scale
        p = torch.softmax(scores.float(), -1).to(v.dtype)               # every row sees everything
        o = torch.einsum("nts,snv->tnv", p, v).reshape(t, self.n * self.dv)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])


class MarkovHead(nn.Module):
    def __init__(self, v: int, r: int):
        super().__init__()
        self.markov_w1 = nn.Linear(r, v, bias=False)      # weight [V, r]
        self.markov_w2 = nn.Linear(r, v, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, f: int):
        super().__init__()
        self.proj = nn.Linear(f, 1, bias=True)


class DSparkDraftRef(nn.Module):
    """The draft of docs/architecture.md §3 (embeddings and lm_head come from the target)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.cfg = cfg
        self.context_proj = nn.Linear(len(cfg["target_layer_ids"]) * cfg["target_hidden_size"], h, bias=False)
        self.context_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.final_norm = RMSNorm(h, eps)
        self.markov_head = MarkovHead(cfg["vocab_size"], cfg["markov_rank"])
        self.confidence_head = ConfidenceHead(h + cfg["markov_rank"])

    @torch.no_grad()
    def block_forward(self, aux: torch.Tensor, anchor: int, embed: torch.Tensor, lm_head: torch.Tensor,
                      num_speculative_tokens: int = 7):
        """aux [N, n_aux*H_t] at positions 0..N-1; block [anchor, M x (T-1)] at N..N+T-1.
        Returns (base_logits [T,V], drafts [T], confidence [T])."""
        cfg, t, n = self.cfg, num_speculative_tokens, aux.shape[0]
        eps = cfg["rms_norm_eps"]
        ctx = rms(self.context_proj(aux), self.context_norm.weight, eps)
        ctx_pos = torch.arange(n)
        ids = torch.tensor([anchor] + [cfg["mask_token_id"]] * (t - 1))
        pos = n + torch.arange(t)
        h = embed[ids]
        for layer in self.layers:
            ctx_latent = layer.self_attn.latent(ctx, ctx_pos)               # no input_layernorm
            h = h + layer.self_attn(layer.input_layernorm(h), pos, ctx_latent)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.final_norm(h)
        base = (h @ lm_head.T).float()
        w1 = self.markov_head.markov_w1.weight
        w2 = self.markov_head.markov_w2.weight
        prev, drafts, prevs = anchor, [], []
        for k in range(t):
            prevs.append(prev)
            d = int(torch.argmax(base[k] + w1[prev].float() @ w2.float().T))
            drafts.append(d)
            prev = d
        feats = torch.cat([h, w1[torch.tensor(prevs)]], -1)
        conf = torch.sigmoid(self.confidence_head.proj(feats).float())[:, 0]
        return base, torch.tensor(drafts), conf
