"""The TransformerEngine / PyTorch module conventions of fusible.Linear, LayerNormLinear and
LayerNormMLP (issue 12): quantizer roles of a module (slot order, agreeing with
``num_quantizers`` and ``explain()``), ``reset_parameters()`` (meta-device construction, also
inside ``quantized_model_init``), and TransformerEngine ``state_dict`` names (saved under TE
names, loaded from TE or positional names, missing / unexpected keys reported by TE name)."""

from __future__ import annotations

import collections
import copy
import io
import math
import re

import pytest
import torch
from modules_helpers import RECIPES

import fusible
from fusible import ops
from fusible.quantization import QuantizedTensor, QuantizerRole

FWD = ["input", "weight", "output"]
BWD = ["grad_output", "grad_input"]
H, F = 64, 96  # MXFP8: multiples of 32

# name -> (constructor(device, dtype), TE state_dict keys in order, roles' "scope[:name]"s)
CASES = {
    "linear": (
        lambda **kw: fusible.Linear(H, F, **kw),
        ["weight", "bias", "_extra_state"],
        ["linear"],
    ),
    "linear_nobias_named": (
        lambda **kw: fusible.Linear(H, F, bias=False, name="proj", **kw),
        ["weight", "_extra_state"],
        ["linear:proj"],
    ),
    "layernorm_linear": (
        lambda **kw: fusible.LayerNormLinear(H, F, **kw),
        ["layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state"],
        ["layernorm_linear"],
    ),
    "layernorm_linear_rms_nobias_zc": (
        lambda **kw: fusible.LayerNormLinear(
            H, F, bias=False, normalization="RMSNorm", zero_centered_gamma=True, name="qkv", **kw
        ),
        ["layer_norm_weight", "weight", "_extra_state"],
        ["layernorm_linear:qkv"],
    ),
    "layernorm_mlp": (
        lambda **kw: fusible.LayerNormMLP(H, F, **kw),
        [
            "layer_norm_weight",
            "layer_norm_bias",
            "fc1_weight",
            "fc1_bias",
            "fc2_weight",
            "fc2_bias",
            "fc1._extra_state",
            "fc2._extra_state",
        ],
        ["layernorm_mlp:fc1", "layernorm_mlp:fc2"],
    ),
    "layernorm_mlp_swiglu_rms_nobias": (
        lambda **kw: fusible.LayerNormMLP(
            H, F, bias=False, activation="swiglu", normalization="RMSNorm", **kw
        ),
        ["layer_norm_weight", "fc1_weight", "fc2_weight", "fc1._extra_state", "fc2._extra_state"],
        ["layernorm_mlp:fc1", "layernorm_mlp:fc2"],
    ),
}
NAMES = sorted(CASES)
DELAYED = RECIPES["delayed"]


def _build(case, seed=0, **kw):
    torch.manual_seed(seed)
    return CASES[case][0](**kw)


def _out_features(m):
    return H if isinstance(m, fusible.LayerNormMLP) else F


def _step(m, rec=DELAYED, seed=1):
    """One forward/backward under ``rec``; returns output, input gradient, parameter grads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, H, generator=g).requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = m(x)
    y.backward(torch.randn(y.shape, generator=g))
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _trained(case, seed=0):
    m = _build(case, seed)
    _randomize(m)
    for i in range(2):  # delayed scaling: non-trivial amax histories and scales
        _step(m, seed=10 + i)
    return m


def _positional_state_dict(m):
    """What ``state_dict()`` of a module gave before TE names: one entry per parameter and one
    ``_extra_state`` per op, under positional keys (an old checkpoint)."""
    sd = {}
    for i, op in enumerate(m):
        for n, p in op.named_parameters():
            sd[f"{i}.{n}"] = p.detach().clone()
        sd[f"{i}._extra_state"] = op.get_extra_state()
    return sd


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_same_model(a, b):
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    for op_a, op_b in zip(a, b, strict=True):
        # Loaded recipe state is applied when the state is built (at the first forward).
        op_a.ensure_recipe_state(DELAYED)
        op_b.ensure_recipe_state(DELAYED)
        sa, sb = op_a.get_extra_state(), op_b.get_extra_state()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _assert_same_step(a, b):
    for u, v in zip(_step(a, seed=5), _step(b, seed=5), strict=True):
        assert torch.equal(u, v)


# ---- quantizer roles of modules ---------------------------------------------------------------


def _explained_roles(text):
    return [m.group(1) for m in re.finditer(r"(?<![\w:])([a-z_]+:[a-z_]+(?::[a-z_0-9]+)?): ", text)]


@pytest.mark.parametrize("case", NAMES)
def test_module_roles_in_slot_order(case):
    m = _build(case)
    for fwd, buckets in ((True, FWD), (False, BWD)):
        roles = m.get_quantizer_roles(fwd)
        assert all(isinstance(r, QuantizerRole) for r in roles)
        want = [f"{b}:{scope}" for scope in CASES[case][2] for b in buckets]
        assert [r.qualified for r in roles] == want
        assert roles == [r for op in m for r in op.get_quantizer_roles(fwd)]
        assert m.num_quantizers(fwd) == len(want)


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "custom"])
@pytest.mark.parametrize("case", NAMES)
def test_module_roles_agree_with_explain(case, recipe_name):
    m = _build(case)
    with fusible.autocast(recipe=RECIPES[recipe_name]):
        text = m.explain()
    listed = collections.Counter(_explained_roles(text))
    want = [r.qualified for fwd in (True, False) for r in m.get_quantizer_roles(fwd)]
    assert listed == collections.Counter(want)
    assert sum(listed.values()) == m.num_quantizers(True) + m.num_quantizers(False)


def test_modules_in_a_container_keep_their_roles():
    a, b = fusible.LayerNormLinear(H, F, name="qkv"), fusible.LayerNormMLP(F, H)
    model = ops.Sequential(a, b)
    for fwd in (True, False):
        assert model.get_quantizer_roles(fwd) == a.get_quantizer_roles(fwd) + b.get_quantizer_roles(
            fwd
        )
        assert model.num_quantizers(fwd) == a.num_quantizers(fwd) + b.num_quantizers(fwd)


# ---- reset_parameters and meta-device construction --------------------------------------------


@pytest.mark.parametrize("case", NAMES)
def test_meta_device_then_to_empty_and_reset_parameters(case):
    ref = _build(case, seed=3)
    m = _build(case, seed=3, device="meta")
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    m.reset_parameters()
    params, ref_params = dict(m.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        assert p.device.type == "cpu" and torch.equal(p, ref_params[n]), n
    # The initial values themselves: norm gamma 1 (weight 0 when zero-centred), biases 0,
    # Linear weights kaiming-uniform as torch.nn.Linear's.
    zc = "zc" in case
    for op in m:
        if isinstance(op, (ops.LayerNorm, ops.RMSNorm)):
            assert torch.equal(op.weight, torch.full((op.normalized_shape,), 0.0 if zc else 1.0))
            if isinstance(op, ops.LayerNorm):
                assert torch.equal(op.bias, torch.zeros(op.normalized_shape))
        elif isinstance(op, ops.Bias):
            assert torch.equal(op.bias, torch.zeros(op.features))
    _assert_same_step(m, ref)
    torch.manual_seed(4)
    m.reset_parameters()
    linears = [op for op in m if isinstance(op, ops.BasicLinear)]
    torch.manual_seed(4)
    for op in linears:  # the same draws, in op order
        want = torch.empty(op.out_features, op.in_features)
        torch.nn.init.kaiming_uniform_(want, a=math.sqrt(5))  # torch.nn.Linear's weight init
        assert torch.equal(op.weight, want)
        assert op.weight.abs().max() <= 1 / math.sqrt(op.in_features)


@pytest.mark.parametrize("case", NAMES)
def test_reset_parameters_reinitialises_a_trained_module(case):
    m, fresh = _trained(case), _build(case, seed=6)
    torch.manual_seed(6)
    m.reset_parameters()
    for (n, p), q in zip(m.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n


def _qdata_tensors(w):
    from fusible.quantization.quantizers import qdata_tensors

    return qdata_tensors(w.qdata)


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
@pytest.mark.parametrize("case", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_meta_device_inside_quantized_model_init(case, recipe_name):
    rec = RECIPES[recipe_name]
    with fusible.quantized_model_init(rec):
        ref = _build(case, seed=3)
        m = _build(case, seed=3, device="meta")
    m.to_empty(device="cpu")  # quantized from here on (uninitialised values)
    torch.manual_seed(3)
    m.reset_parameters()  # filled in: the same bits as built on the CPU from the same seed
    for op, ref_op in zip(m, ref, strict=True):
        if not isinstance(op, ops.BasicLinear):
            for p, q in zip(op.parameters(), ref_op.parameters(), strict=True):
                assert torch.equal(p, q)
            continue
        assert isinstance(op.weight, QuantizedTensor) and type(op.weight) is type(ref_op.weight)
        got, want = _qdata_tensors(op.weight), _qdata_tensors(ref_op.weight)
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


# ---- TransformerEngine state_dict names --------------------------------------------------------


@pytest.mark.parametrize("case", NAMES)
def test_state_dict_has_te_names(case):
    m = _trained(case)
    sd = m.state_dict()
    assert list(sd) == CASES[case][1]
    for key in sd:
        if key.endswith("_extra_state"):
            continue
        attr = getattr(m, key)  # every TE name is also an attribute of the module
        assert isinstance(attr, torch.nn.Parameter) and torch.equal(sd[key], attr)
        assert m.state_dict(keep_vars=True)[key] is attr
    # The recipe state of each Linear (delayed scaling: amax history and scale).
    linears = [op for op in m if isinstance(op, ops.BasicLinear)]
    extras = [k for k in sd if k.endswith("_extra_state")]
    assert len(extras) == len(linears)
    for key, op in zip(extras, linears, strict=True):
        assert sd[key].keys() == op.get_extra_state().keys()
        assert sd[key]["forward.amax_history"].abs().sum() > 0
    # Under a prefix (a module inside a user model).
    parent = torch.nn.Module()
    parent.block = m
    assert list(parent.state_dict()) == [f"block.{k}" for k in CASES[case][1]]


def test_te_names_are_the_modules_attributes():
    m = fusible.LayerNormMLP(H, F)
    assert m.layer_norm_weight is m[0].weight and m.layer_norm_bias is m[0].bias
    assert m.fc1_weight is m.fc1.weight and m.fc2_weight is m.fc2.weight
    assert m.fc1_bias is m[2].bias and m.fc2_bias is m[5].bias
    bare = fusible.LayerNormMLP(H, F, bias=False, normalization="RMSNorm")
    assert bare.layer_norm_bias is None and bare.fc1_bias is None and bare.fc2_bias is None
    lnl = fusible.LayerNormLinear(H, F, normalization="RMSNorm")
    assert lnl.layer_norm_bias is None and lnl.weight is lnl[1].weight and lnl.bias is lnl[2].bias
    lin = fusible.Linear(H, F)
    assert lin.weight is lin[0].weight and lin.bias is lin[1].bias


@pytest.mark.parametrize("case", NAMES)
def test_assigning_a_te_named_parameter_replaces_the_ops(case):
    """``m.<te name> = Parameter(...)`` (what weight tying and Hugging Face's tie_weights do)
    replaces the op's parameter: nn.Module used to refuse it ("attribute 'weight' already
    exists", the names being properties over the ops). The module then trains the new one."""
    names = [k for k in CASES[case][1] if not k.endswith("_extra_state")]
    for name in names:
        m = _build(case)
        old = getattr(m, name)
        new = torch.nn.Parameter(torch.randn_like(old) * 0.05)
        setattr(m, name, new)
        assert getattr(m, name) is new, name
        params = list(m.parameters())
        assert any(p is new for p in params) and not any(p is old for p in params), name
        assert torch.equal(m.state_dict()[name], new.detach()), name
        with fusible.autocast(recipe=DELAYED):
            y = m(torch.randn(8, H))
        y.float().sum().backward()
        assert new.grad is not None and old.grad is None, name


def test_weight_tying_with_an_embedding():
    """An LM head tied to the embedding (``head.weight = emb.weight``), as GPT-2 style models
    and tie_weights do: one parameter, its gradient the sum of both uses, as plain torch's."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(96, H)
    head = fusible.Linear(H, 96, bias=False)
    head.weight = emb.weight
    ref_emb = copy.deepcopy(emb)
    tokens = torch.randint(0, 96, (16,))
    logits = head(emb(tokens))
    ref = torch.nn.functional.linear(ref_emb(tokens), ref_emb.weight)
    torch.testing.assert_close(logits, ref)
    g = torch.randn_like(ref)
    logits.backward(g)
    ref.backward(g)
    assert [n for n, _ in head.named_parameters()] == ["0.weight"]
    torch.testing.assert_close(emb.weight.grad, ref_emb.weight.grad)


def test_assigning_a_parameter_of_another_shape_raises():
    m = fusible.LayerNormMLP(H, F)
    with pytest.raises(ValueError, match=r"LayerNormMLP\.fc2_weight: a parameter of shape"):
        m.fc2_weight = torch.nn.Parameter(torch.zeros(F, H))
    assert m.fc2_weight.shape == (H, F)
    g = fusible.GroupedLinear(3, H, F)
    with pytest.raises(ValueError, match=r"GroupedLinear\.weight1: .*\(96, 64\).*\(64, 64\)"):
        g.weight1 = torch.nn.Parameter(torch.zeros(H, H))


@pytest.mark.parametrize("case", NAMES)
def test_assigning_a_plain_tensor_to_a_te_named_parameter_raises(case):
    """``m.weight = torch.randn(...)`` (no Parameter) raises ``TypeError`` as nn.Module's does
    for a registered parameter: it used to go into the op's slot, where it never trained.
    ``torch.func.functional_call`` still puts plain tensors there (its own test below)."""
    m = _build(case)
    name = next(k for k in CASES[case][1] if not k.endswith("_extra_state"))
    old = getattr(m, name)
    with pytest.raises(TypeError, match=rf"\.{name}: cannot assign a Tensor as parameter"):
        setattr(m, name, torch.randn_like(old))
    assert getattr(m, name) is old and isinstance(old, torch.nn.Parameter)


def test_grouped_linear_experts_can_share_a_weight():
    g = fusible.GroupedLinear(3, H, F)
    g.weight1 = g.weight0
    assert g.weight1 is g.weight0
    assert [n for n, _ in g.named_parameters()] == ["0.weight0", "0.weight2", "0.bias0",
                                                     "0.bias1", "0.bias2"]  # fmt: skip
    with fusible.autocast(recipe=DELAYED):
        y = g(torch.randn(12, H), [4, 4, 4])
    y.sum().backward()
    assert g.weight0.grad is not None


@pytest.mark.parametrize("spelling", ["te", "positional"])
@pytest.mark.parametrize("case", NAMES)
def test_load_te_or_positional_names_strict(case, spelling):
    src = _trained(case)
    sd = src.state_dict() if spelling == "te" else _positional_state_dict(src)
    sd = _save_load(sd)  # plain tensors: torch.load(weights_only=True)
    dst = _build(case, seed=9)
    result = dst.load_state_dict(sd, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same_model(dst, src)
    _assert_same_step(dst, src)
    # And back: what it saves now is the TE checkpoint of the source.
    again = dst.state_dict()
    assert list(again) == CASES[case][1]
    want = src.state_dict()
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(again[k], want[k]), k
        else:
            assert want[k].keys() == again[k].keys()
            assert all(torch.equal(want[k][f], again[k][f]) for f in want[k]), k


def test_checkpoint_round_trip_both_ways():
    """Old positional checkpoint -> module -> TE checkpoint -> another module -> TE again."""
    src = _trained("layernorm_mlp")
    a = _build("layernorm_mlp", seed=1)
    a.load_state_dict(_positional_state_dict(src))
    # (Loaded recipe state waits until the state is built, at the first forward under a
    # recipe; get_extra_state() before that returns {}: build it, as a forward would.)
    for op in a:
        op.ensure_recipe_state(DELAYED)
    b = _build("layernorm_mlp", seed=2)
    b.load_state_dict(_save_load(a.state_dict()))
    _assert_same_model(b, src)
    # A hand-built ops.Sequential of the same ops keeps positional names and loads the module's
    # parameters by their positional names (named_parameters() stays positional).
    seq = ops.Sequential(ops.LayerNorm(H), ops.Linear(H, F), ops.GELU(), ops.Linear(F, H))
    assert "1.weight" in seq.state_dict()
    seq.load_state_dict(dict(b.named_parameters()), strict=True)
    assert torch.equal(seq[1].weight, src.fc1.weight)


def test_missing_and_unexpected_keys_are_reported_by_te_name():
    src = fusible.LayerNormMLP(H, F)
    sd = src.state_dict()
    del sd["fc1_weight"], sd["layer_norm_bias"]
    sd["fc3_weight"] = torch.zeros(1)
    dst = fusible.LayerNormMLP(H, F)
    result = dst.load_state_dict(sd, strict=False)
    assert sorted(result.missing_keys) == ["fc1_weight", "layer_norm_bias"]
    assert result.unexpected_keys == ["fc3_weight"]
    with pytest.raises(RuntimeError) as err:
        dst.load_state_dict(sd, strict=True)
    msg = str(err.value)
    assert '"fc1_weight"' in msg and '"layer_norm_bias"' in msg and '"fc3_weight"' in msg
    assert "1.weight" not in msg and "0.bias" not in msg
    # A size mismatch names the TE key too.
    bad = {**src.state_dict(), "fc2_weight": torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match="size mismatch for fc2_weight:"):
        dst.load_state_dict(bad)
    # Also under a prefix, and for a positional checkpoint (the module's names are TE's).
    parent = torch.nn.Module()
    parent.mlp = fusible.LayerNormMLP(H, F)
    pos = {f"mlp.{k}": v for k, v in _positional_state_dict(src).items() if k != "4.weight"}
    result = parent.load_state_dict(pos, strict=False)
    assert result.missing_keys == ["mlp.fc2_weight"] and result.unexpected_keys == []
    # A key that the module does not have under either spelling stays as given.
    result = dst.load_state_dict({**src.state_dict(), "7.weight": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["7.weight"]


def test_both_spellings_of_one_key_raise():
    src = fusible.Linear(H, F)
    sd = {**src.state_dict(), "0.weight": torch.zeros(F, H)}
    with pytest.raises(
        RuntimeError, match=r"both 'weight' and its positional spelling '0\.weight'"
    ):
        fusible.Linear(H, F).load_state_dict(sd)


def test_bias_mismatch_is_reported():
    sd = fusible.Linear(H, F).state_dict()
    result = fusible.Linear(H, F, bias=False).load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["bias"] and result.missing_keys == []
    result = fusible.Linear(H, F).load_state_dict(
        fusible.Linear(H, F, bias=False).state_dict(), strict=False
    )
    assert result.missing_keys == ["bias"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_te_names(how):
    m = _trained("layernorm_mlp")
    if how == "deepcopy":
        twin = copy.deepcopy(m)
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert list(twin.state_dict()) == CASES["layernorm_mlp"][1]
    twin.load_state_dict(m.state_dict(), strict=True)
    _assert_same_model(twin, m)


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
@pytest.mark.parametrize("spelling", ["te", "positional"])
def test_quantized_weights_save_and_load_exactly(recipe_name, spelling):
    rec = RECIPES[recipe_name]
    with fusible.quantized_model_init(rec):
        src = _build("layernorm_mlp", seed=0)
        dst = _build("layernorm_mlp", seed=5)
    sd = src.state_dict()
    assert list(sd) == CASES["layernorm_mlp"][1]
    for name, op in (("fc1", src.fc1), ("fc2", src.fc2)):
        # The dequantized weight (a plain tensor) and the exact quantized data in the extra state.
        assert type(sd[f"{name}_weight"]) is torch.Tensor
        assert torch.equal(sd[f"{name}_weight"], op.weight.dequantize())
        assert any(k.startswith("weight.") for k in sd[f"{name}._extra_state"])
    if spelling == "positional":
        pos = _positional_state_dict(src)
        for i, op in enumerate(src):
            if isinstance(op, ops.BasicLinear):
                pos[f"{i}.weight"] = op.weight.dequantize()
        sd = pos
    dst.load_state_dict(_save_load(sd), strict=True)
    for a, b in ((src.fc1, dst.fc1), (src.fc2, dst.fc2)):
        assert isinstance(b.weight, QuantizedTensor)
        got, want = _qdata_tensors(b.weight), _qdata_tensors(a.weight)
        for k in want:
            assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_fsdp_style_materialisation():
    """FSDP materialises a meta model by calling reset_parameters() on each module that holds
    parameters of its own (the ops, never a container): the same model as reset_parameters()
    on the top module, and as one built on the CPU."""
    ref = _build("layernorm_mlp", seed=3)
    m = _build("layernorm_mlp", seed=3, device="meta")
    m.to_empty(device="cpu")
    torch.manual_seed(3)
    for sub in m.modules():
        if any(True for _ in sub.parameters(recurse=False)):
            sub.reset_parameters()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("case", NAMES)
def test_distributed_checkpoint_state_dict_helpers(case):
    """torch.distributed.checkpoint's model state-dict helpers map state_dict keys to attribute
    paths; the TE names are attributes, so they work (no process group needed on CPU)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    src, dst = _trained(case), _build(case, seed=9)
    sd = get_model_state_dict(src)
    assert list(sd) == CASES[case][1]
    result = set_model_state_dict(dst, sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same_model(dst, src)


# ---- TransformerEngine's argument names -------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: fusible.Linear(16, 8, **kw),
        lambda **kw: fusible.LayerNormLinear(16, 8, **kw),
        lambda **kw: fusible.LayerNormMLP(16, 32, **kw),
        lambda **kw: fusible.GroupedLinear(2, 16, 8, **kw),
        lambda **kw: fusible.MultiheadAttention(16, 2, **kw),
        lambda **kw: fusible.TransformerLayer(16, 32, 2, **kw),
    ],
    ids=["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "MHA", "TransformerLayer"],
)
def test_params_dtype_is_dtype(make):
    """``params_dtype`` (TransformerEngine's name) sets the parameters' dtype as ``dtype``
    does; both may be given when they agree, and disagreeing ones raise naming both."""
    for kw in ({"params_dtype": torch.bfloat16},
               {"params_dtype": torch.bfloat16, "dtype": torch.bfloat16}):  # fmt: skip
        m = make(**kw)
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}, kw
    assert {p.dtype for p in make().parameters()} == {torch.get_default_dtype()}
    with pytest.raises(ValueError, match=r"'dtype' \(torch.float32\) and 'params_dtype' "
                       r"\(torch.bfloat16\) disagree"):  # fmt: skip
        make(dtype=torch.float32, params_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "make, te_eps",
    [
        (lambda *a, **kw: fusible.Linear(16, 8, *a, **kw), False),
        (lambda *a, **kw: fusible.LayerNormLinear(16, 8, *a, **kw), True),
        (lambda *a, **kw: fusible.LayerNormMLP(16, 32, *a, **kw), True),
        (lambda *a, **kw: fusible.GroupedLinear(2, 16, 8, *a, **kw), False),
        (lambda *a, **kw: fusible.MultiheadAttention(16, 2, **kw), False),
        (lambda *a, **kw: fusible.TransformerLayer(16, 32, 2, **kw), False),
    ],
    ids=["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "MHA", "TransformerLayer"],
)
def test_bias_must_be_a_bool(make, te_eps):
    """TransformerEngine's third positional argument of ``LayerNormLinear`` / ``LayerNormMLP``
    is ``eps``: ``LayerNormMLP(1024, 4096, 1e-6)`` written for TE used to turn the bias on
    (1e-6 is truthy) and keep eps at 1e-5 without a word. A bias that is not a bool raises,
    naming the module and, where TE's third argument is eps, the keyword to use."""
    with pytest.raises(TypeError, match=r"bias must be a bool, got 1e-06 \(float\)") as err:
        make(1e-6) if te_eps else make(bias=1e-6)
    assert ("pass it by keyword (eps=1e-06)" in str(err.value)) == te_eps
    for bias in (True, False, 1, 0):
        m = make(bias=bias)
        biased = any("bias" in n and "layer_norm" not in n for n in m.state_dict())
        assert biased == bool(bias), bias


@pytest.mark.parametrize("case", sorted(CASES))
def test_functional_call_by_state_dict_names(case):
    """``torch.func.functional_call`` with the parameters keyed by ``state_dict()``'s (TE)
    names computes what the positional names give, leaves the module's own parameters in place,
    and backward through it gives the given tensors the ordinary backward's gradients.
    (functorch transforms -- ``torch.func.grad``, ``vmap`` -- are not supported: fusible's
    autograd Function has no ``setup_context``.)"""
    from torch.func import functional_call

    make, _, _ = CASES[case]
    torch.manual_seed(0)
    m = make()
    x = torch.randn(4, H)
    own = list(m.parameters())
    te = {k: v for k, v in m.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    pos = dict(m.named_parameters())
    assert len(te) == len(pos)
    twice_te = functional_call(m, {k: v.detach() * 2 for k, v in te.items()}, (x,))
    twice_pos = functional_call(m, {k: v.detach() * 2 for k, v in pos.items()}, (x,))
    assert torch.equal(twice_te, twice_pos)
    assert all(a is b for a, b in zip(own, m.parameters(), strict=True))
    given = {k: v.detach().clone().requires_grad_() for k, v in te.items()}
    functional_call(m, given, (x,)).square().sum().backward()
    m(x).square().sum().backward()
    for k, v in te.items():
        assert torch.equal(given[k].grad, v.grad), k


# ---- init_method (TransformerEngine's weight initialisers) ---------------------------------------


def _fill(v):
    return lambda w: torch.nn.init.constant_(w, v)


INIT_CASES = {
    # module factory(init, output_init) -> {weight name: the value its initialiser writes}
    "linear": (lambda i, o: fusible.Linear(H, F, init_method=i), {"weight": 0.25}),
    "layernorm_linear": (
        lambda i, o: fusible.LayerNormLinear(H, F, init_method=i),
        {"weight": 0.25},
    ),
    "layernorm_mlp": (
        lambda i, o: fusible.LayerNormMLP(H, F, init_method=i, output_layer_init_method=o),
        {"fc1_weight": 0.25, "fc2_weight": -0.5},
    ),
    "grouped_linear": (
        lambda i, o: fusible.GroupedLinear(2, H, F, init_method=i),
        {"weight0": 0.25, "weight1": 0.25},
    ),
    "transformer_layer": (
        lambda i, o: fusible.TransformerLayer(H, F, 4, init_method=i, output_layer_init_method=o),
        {
            "self_attention.layernorm_qkv.weight": 0.25,
            "self_attention.proj.weight": -0.5,
            "layernorm_mlp.fc1_weight": 0.25,
            "layernorm_mlp.fc2_weight": -0.5,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(INIT_CASES))
def test_init_method_initialises_each_weight(case):
    """``init_method`` / ``output_layer_init_method`` (TransformerEngine's arguments; they used
    to raise "unexpected keyword") initialise the weights they are for, at construction and
    again at ``reset_parameters()`` (a ``meta`` build materialised with ``to_empty()``);
    biases and norms keep their defaults; None keeps kaiming-uniform."""
    make, want = INIT_CASES[case]
    m = make(_fill(0.25), _fill(-0.5))
    sd = m.state_dict()
    for name, v in want.items():
        assert torch.equal(sd[name], torch.full_like(sd[name], v)), name
    for name, t in sd.items():
        if name.endswith("bias") and not name.endswith("_extra_state"):
            assert not t.any(), name
    with torch.device("meta"):
        lazy = make(_fill(0.25), _fill(-0.5))
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for name in want:
        assert torch.equal(lazy.state_dict()[name], sd[name]), name
    torch.manual_seed(0)
    default = make(None, None).state_dict()
    assert all(default[name].std() > 0 for name in want)


def test_init_method_must_be_callable():
    with pytest.raises(TypeError, match=r"BasicLinear: init_method must be a callable"):
        fusible.Linear(H, F, init_method=0.02)


def test_init_method_under_quantized_model_init():
    """A weight stored quantized is the cast of what ``init_method`` wrote."""
    rec = RECIPES["current"]
    with fusible.quantized_model_init(rec):
        m = fusible.Linear(H, F, init_method=_fill(0.25))
    w = m.weight
    assert isinstance(w, QuantizedTensor)
    assert torch.equal(w.dequantize(), torch.full((F, H), 0.25))


# ---- return_bias (TransformerEngine's: the bias returned, not added) -----------------------------

RETURN_BIAS = {
    "linear": (lambda rb: fusible.Linear(H, F, return_bias=rb), "bias"),
    "layernorm_linear": (lambda rb: fusible.LayerNormLinear(H, F, return_bias=rb), "bias"),
    "layernorm_mlp": (lambda rb: fusible.LayerNormMLP(H, F, return_bias=rb), "fc2_bias"),
}


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("case", sorted(RETURN_BIAS))
def test_return_bias_returns_what_the_module_would_add(case, recipe_name):
    """``return_bias=True`` (it raised "unexpected keyword"): ``forward`` returns ``(y, bias)``
    with ``y + bias`` the plain module's output (bit for bit under an FP8 recipe, where the
    plain module adds the bias in the GEMM epilogue too; to fp32 rounding without one), the
    same ``state_dict`` keys (checkpoints load both ways), the same input and weight gradients,
    and the bias gradient from wherever the caller adds it (to fp32 rounding: another sum)."""
    make, bname = RETURN_BIAS[case]
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    plain, split = make(False), make(True)
    assert list(split.state_dict()) == list(plain.state_dict())
    split.load_state_dict(plain.state_dict())
    x = torch.randn(64, H)
    g = torch.randn(64, H if case == "layernorm_mlp" else F)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = plain(xs[0])
        out, bias = split(xs[1])
    assert bias.shape == getattr(split, bname).shape and bias.dtype == out.dtype
    y.backward(g)
    (out + bias).backward(g)
    tol = 0 if rec is not None else 1e-6
    torch.testing.assert_close(out + bias, y, rtol=tol, atol=tol)
    assert torch.equal(xs[1].grad, xs[0].grad)
    for name, p in plain.named_parameters():
        q = dict(split.named_parameters())[name]
        if p is getattr(plain, bname):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(q.grad, p.grad), name


def test_return_bias_arguments():
    with pytest.raises(ValueError, match=r"Linear: return_bias=True needs bias=True"):
        fusible.Linear(H, F, bias=False, return_bias=True)
    with pytest.raises(TypeError, match=r"LayerNormMLP: return_bias must be a bool"):
        fusible.LayerNormMLP(H, F, return_bias=1)  # type: ignore[arg-type]
    assert isinstance(fusible.Linear(H, F, return_bias=True)[1], ops.ReturnBias)
