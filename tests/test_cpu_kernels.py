"""The C++ elementwise kernels against the torch formulas they replace: bit for bit in bfloat16 (they
round where torch rounds), within float32 summation order in float32; and the layers that call them,
on both paths."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from tinyserve.layers.kernels import cpu_kernels

from tinyserve.layers import ops
from tinyserve.layers.norm import RMSNorm
from tinyserve.layers.ops import torch_rms_norm as rms_norm
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.layers.weight_format import DenseWeight

DTYPES = [torch.bfloat16, torch.float32]


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.bfloat16:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def _built():
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: rows split over threads
def test_rms_norm_and_add_rms_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    _same(cpu_kernels.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    stream = residual.clone()
    out = cpu_kernels.add_rms_norm(x, stream, weight, 1e-5)
    assert torch.equal(stream, x + residual)  # the sum is written into the residual's memory
    _same(out, rms_norm(x + residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_a_strided_view_of_qkv(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 21, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # rows strided by the whole qkv width
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = RotaryEmbedding(dim, 4096, 10000.0)(torch.randint(0, 4096, (tokens,), generator=gen), dtype)
    want_q, want_k = (x * cos + x.roll(dim // 2, dims=-1) * sin for x in (q, k))
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    cpu_kernels.rotary_(q, k, cos, sin)  # both, in place, in qkv's memory
    _same(q, want_q)
    _same(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V, beside them, untouched


def test_bfloat16_rounding_matches_torch_on_ties_infinities_and_nan():
    """The kernels' branchless bfloat16 rounding (csrc/float_types.h) against torch's, through add_rms_norm's
    residual sum (two bfloat16 values added in float32, rounded back): halfway cases go to even (down
    from 1 + 2^-8, up from 1 + 3 * 2^-8), a sum past bfloat16's largest to inf, NaN stays NaN."""
    bf16_max = torch.finfo(torch.bfloat16).max
    x = torch.tensor([[1.0, 1.0, -1.0, 1.0, bf16_max, -bf16_max, float("inf"), float("nan")]]).to(torch.bfloat16)
    residual = torch.tensor([[2**-8, 3 * 2**-8, -(2**-8), 2**-8 + 2**-14, bf16_max, -bf16_max, 1.0, 1.0]])
    residual = residual.to(torch.bfloat16)
    stream = residual.clone()
    cpu_kernels.add_rms_norm(x, stream, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    want = x + residual
    assert torch.equal(stream[:, :-1], want[:, :-1])
    assert stream[0, :4].tolist() == [1.0, 1 + 4 * 2**-8, -1.0, 1 + 2**-7]  # the ties, and just past one
    assert stream[0, -1].isnan()
    assert cpu_kernels.silu_and_mul(torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16))[0, 0].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    _same(cpu_kernels.silu_and_mul(x), F.silu(gate) * up)


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.rotary_(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(RuntimeError, match="same tokens"):
        cpu_kernels.rotary_(torch.randn(3, 2, 8), torch.randn(2, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        cpu_kernels.rotary_(torch.randn(3, 8, 2).transpose(1, 2), torch.randn(3, 1, 8), torch.randn(3, 1, 8),
                            torch.randn(3, 1, 8))


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
def test_layers_agree_on_both_paths(monkeypatch, use_kernels):
    """The layers give the torch formulas' values whichever path runs (float16 and CUDA take the torch one)."""
    if not use_kernels:
        monkeypatch.setattr(ops, "kernel_takes", lambda x: False)
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64, generator=gen).to(torch.bfloat16)
    x, residual = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16).unbind(0)
    expected_sum = x + residual
    out, stream = norm(x, residual.clone())
    assert torch.equal(stream, expected_sum)
    assert torch.equal(out, rms_norm(expected_sum, norm.weight, 1e-6))
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
    h = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(ops.silu_and_mul(h), F.silu(h[:, :64]) * h[:, 64:])
    q, k = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16), torch.randn(5, 1, 64, generator=gen).to(torch.bfloat16)
    cos, sin = RotaryEmbedding(64, 128, 10000.0)(torch.arange(5), torch.bfloat16)
    want_q, want_k = q * cos + q.roll(32, dims=-1) * sin, k * cos + k.roll(32, dims=-1) * sin
    got_q, got_k = ops.rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_zero_widths_raise_instead_of_dividing_by_zero():
    """A model with hidden_size or intermediate_size 0 gives rows of width 0: the kernels divide the
    element count by the width (an integer division by zero kills the process)."""
    with pytest.raises(RuntimeError, match="last dim of x must be >= 1"):
        cpu_kernels.rms_norm(torch.randn(3, 0), torch.randn(0), 1e-5)
    with pytest.raises(RuntimeError, match="last dim of x must be >= 1"):
        cpu_kernels.add_rms_norm(torch.randn(3, 0), torch.randn(3, 0), torch.randn(0), 1e-5)
    with pytest.raises(RuntimeError, match="last dim of x must be >= 1"):
        cpu_kernels.silu_and_mul(torch.randn(3, 0))
    with pytest.raises(RuntimeError, match="even head_dim"):
        cpu_kernels.rotary_(torch.randn(3, 2, 0), torch.randn(3, 1, 0), torch.randn(3, 1, 0), torch.randn(3, 1, 0))


def test_weights_read_by_pointer_must_be_contiguous():
    """An expanded (stride 0) weight has the right numel but one element of storage: read by pointer, the
    kernel would run past it."""
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="bad weight"):
        cpu_kernels.rms_norm(x, torch.ones(1).expand(8), 1e-5)
    with pytest.raises(RuntimeError, match="bad weight"):
        cpu_kernels.add_rms_norm(x, x.clone(), torch.ones(16)[::2], 1e-5)


def test_matmuls_refuse_sizes_their_row_blocks_cannot_cover():
    x = torch.randn(2, 32).to(torch.bfloat16)
    weight = torch.zeros(1, 32 * 16, dtype=torch.bfloat16)  # one block of 16 rows
    assert cpu_kernels.bf16_matmul(x, weight, 16).shape == (2, 16)
    for out_features in (0, -16):
        with pytest.raises(RuntimeError, match="out_features must be >= 1"):
            cpu_kernels.bf16_matmul(x, weight, out_features)
    with pytest.raises(RuntimeError, match="weight 2-d"):
        cpu_kernels.bf16_matmul(x, weight.view(-1), 16)
    codes, scales = torch.zeros(1, 4 * 64, dtype=torch.uint8), torch.zeros(1, 16, dtype=torch.float16)
    assert cpu_kernels.int4_matmul(x, codes, scales, scales.clone(), 16).shape == (2, 16)
    with pytest.raises(RuntimeError, match="out_features must be >= 1"):
        cpu_kernels.int4_matmul(x, codes, scales, scales.clone(), 0)
    with pytest.raises(RuntimeError, match="2-d"):
        cpu_kernels.int8_matmul(x, codes.view(-1), scales, 16)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_token_bitmask_forbids_exactly_the_cleared_bits(monkeypatch, use_kernel):
    """Rows 0 and 2 of 4 masked, a vocabulary that is not a multiple of 32, words all clear, all set and
    mixed: -inf exactly where a bit is 0, every other logit untouched (row 1 and 3 wholly)."""
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    vocab, gen = 100, torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    allowed = torch.rand(2, 128, generator=gen) < 0.3
    allowed[0, :32] = False  # a word of zeros
    allowed[1, 32:64] = True  # a word of ones
    bits = (allowed.view(2, 4, 32).long() << torch.arange(32)).sum(-1)  # [2, 4] words as int64
    bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    out = logits.clone()
    ops.apply_token_bitmask(out, bitmask, torch.tensor([0, 2]))
    expected = logits.clone()
    expected[0, ~allowed[0, :vocab]] = float("-inf")
    expected[2, ~allowed[1, :vocab]] = float("-inf")
    assert torch.equal(out, expected)


def test_token_bitmask_refuses_rows_outside_the_batch_and_short_masks():
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="outside the batch"):
        cpu_kernels.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="too few"):
        cpu_kernels.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8, 9, 16, 17])  # each pass size, a pass of 8 and a rest
@pytest.mark.parametrize("shape", [(96, 64), (37, 40), (5, 17), (1, 8)])  # rows in groups and a rest; lanes and a rest
def test_f32_matmul_equals_the_float64_product(tokens, shape):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(tokens * 100 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(tokens, 2 * in_features, generator=gen)[:, ::2]  # strided rows: the kernel copies them
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(cpu_kernels.f32_matmul(x, weight), expected, rtol=1e-5, atol=1e-5)


def test_f32_matmul_refuses_what_it_cannot_read():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="x has 8 inputs, the weight 16"):
        cpu_kernels.f32_matmul(x, torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.f32_matmul(x, torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.f32_matmul(x.to(torch.bfloat16), torch.randn(4, 8))
    assert cpu_kernels.f32_matmul(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)


@pytest.mark.parametrize("tokens", [1, 5, ops.F32_KERNEL_MAX_TOKENS, ops.F32_KERNEL_MAX_TOKENS + 1])
def test_float32_linear_takes_the_kernel_for_few_tokens_only(monkeypatch, tokens):
    """ops.linear: a float32 step of up to F32_KERNEL_MAX_TOKENS tokens in our kernel (bias added after),
    larger ones in F.linear; both give F.linear's values."""
    calls = []
    kernel = cpu_kernels.f32_matmul
    monkeypatch.setattr(cpu_kernels, "f32_matmul", lambda x, w: calls.append(x.shape) or kernel(x, w))
    gen = torch.Generator().manual_seed(tokens)
    weight, bias = torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(tokens, 32, generator=gen)
    out = ops.linear(x, DenseWeight(weight), bias)
    assert calls == ([(tokens, 32)] if tokens <= ops.F32_KERNEL_MAX_TOKENS else [])
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_the_build_is_named_by_its_sources_and_compiles_copies_of_them(tmp_path, monkeypatch):
    """Two checkouts with the same kernels share a build; a changed kernel gets a build of its own, and so
    does another environment's torch (its include paths are in the compile commands)."""
    checkout = tmp_path / "checkout" / "csrc"
    checkout.parent.mkdir()
    shutil.copytree(cpu_kernels._CSRC, checkout)
    assert cpu_kernels.build_name() == (same := cpu_kernels.build_name())
    monkeypatch.setattr(cpu_kernels, "_CSRC", checkout)
    assert cpu_kernels.build_name() == same  # another path, the same sources
    (checkout / "fused_ops.cpp").write_text((checkout / "fused_ops.cpp").read_text() + "\n// changed\n")
    assert (changed := cpu_kernels.build_name()) != same
    monkeypatch.setattr(cpu_kernels.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu_kernels.build_name() != changed
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    staged = cpu_kernels._staged_sources(build_dir)
    assert [p.rsplit("/", 1)[1] for p in staged] == list(cpu_kernels._SOURCES)
    assert all(p.startswith(str(build_dir / "src")) for p in staged)
    assert (build_dir / "src" / "fused_ops.cpp").read_text().endswith("// changed\n")
    assert (build_dir / "src" / "float_types.h").exists()  # the headers come along


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_argmax_is_torch_argmax(dtype):
    """Greedy's pick: random rows over a vocabulary no multiple of the 64-wide blocks, a tie (the first
    wins), a max in the last block, a NaN (torch takes it as the largest), a row of -inf, a row of one
    value repeated."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 49_155, generator=gen).to(dtype)
    logits[1, 700] = logits[1, 30_000] = 50.0
    logits[2, -1] = 50.0
    logits[3, 12_345] = float("nan")
    logits[3, 20_000] = float("inf")
    logits[4] = float("-inf")
    logits[5] = 1.5
    want = logits.argmax(dim=-1)
    assert torch.equal(cpu_kernels.row_argmax(logits), want)
    assert want[1] == 700 and want[2] == 49_154 and want[3] == 12_345 and want[4] == 0
    assert torch.equal(ops.argmax(logits), want)
    assert torch.equal(ops.argmax(logits[:, 1:]), logits[:, 1:].argmax(dim=-1))  # strided: torch's path
    with pytest.raises(RuntimeError, match="vocab >= 1"):
        cpu_kernels.row_argmax(torch.randn(2, 0))
