"""fusible.TransformerLayer and fusible.MultiheadAttention (issue 16): an FP64 plain-torch
reference with the same weights for each option (norms, activations, bias, GQA, RoPE, masks,
layouts), causality, every recipe close to high precision, quantizer roles, fused residual adds,
meta-device construction, state_dict round trips, torch.compile, errors. Tiny sizes: MXFP8
needs multiples of 32 (hidden, 3 * hidden, ffn, batch * seq)."""

from __future__ import annotations

import collections
import copy
import io
import math
import re

import pytest
import torch
import torch.nn.functional as F
from modules_helpers import RECIPES, rel_err

import fusible

B, S, H, FFN, HEADS = 2, 16, 32, 64, 4
FP32_TOL = 2e-5  # fp32 against the FP64 reference: a few roundings per value


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = fusible.TransformerLayer(kw.pop("hidden", H), kw.pop("ffn", FFN),
                                     kw.pop("heads", HEADS), **kw)  # fmt: skip
    _randomize(layer)
    return layer


def _randomize(module):
    """Non-trivial norm weights and biases (the defaults are ones / zeros)."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + base)


# ---- the FP64 reference ------------------------------------------------------------------------


def _reference(layer, x, params, *, mask=None, freqs=None, attention=None):
    """The layer in plain torch, FP64, from its TE-named parameters ``params`` (leaf tensors):
    written from the definitions, sharing no code with the module."""
    attn = layer.self_attention if attention is None else attention
    heads, groups, d = attn.num_attention_heads, attn.num_gqa_groups, attn.kv_channels
    sbhd = attn.qkv_format == "sbhd"
    if sbhd:
        x = x.transpose(0, 1)
    b, s, _ = x.shape

    def norm(t, prefix, module):
        op = module[0]
        w = params[prefix + "layer_norm_weight"]
        if op.zero_centered_gamma:
            w = w + 1.0
        if isinstance(op, fusible.ops.LayerNorm):
            mu = t.mean(-1, keepdim=True)
            var = (t - mu).pow(2).mean(-1, keepdim=True)
            return (t - mu) / torch.sqrt(var + op.eps) * w + params[prefix + "layer_norm_bias"]
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + op.eps) * w

    def linear(t, prefix, wname="weight", bname="bias"):
        y = t @ params[prefix + wname].T
        return y + params[prefix + bname] if prefix + bname in params else y

    pre = "" if attention is not None else "self_attention."
    if attn.input_layernorm:
        qkv = linear(norm(x, pre + "layernorm_qkv.", attn.layernorm_qkv), pre + "layernorm_qkv.")
    else:
        qkv = linear(x, pre + "qkv.")
    q = qkv[..., : heads * d].reshape(b, s, heads, d)
    k = qkv[..., heads * d : (heads + groups) * d].reshape(b, s, groups, d)
    v = qkv[..., (heads + groups) * d :].reshape(b, s, groups, d)
    if freqs is None and attn.rotary_pos_emb is not None:
        freqs = _rope_angles(s, d)
    if freqs is not None:
        q, k = _rope(q, freqs), _rope(k, freqs)
    rep = heads // groups
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, dim=2)) / math.sqrt(d)
    if attn.attn_mask_type == "causal":
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    elif mask is not None:
        scores = scores.masked_fill(mask, -math.inf)
    a = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(rep, dim=2))
    y = linear(a.reshape(b, s, heads * d), pre + "proj.")
    if attention is not None:  # a bare MultiheadAttention (no residual connection)
        return y.transpose(0, 1) if sbhd else y
    x = x + y
    mlp = layer.layernorm_mlp
    u = linear(norm(x, "layernorm_mlp.", mlp), "layernorm_mlp.", "fc1_weight", "fc1_bias")
    act = mlp.activation
    if act in ("swiglu", "geglu"):
        g, lin = u.chunk(2, dim=-1)
        u = (F.silu(g) if act == "swiglu" else F.gelu(g, approximate="tanh")) * lin
    else:
        u = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu,
             "silu": F.silu}[act](u)  # fmt: skip
    x = x + linear(u, "layernorm_mlp.", "fc2_weight", "fc2_bias")
    return x.transpose(0, 1) if sbhd else x


def _rope_angles(s, d, base=10000.0):
    """[s, d / 2] angles pos * base^(-2i/d), FP64."""
    i = torch.arange(d // 2, dtype=torch.float64)
    return torch.arange(s, dtype=torch.float64)[:, None] * base ** (-2 * i / d)[None, :]


def _rope(t, angles):
    """Rotate the pairs (i, i + r/2) of the first r = 2 * angles.shape[-1] features of each head
    of ``t`` [b, s, heads, d] by the angles [s, r/2]."""
    r = 2 * angles.shape[-1]
    c, s_ = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2, rest = t[..., : r // 2], t[..., r // 2 : r], t[..., r:]
    return torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_, rest), dim=-1)


def _te_params(module):
    """The module's parameters by their TE state_dict names (FP64 leaf copies, and the
    originals)."""
    named = {k: v for k, v in module.state_dict(keep_vars=True).items()
             if isinstance(v, torch.nn.Parameter)}  # fmt: skip
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in named.items()}
    return named, leaves


def _compare(module, x, dy, *, forward_kw=None, ref_kw=None, tol=FP32_TOL):
    forward_kw, ref_kw = forward_kw or {}, ref_kw or {}
    named, leaves = _te_params(module)
    xa = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(xa, **forward_kw)
    y.backward(dy)
    xr = x.detach().double().requires_grad_(True)
    yr = _reference(module, xr, leaves, **ref_kw)
    yr.backward(dy.double())
    assert y.shape == yr.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, yr) < tol, ("output", rel_err(y, yr))
    assert rel_err(xa.grad, xr.grad) < tol, ("input grad", rel_err(xa.grad, xr.grad))
    for k, p in named.items():
        assert rel_err(p.grad, leaves[k].grad) < tol, (k, rel_err(p.grad, leaves[k].grad))


def _data(shape=(B, S, H), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


CASES = {
    "default": {},
    "rmsnorm": {"normalization": "RMSNorm"},
    "swiglu": {"activation": "swiglu"},
    "geglu_rmsnorm_nobias": {"activation": "geglu", "normalization": "RMSNorm", "bias": False},
    "relu_nobias": {"activation": "relu", "bias": False},
    "zero_centered_gamma": {"zero_centered_gamma": True, "layernorm_epsilon": 1e-3},
    "gqa": {"num_gqa_groups": 2},
    "mqa": {"num_gqa_groups": 1},
    "rope": {"rotary": True},
    "rope_gqa_rmsnorm_swiglu": {
        "rotary": True,
        "num_gqa_groups": 2,
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "bias": False,
    },
    "no_mask": {"self_attn_mask_type": "no_mask"},
    "sbhd": {"attn_input_format": "sbhd", "rotary": True},
    "kv_channels": {"kv_channels": 16, "num_gqa_groups": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_fp64_reference(case):
    kw = CASES[case]
    layer = _layer(**kw)
    shape = (S, B, H) if kw.get("attn_input_format") == "sbhd" else (B, S, H)
    x, dy = _data(shape)
    _compare(layer, x, dy)


def test_explicit_rotary_pos_emb_and_partial_rotation():
    """forward(rotary_pos_emb=...) takes TE-format angles [s, 1, 1, d]; d below the head dim
    rotates the first d features of each head only. The layer's own (rotary=True) equals
    passing RotaryPositionEmbedding(head_dim)(seq)."""
    layer = _layer()
    x, dy = _data()
    d = H // HEADS
    angles = fusible.RotaryPositionEmbedding(d // 2)(S)
    assert angles.shape == (S, 1, 1, d // 2) and angles.dtype == torch.float32
    ref_angles = _rope_angles(S, d // 2)
    _compare(layer, x, dy, forward_kw={"rotary_pos_emb": angles}, ref_kw={"freqs": ref_angles})
    own = _layer(rotary=True)
    with torch.no_grad():
        explicit = layer(x, rotary_pos_emb=fusible.RotaryPositionEmbedding(d)(S))
        assert torch.equal(own(x), explicit)


def test_arbitrary_mask():
    """self_attn_mask_type="arbitrary": forward's attention_mask, True masks out (TE)."""
    layer = _layer(self_attn_mask_type="arbitrary")
    x, dy = _data()
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(B, 1, S, S, generator=g) < 0.3
    mask[..., 0] = False  # every query attends to something
    _compare(layer, x, dy, forward_kw={"attention_mask": mask}, ref_kw={"mask": mask})


def test_attention_mask_of_another_dtype_or_shape_raises():
    """A 0/1 padding mask as Hugging Face builds it (1 = attend, float or long) used to be read
    with ``.to(bool)``, the opposite of the bool convention (True masks out), inverting the mask
    without a word; a 2-D ``[batch, seq]`` mask failed inside SDPA with a broadcast error (or,
    with batch == seq, broadcast as ``[seq, seq]``). Both now raise naming ``attention_mask``
    and what is expected; bool masks of the documented shapes are unchanged."""
    layer = _layer(self_attn_mask_type="arbitrary")
    x, _ = _data()
    keep = torch.ones(B, S)
    keep[1, S // 2 :] = 0  # the second sequence is padded
    mask = (keep == 0)[:, None, None, :]
    with torch.no_grad():
        want = layer(x, attention_mask=mask)
        assert torch.equal(layer(x, attention_mask=mask.expand(B, 1, S, S)), want)
        for other in (keep[:, None, None, :], keep.long()[:, None, None, :]):
            with pytest.raises(TypeError, match=r"attention_mask must be a bool tensor.*mask == 0"):
                layer(x, attention_mask=other)
        for shape in [(B, S), (S, S), (B, 1, S // 2, S // 2), (B, HEADS + 1, S, S)]:
            with pytest.raises(ValueError, match=r"attention_mask must have 4 dimensions "
                               r"broadcastable to \[batch, heads, seq, seq\]"):  # fmt: skip
                layer(x, attention_mask=torch.zeros(shape, dtype=torch.bool))


@pytest.mark.parametrize("input_layernorm", [False, True])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_multihead_attention_alone(input_layernorm, fmt):
    """MultiheadAttention as TE's: returns the projection output (no residual) and takes a
    Linear (input_layernorm=False, TE's default) or LayerNormLinear QKV projection."""
    torch.manual_seed(0)
    mha = fusible.MultiheadAttention(H, HEADS, num_gqa_groups=2, input_layernorm=input_layernorm,
                                     qkv_format=fmt, rotary=True)  # fmt: skip
    _randomize(mha)
    x, dy = _data((S, B, H) if fmt == "sbhd" else (B, S, H))
    named, leaves = _te_params(mha)
    prefix = "layernorm_qkv." if input_layernorm else "qkv."
    assert prefix + "weight" in named and "proj.weight" in named
    xa = x.clone().requires_grad_(True)
    y = mha(xa)
    y.backward(dy)
    xr = x.double().requires_grad_(True)
    yr = _reference(None, xr, leaves, attention=mha)
    yr.backward(dy.double())
    assert rel_err(y, yr) < FP32_TOL and rel_err(xa.grad, xr.grad) < FP32_TOL
    for k, p in named.items():
        assert rel_err(p.grad, leaves[k].grad) < FP32_TOL, k


# ---- causality --------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["none", "mxfp8"])
def test_causal_later_tokens_do_not_change_earlier_outputs(recipe_name):
    """Under causal masking, output position t depends on positions <= t only. (In high
    precision, and under MXFP8, whose forward scales are per token; per-tensor recipes make
    every output depend on the whole tensor's amax, as any per-tensor scaling does.)"""
    rec = RECIPES[recipe_name]
    layer = _layer(rotary=True, num_gqa_groups=2)
    x, _ = _data()
    x2 = x.clone()
    t = S // 2
    x2[:, t:] = torch.randn(B, S - t, H)
    with torch.no_grad(), fusible.autocast(enabled=rec is not None, recipe=rec):
        y, y2 = layer(x), layer(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=1e-6, atol=1e-6)
    assert (y2[:, t:] - y[:, t:]).abs().min() > 0
    # Without the mask every position sees the changed tokens.
    bidir = _layer(self_attn_mask_type="no_mask")
    with torch.no_grad():
        assert (bidir(x2)[:, :t] - bidir(x)[:, :t]).abs().amax() > 1e-3


# ---- recipes ----------------------------------------------------------------------------------

FP8_CASES = {
    "default": {},
    "rmsnorm_swiglu_gqa_rope": {
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "num_gqa_groups": 2,
        "rotary": True,
        "bias": False,
    },
}


def _step(layer, x, dy, rec, steps=1):
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        xa = x.clone().requires_grad_(True)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = layer(xa)
        y.backward(dy)
    return [y.detach(), xa.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "custom"])
def test_recipes_close_to_high_precision(recipe_name, case):
    """Every recipe runs the layer (FP8 GEMMs, attention in high precision) and lands close to
    the unquantized layer: a loose bound (E4M3 / E5M2 rounding through four GEMMs)."""
    hp = _layer(hidden=64, ffn=128, heads=2, **FP8_CASES[case])
    q = copy.deepcopy(hp)
    x, dy = _data((B, S, 64))
    want = _step(hp, x, dy, None)
    # Delayed scaling: the second step uses scales from the first step's amax.
    got = _step(q, x, dy, RECIPES[recipe_name], steps=2 if recipe_name == "delayed" else 1)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < (0.08 if i == 0 else 0.25), (i, rel_err(a, b))
    assert rel_err(got[0], want[0]) > 0  # the GEMMs did run in FP8


def test_is_first_microbatch_caches_every_linear():
    layer = _layer(hidden=64, ffn=128, heads=2)
    x, _ = _data((B, S, 64))
    rec = RECIPES["current"]
    with torch.no_grad(), fusible.autocast(recipe=rec):
        plain = layer(x)
        first = layer(x, is_first_microbatch=True)
        again = layer(x, is_first_microbatch=False)
    assert torch.equal(first, plain) and torch.equal(again, plain)
    linears = [op for op in layer.modules() if isinstance(op, fusible.ops.BasicLinear)]
    assert len(linears) == 4
    assert all(op.workspace_cache.workspace is not None for op in linears)


def test_dropout_only_in_training():
    layer = _layer(hidden_dropout=0.3, attention_dropout=0.3)
    plain = _layer()
    x, _ = _data()
    layer.eval()
    with torch.no_grad():
        # (Not bit for bit: the residual add is a separate op here, fused into the GEMM there.)
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-6, atol=1e-6)
        layer.train()
        assert not torch.allclose(layer(x), plain(x))


# ---- roles, explain, fusion -------------------------------------------------------------------

FWD, BWD = ["input", "weight", "output"], ["grad_output", "grad_input"]
SCOPES = ["layernorm_linear:qkv", "linear:proj", "layernorm_mlp:fc1", "layernorm_mlp:fc2"]


def test_roles_name_qkv_proj_fc1_fc2():
    layer = _layer()
    for fwd, buckets in ((True, FWD), (False, BWD)):
        roles = layer.get_quantizer_roles(fwd)
        assert [r.qualified for r in roles] == [f"{b}:{s}" for s in SCOPES for b in buckets]
        assert layer.num_quantizers(fwd) == len(roles)
        mods = (layer.self_attention.layernorm_qkv, layer.self_attention.proj,
                layer.layernorm_mlp)  # fmt: skip
        assert roles == [r for m in mods for r in m.get_quantizer_roles(fwd)]
        assert layer.self_attention.get_quantizer_roles(fwd) == roles[: 2 * len(buckets)]


@pytest.mark.parametrize("recipe_name", ["delayed", "mxfp8"])
def test_explain_lists_the_roles_and_says_attention_is_high_precision(recipe_name):
    layer = _layer(hidden=64, ffn=128, heads=2, name="block0")
    with fusible.autocast(recipe=RECIPES[recipe_name]):
        text = layer.explain()
    found = re.findall(r"(?<![\w:])([a-z_]+:[a-z_]+:[a-z0-9_]+): ", text)
    want = [r.qualified for fwd in (True, False) for r in layer.get_quantizer_roles(fwd)]
    assert collections.Counter(found) == collections.Counter(want)
    assert "block0" in text and "high precision" in text
    assert "qkv:dpa" in text and "s:dpa" in text  # reserved for a future FP8 attention
    # Both residual adds fuse into the GEMM before them; norm + quantize for qkv and fc1.
    assert text.count("linear_bias_add[BasicLinear + Bias + AddExtraInput]") == 2


def test_residual_add_not_fused_across_dropout():
    layer = _layer(hidden_dropout=0.1)
    text = layer.explain(recipe=RECIPES["current"])
    assert "linear_bias_add" not in text and text.count("AddExtraInput") >= 4


def test_custom_recipe_routes_by_role_name():
    """A CustomRecipe reaches the same Linear of every layer by name: fc2 kept in high
    precision."""
    from fusible.quantization import Float8CurrentScalingQuantizer

    seen = []

    def factory(role):
        seen.append(role.qualified)
        if role.name == "fc2":
            return None
        return Float8CurrentScalingQuantizer(
            torch.float8_e5m2 if role.is_gradient else torch.float8_e4m3fn
        )

    layer = _layer()
    x, dy = _data()
    _step(layer, x, dy, fusible.recipe.CustomRecipe(qfactory=factory))
    assert sorted(set(seen)) == sorted(r.qualified for f in (True, False)
                                       for r in layer.get_quantizer_roles(f))  # fmt: skip
    text = layer.explain()
    assert re.search(r"weight:layernorm_mlp:fc2: high precision", text)


# ---- meta device, state_dict, compile ---------------------------------------------------------


def test_meta_construction_then_materialise():
    torch.manual_seed(3)
    ref = fusible.TransformerLayer(H, FFN, HEADS, rotary=True, num_gqa_groups=2)
    torch.manual_seed(3)
    m = fusible.TransformerLayer(H, FFN, HEADS, rotary=True, num_gqa_groups=2, device="meta")
    assert all(p.is_meta for p in m.parameters())
    with torch.no_grad():  # a forward on meta gives shapes
        assert m(torch.empty(B, S, H, device="meta")).shape == (B, S, H)
    m.to_empty(device="cpu")
    torch.manual_seed(3)
    m.reset_parameters()
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cpu" and torch.equal(p, q), n
    x, dy = _data()
    for a, b in zip(_step(m, x, dy, RECIPES["current"]), _step(ref, x, dy, RECIPES["current"]),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_state_dict_round_trip():
    """TE keys; recipe state (delayed scaling) included; a fresh layer loaded from a
    weights_only checkpoint takes the same next step bit for bit."""
    rec = RECIPES["delayed"]
    src = _layer(hidden=64, ffn=128, heads=2, num_gqa_groups=1, rotary=True)
    x, dy = _data((B, S, 64))
    _step(src, x, dy, rec, steps=2)
    sd = src.state_dict()
    assert list(sd) == [
        "self_attention.layernorm_qkv.layer_norm_weight",
        "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.weight",
        "self_attention.layernorm_qkv.bias",
        "self_attention.layernorm_qkv._extra_state",
        "self_attention.proj.weight",
        "self_attention.proj.bias",
        "self_attention.proj._extra_state",
        "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.layer_norm_bias",
        "layernorm_mlp.fc1_weight",
        "layernorm_mlp.fc1_bias",
        "layernorm_mlp.fc2_weight",
        "layernorm_mlp.fc2_bias",
        "layernorm_mlp.fc1._extra_state",
        "layernorm_mlp.fc2._extra_state",
    ]
    assert sd["layernorm_mlp.fc2._extra_state"]["forward.amax_history"].abs().sum() > 0
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    dst = _layer(seed=9, hidden=64, ffn=128, heads=2, num_gqa_groups=1, rotary=True)
    result = dst.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    x2, dy2 = _data((B, S, 64), seed=7)
    for a, b in zip(_step(dst, x2, dy2, rec), _step(src, x2, dy2, rec), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ["none", "current"])
def test_compiled_matches_eager(recipe_name):
    """torch.compile(fullgraph=True) traces the whole layer (three fusible modules, SDPA, RoPE,
    GQA) into one graph that the next step reuses, and matches eager bit for bit (aot_eager
    runs the very same kernels)."""
    torch._dynamo.reset()
    rec = RECIPES[recipe_name]
    layer = _layer(hidden=64, ffn=128, heads=2, num_gqa_groups=1, rotary=True)
    twin = copy.deepcopy(layer)

    def fwd(m, x):
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            return m(x)

    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(fwd, backend=backend, fullgraph=True)
    x, dy = _data((B, S, 64))
    for _ in range(2):
        outs = []
        for f, m in ((compiled, layer), (fwd, twin)):
            m.zero_grad(set_to_none=True)
            xa = x.clone().requires_grad_(True)
            y = f(m, xa)
            y.backward(dy)
            outs.append([y.detach(), xa.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
    assert len(graphs) == 1  # one graph, and the second step does not recompile
    torch._dynamo.reset()


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"normalization": "BatchNorm"}, "normalization"),
        ({"activation": "tanh"}, "activation"),
        ({"heads": 5}, "divisible by num_attention_heads"),
        ({"num_gqa_groups": 3}, "num_gqa_groups"),
        ({"self_attn_mask_type": "padding"}, "self_attn_mask_type"),
        ({"attn_input_format": "thd"}, "attn_input_format"),
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
    ],
)
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        _layer(**kw)


def test_bad_inputs_raise():
    layer = _layer()
    with pytest.raises(ValueError, match=r"expected hidden_states of shape \(batch, seq, 32\)"):
        layer(torch.randn(B, S, H + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(B, S, H), attention_mask=torch.zeros(S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        layer(torch.randn(B, S, H), rotary_pos_emb=torch.zeros(S // 2, 1, 1, 4))
    with pytest.raises(ValueError, match="attention_mask"):
        _layer(self_attn_mask_type="arbitrary")(torch.randn(B, S, H))
