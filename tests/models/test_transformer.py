"""Transformer layers and models: backward against finite differences (float64), forward against
loop implementations written here from the papers' equations (and against PyTorch when it is
installed), gradient-ready order, causality, float32 stability, bad input."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from gradcheck import central_difference

from models.layers import Sequential
from models.network import Model
from models.transformer import (
    GELU,
    MLP,
    ClassToken,
    Embedding,
    LayerNorm,
    LMHead,
    MultiHeadSelfAttention,
    PatchEmbedding,
    PositionEmbedding,
    RMSNorm,
    SegmentEmbedding,
    SwiGLU,
    Tanh,
    TokenPool,
    TransformerBlock,
    TransformerModel,
    bert_layers,
    gpt,
    gpt_layers,
    llama_layers,
    vit,
    vit_layers,
)


def wrap(layer, in_shape, seed=1, jitter=0.3):
    """A float64 Model around a bare layer, parameters perturbed away from (1, 0) inits."""
    m = Model(layer, in_shape, None, dtype=np.float64, seed=seed, name="under_test")
    m.params.flat[...] += np.random.default_rng(seed).standard_normal(m.num_params) * jitter
    return m


def check_close(numeric, analytic, what, rtol=1e-5, atol=1e-8):
    numeric, analytic = np.asarray(numeric), np.asarray(analytic)
    np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol, err_msg=what)


def fd_pairs(vec, grad, loss, idx, eps=1e-6):
    """(central difference, analytic) at coordinates ``idx`` of ``vec`` (restored after)."""
    return np.array([central_difference(vec, i, loss, eps) for i in idx]), grad[idx]


def fd_check(model, x, *, n=40, seed=0, input_grad=True):
    """Analytic gradients of L = sum(R * f(x)) against central differences."""
    rng = np.random.default_rng(seed)
    y = model.forward(x)
    R = rng.standard_normal(y.shape)
    dx = model.backward(R.copy())
    g = model.grads.flat.copy()

    def loss():
        return float((R * model.forward(x)).sum())

    th = model.params.flat
    if th.size:
        idx = rng.choice(th.size, min(n, th.size), replace=False)
        check_close(*fd_pairs(th, g, loss, idx), "parameter gradient")
    if input_grad:
        xf, dxf = x.reshape(-1), dx.reshape(-1)
        idx = rng.choice(xf.size, min(n, xf.size), replace=False)
        check_close(*fd_pairs(xf, dxf, loss, idx), "input gradient")


SEQ = (5, 8)  # T, d


@pytest.mark.parametrize("make, in_shape", [
    (lambda: LayerNorm(8), SEQ),
    (lambda: RMSNorm(8), SEQ),
    (lambda: GELU(), SEQ),
    (lambda: Tanh(), SEQ),
    (lambda: MultiHeadSelfAttention(8, 2), SEQ),
    (lambda: MultiHeadSelfAttention(8, 2, causal=True), SEQ),
    (lambda: MultiHeadSelfAttention(8, 4, bias=False), SEQ),
    (lambda: MLP(8, 12), SEQ),
    (lambda: SwiGLU(8, 12), SEQ),
    (lambda: TransformerBlock(8, 2, 12), SEQ),
    (lambda: TransformerBlock(8, 2, 12, causal=True, norm_first=False), SEQ),
    (lambda: TransformerBlock(8, 2, 12, causal=True, norm="rms", ffn="swiglu", bias=False), SEQ),
    (lambda: PositionEmbedding(7, 8), SEQ),
    (lambda: SegmentEmbedding(2, 8), SEQ),
    (lambda: ClassToken(8), SEQ),
    (lambda: TokenPool("cls"), SEQ),
    (lambda: TokenPool("mean"), SEQ),
    (lambda: TokenPool("last"), SEQ),
    (lambda: LMHead(8, 11), SEQ),
    (lambda: PatchEmbedding((2, 4, 6), 2, 5), (2, 4, 6)),
], ids=["layernorm", "rmsnorm", "gelu", "tanh", "attention", "causal_attention",
        "attention_nobias", "mlp", "swiglu", "block_prenorm", "block_postnorm", "block_llama",
        "position", "segment", "cls_token", "pool_cls", "pool_mean", "pool_last", "lm_head",
        "patch_embedding"])
def test_layer_gradients_finite_differences(make, in_shape):
    model = wrap(make(), in_shape)
    x = np.random.default_rng(3).standard_normal((3, *in_shape))
    fd_check(model, x)


# ---------------------------------------------------------------------------------------------
# independent forward references (loops over the equations)
# ---------------------------------------------------------------------------------------------
def attention_loop(x, w_qkv, b_qkv, w_o, b_o, heads, causal):
    """Vaswani et al. eq. 1 per sample, head and query, with scalar exp (no vectorization)."""
    N, T, d = x.shape
    dh = d // heads
    out = np.zeros((N, T, d))
    for n in range(N):
        qkv = x[n] @ w_qkv.T + b_qkv
        q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
        concat = np.zeros((T, d))
        for h in range(heads):
            sl = slice(h * dh, (h + 1) * dh)
            for i in range(T):
                keys = range(i + 1) if causal else range(T)
                scores = [sum(q[i, sl][c] * k[j, sl][c] for c in range(dh)) / math.sqrt(dh)
                          for j in keys]
                top = max(scores)
                w = [math.exp(s - top) for s in scores]
                z = sum(w)
                for wj, j in zip(w, keys):
                    concat[i, sl] += wj / z * v[j, sl]
        out[n] = concat @ w_o.T + b_o
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_matches_loop_reference(causal):
    layer = MultiHeadSelfAttention(6, 3, causal=causal)
    m = wrap(layer, (4, 6))
    x = np.random.default_rng(0).standard_normal((2, 4, 6))
    ref = attention_loop(x, m.params["qkv.weight"], m.params["qkv.bias"],
                         m.params["proj.weight"], m.params["proj.bias"], 3, causal)
    np.testing.assert_allclose(m.forward(x), ref, rtol=1e-10, atol=1e-12)


def test_layernorm_rmsnorm_gelu_forward_match_scalar_formulas():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5)) * 3 + 1
    ln = wrap(LayerNorm(5), (3, 5))
    y = ln.forward(x)
    g, b = ln.params["weight"], ln.params["bias"]
    for row, out in zip(x.reshape(-1, 5), y.reshape(-1, 5)):
        mu = sum(row) / 5
        var = sum((r - mu) ** 2 for r in row) / 5
        ref = [(r - mu) / math.sqrt(var + 1e-5) * g[i] + b[i] for i, r in enumerate(row)]
        np.testing.assert_allclose(out, ref, rtol=1e-12)
    rms = wrap(RMSNorm(5), (3, 5))
    y = rms.forward(x)
    for row, out in zip(x.reshape(-1, 5), y.reshape(-1, 5)):
        ms = sum(r * r for r in row) / 5
        ref = [r / math.sqrt(ms + 1e-6) * rms.params["weight"][i] for i, r in enumerate(row)]
        np.testing.assert_allclose(out, ref, rtol=1e-12)
    gelu = GELU().forward(x)
    for v, out in zip(x.ravel(), gelu.ravel()):
        assert out == pytest.approx(0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi)
                                                             * (v + 0.044715 * v ** 3))))
        # the tanh form approximates the exact GELU x Phi(x) closely
        assert out == pytest.approx(0.5 * v * (1 + math.erf(v / math.sqrt(2))), abs=2e-3)


def test_patch_embedding_matches_loop():
    layer = PatchEmbedding((2, 4, 6), 2, 3)
    m = wrap(layer, (2, 4, 6))
    x = np.random.default_rng(2).standard_normal((2, 2, 4, 6))
    y = m.forward(x)
    W, b = m.params["proj.weight"], m.params["proj.bias"]
    for n in range(2):
        for i in range(2):
            for j in range(3):
                tok = i * 3 + j
                for o in range(3):
                    s = b[o]
                    for c in range(2):
                        for di in range(2):
                            for dj in range(2):
                                s += W[o, c * 4 + di * 2 + dj] * x[n, c, i * 2 + di, j * 2 + dj]
                    assert y[n, tok, o] == pytest.approx(s, rel=1e-12)


def test_embedding_lookup_and_scatter_gradient():
    layer = Embedding(7, 3)
    m = Model(Sequential([("e", layer)]), (4,), None, dtype=np.float64)
    tokens = np.array([[1, 1, 6, 0], [6, 2, 1, 1]])
    out = m.forward(tokens)
    np.testing.assert_array_equal(out, m.params["e.weight"][tokens])
    dy = np.random.default_rng(0).standard_normal(out.shape)
    m.backward(dy)
    ref = np.zeros((7, 3))
    for n in range(2):
        for t in range(4):
            ref[tokens[n, t]] += dy[n, t]
    np.testing.assert_allclose(m.grads["e.weight"], ref)


# ---------------------------------------------------------------------------------------------
# whole models
# ---------------------------------------------------------------------------------------------
def tiny_vit(pool="cls", seed=0):
    root = vit_layers((1, 4, 4), 3, patch=2, dim=8, depth=2, heads=2, pool=pool)
    return TransformerModel(root, (1, 4, 4), 3, dtype=np.float64, seed=seed, name="vit")


def tiny_lm(kind="gpt", tie=False, seed=0, T=6, V=13):
    if kind == "gpt":
        root = gpt_layers(T, V, dim=8, depth=2, heads=2, tie=tie)
    else:
        root = llama_layers(T, V, dim=8, depth=2, heads=2, hidden=12)
    return TransformerModel(root, (T,), V, lm=True, dtype=np.float64, seed=seed, name=kind)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_whole_vit_gradients_finite_differences(pool):
    model = tiny_vit(pool)
    x = np.random.default_rng(4).standard_normal((3, 1, 4, 4))
    fd_check(model, x, n=60)


def lm_loss_loop(logits, tokens, labels):
    """Mean over positions of -log softmax(logits[n, t])[next token] (scalar loops)."""
    N, T, _ = logits.shape
    total = 0.0
    for n in range(N):
        for t in range(T):
            target = tokens[n, t + 1] if t + 1 < T else labels[n]
            row = logits[n, t]
            top = max(row)
            lse = top + math.log(sum(math.exp(v - top) for v in row))
            total += lse - row[target]
    return total / (N * T)


@pytest.mark.parametrize("kind, tie", [("gpt", False), ("gpt", True), ("llama", False)])
def test_whole_lm_gradients_finite_differences(kind, tie):
    model = tiny_lm(kind, tie)
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 13, (3, 6)), rng.integers(0, 13, 3)
    loss, last = model.loss_and_grad(x, y)
    g = model.grads.flat.copy()
    seq = model.sequence_logits(x, training=False)
    assert loss == pytest.approx(lm_loss_loop(seq, x, y), rel=1e-12)
    np.testing.assert_array_equal(last, seq[:, -1])
    idx = rng.choice(model.num_params, 80, replace=False)
    check_close(*fd_pairs(model.params.flat, g, lambda: model.lm_loss(x, y)[0], idx),
                "LM parameter gradient")


def test_tied_head_gradient_is_sum_of_both_uses():
    """GPT-2 ties the head to the token table: its gradient is the untied model's table gradient
    plus its head gradient, evaluated at equal weights."""
    tied, untied = tiny_lm(tie=True), tiny_lm(tie=False)
    for name in tied.layout.names:
        untied.params[name][...] = tied.params[name]
    untied.params["head.weight"][...] = tied.params["wte.weight"]
    rng = np.random.default_rng(6)
    x, y = rng.integers(0, 13, (4, 6)), rng.integers(0, 13, 4)
    lt, _ = tied.loss_and_grad(x, y)
    lu, _ = untied.loss_and_grad(x, y)
    assert lt == pytest.approx(lu, rel=1e-12)
    np.testing.assert_allclose(tied.grads["wte.weight"],
                               untied.grads["wte.weight"] + untied.grads["head.weight"],
                               rtol=1e-10, atol=1e-14)
    assert "head.weight" not in tied.layout


@pytest.mark.parametrize("build", [
    lambda: tiny_vit(), lambda: tiny_lm(tie=True), lambda: tiny_lm("llama"),
    lambda: Model(bert_layers(6, 11, dim=8, depth=2, heads=2), (6,), None, name="bert"),
], ids=["vit", "gpt_tied", "llama", "bert"])
def test_gradients_become_ready_in_layout_order(build):
    model = build()
    rng = np.random.default_rng(0)
    if model.input_shape == (6,):
        x = rng.integers(0, 11, (2, 6))
    else:
        x = rng.standard_normal((2, *model.input_shape))
    seen = []
    y = model.forward(x)
    model.backward(np.ones_like(y), ready=seen.append)
    assert seen == list(model.layout.names)


def test_causal_model_does_not_look_ahead():
    model = tiny_lm()
    rng = np.random.default_rng(7)
    x = rng.integers(0, 13, (2, 6))
    a = model.sequence_logits(x, training=False)
    x2 = x.copy()
    x2[:, 4:] = (x2[:, 4:] + 5) % 13
    b = model.sequence_logits(x2, training=False)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])
    # a bidirectional block lets the last position change the first one's output
    blk = wrap(TransformerBlock(8, 2), (6, 8))
    h = rng.standard_normal((1, 6, 8))
    h2 = h.copy()
    h2[:, 5] += rng.standard_normal(8)
    assert not np.allclose(blk.forward(h)[:, 0], blk.forward(h2)[:, 0])


def test_float32_softmax_and_layernorm_are_stable():
    rng = np.random.default_rng(8)
    # scores of order 1e4: a naive exp overflows in float32
    attn = Model(MultiHeadSelfAttention(8, 2, causal=True), (5, 8), None, dtype=np.float32)
    x = (rng.standard_normal((2, 5, 8)) * 300).astype(np.float32)
    y = attn.forward(x)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    attn.backward(np.ones_like(y))
    assert np.isfinite(attn.grads.flat).all()
    # a large common offset with a small spread: E[x^2] - E[x]^2 would cancel catastrophically
    ln = Model(LayerNorm(16), (16,), None, dtype=np.float32)
    x = (1e4 + rng.standard_normal((4, 16))).astype(np.float32)
    y = ln.forward(x)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, ref, atol=2e-3)


def test_initialization_is_gpt2_style_and_seeded():
    a, b, c = (vit((1, 8, 8), 10, seed=s, dim=32, depth=4, heads=4) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.params.flat, b.params.flat)
    assert not np.array_equal(a.params.flat, c.params.flat)
    p = a.params
    assert np.all(p["blocks.0.ln1.weight"] == 1) and np.all(p["blocks.0.ln1.bias"] == 0)
    assert np.all(p["blocks.0.attn.qkv.bias"] == 0)
    assert np.std(p["blocks.0.attn.qkv.weight"]) == pytest.approx(0.02, rel=0.1)
    # residual output projections: 0.02 / sqrt(2 * depth)
    assert np.std(p["blocks.0.mlp.fc2.weight"]) == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


def test_lm_model_takes_integer_tokens_and_reports_perplexity():
    from models.data import Dataset
    model = gpt((8,), 256, dim=16, depth=1, heads=2)
    rng = np.random.default_rng(9)
    data = Dataset(rng.integers(0, 256, (10, 8)), rng.integers(0, 256, 10), 256, "t")
    out = model.evaluate_lm(data, batch_size=4)
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))
    # freshly initialized: close to the uniform predictor over 256 bytes
    assert out["loss"] == pytest.approx(math.log(256), abs=0.05)
    assert model.forward(data.x).shape == (10, 256)
    assert model.predict(data.x).shape == (10,)


def test_bad_arguments_raise_valueerror_with_fix():
    with pytest.raises(ValueError, match="multiple of heads"):
        MultiHeadSelfAttention(10, 3)
    with pytest.raises(ValueError, match="divide"):
        PatchEmbedding((1, 8, 8), 3, 4)
    model = gpt((4,), 16, dim=8, depth=1, heads=2)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        model.forward(np.array([[1, 2, 3, 16]]))
    with pytest.raises(ValueError, match="integer token"):
        model.forward(np.array([[1.5, 2, 3, 4]]))
    with pytest.raises(ValueError, match=r"expects inputs \(N, 4\)"):
        model.forward(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="text"):
        gpt((1, 8, 8), 10)
    with pytest.raises(ValueError, match="does not match"):
        LMHead(8, 10, tie=Embedding(11, 8))


@pytest.mark.skipif(os.environ.get("SPARDIST_TORCH_TESTS") != "1",
                    reason="optional PyTorch cross-check: set SPARDIST_TORCH_TESTS=1 (needs torch; "
                           "a cold import takes up to a minute)")
def test_matches_pytorch_when_installed():
    """The whole tied GPT (loss and every gradient) against PyTorch autograd."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    model = tiny_lm(tie=True, T=6, V=13)
    rng = np.random.default_rng(10)
    model.params.flat[...] += rng.standard_normal(model.num_params) * 0.05
    x, y = rng.integers(0, 13, (3, 6)), rng.integers(0, 13, 3)
    loss, _ = model.loss_and_grad(x, y)
    P = {n: torch.tensor(model.params[n], requires_grad=True) for n in model.layout.names}
    tok = torch.tensor(x)
    h = P["wte.weight"][tok] + P["wpe.weight"][:6]
    for b in range(2):
        def p(name, b=b):
            return P[f"blocks.{b}.{name}"]
        a = F.layer_norm(h, (8,), p("ln1.weight"), p("ln1.bias"), 1e-5)
        q, k, v = F.linear(a, p("attn.qkv.weight"), p("attn.qkv.bias")).split(8, dim=-1)
        q, k, v = (t.reshape(3, 6, 2, 4).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + F.linear(o.transpose(1, 2).reshape(3, 6, 8), p("attn.proj.weight"),
                         p("attn.proj.bias"))
        a = F.layer_norm(h, (8,), p("ln2.weight"), p("ln2.bias"), 1e-5)
        a = F.gelu(F.linear(a, p("mlp.fc1.weight"), p("mlp.fc1.bias")), approximate="tanh")
        h = h + F.linear(a, p("mlp.fc2.weight"), p("mlp.fc2.bias"))
    h = F.layer_norm(h, (8,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
    logits = h @ P["wte.weight"].T
    targets = torch.tensor(np.concatenate([x[:, 1:], y[:, None]], axis=1))
    ref = F.cross_entropy(logits.reshape(-1, 13), targets.reshape(-1))
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-10)
    for n in model.layout.names:
        np.testing.assert_allclose(model.grads[n], P[n].grad.numpy(), rtol=1e-8, atol=1e-12,
                                   err_msg=n)


def test_prenorm_block_with_zero_parameters_is_identity():
    """What block-level SDP relies on: masking every tensor of a pre-norm block to zero (norm
    gains and biases included) turns it into the identity, as for a ResNet block."""
    for blk in (TransformerBlock(8, 2, 12, causal=True),
                TransformerBlock(8, 2, 12, norm="rms", ffn="swiglu", bias=False)):
        m = Model(blk, (5, 8), None, dtype=np.float64)
        m.params.flat[...] = 0.0
        x = np.random.default_rng(11).standard_normal((2, 5, 8))
        np.testing.assert_array_equal(m.forward(x), x)


def test_spec_of_built_models_matches_their_layout():
    for model in (vit((1, 8, 8), 10, dim=16, depth=1, heads=2),
                  gpt((16,), 256, dim=16, depth=1, heads=2)):
        spec = model.spec()
        assert spec.num_params == model.num_params
        assert spec.layout.names == model.layout.names
        assert spec.num_classes == model.num_classes
