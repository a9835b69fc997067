"""Packed oneDNN linear kernels for the target's passes, cheaper drafter weights (hf_specdec.cpu_kernels)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import make_oracle, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, Eagle3Config, cpu_kernels, pack_draft_weights, pack_linear_weights
from hf_specdec.cpu_kernels import _packed_is_faster as timed_packed_is_faster
from hf_specdec.cpu_kernels import draft_kernels_for, linear_kernels_for

needs_bf16 = pytest.mark.skipif(
    not cpu_kernels.bf16_linears_supported(), reason="this CPU has no oneDNN bf16 kernels (AVX-512 or AMX needed)"
)


def _batch(rows, length, seed):
    ids, mask = ragged_batch(rows, length=length, seed=seed)
    return {"input_ids": ids, "attention_mask": mask}


def _plain_linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the rows of every call that reaches the packed oneDNN kernel."""
    calls, real = [], torch.ops.mkldnn._linear_pointwise

    def counting(x, packed, bias, attr, scalars, algorithm):
        calls.append(x.numel() // x.shape[-1])
        return real(x, packed, bias, attr, scalars, algorithm)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    return calls


def test_packed_layers_compute_what_linear_computes(packed_calls):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    with pack_linear_weights(layer, max_rows=16) as packed:
        assert len(packed) == 1
        with torch.no_grad():
            for shape in [(1, 48), (1, 1, 48), (2, 48), (3, 5, 48), (1, 16, 48), (17, 48), (2, 30, 48)]:
                x = torch.randn(*shape)
                expected = F.linear(x, layer.weight, layer.bias)
                before = len(packed_calls)
                out = layer(x)
                rows = x.numel() // 48
                assert out.shape == expected.shape
                if rows <= 16:
                    assert packed_calls[before:] == [max(rows, 3)]  # 1-2 rows run the 3-row kernel, padded
                    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
                else:  # more than max_rows (a prompt's prefill): the stock kernel, bit for bit
                    assert len(packed_calls) == before and torch.equal(out, expected)
    assert "forward" not in layer.__dict__ and not hasattr(layer, "_hf_specdec_packed")


def test_greedy_speculative_decoding_on_a_packed_target_is_plain_decoding(packed_calls):
    target = make_target(seed=3)
    prompt = _batch(1, length=12, seed=3)
    stock = target.generate(**prompt, max_new_tokens=20, do_sample=False)
    packed = pack_linear_weights(target)
    assert len(packed) == len(_plain_linears(target)) == 4 * 7 + 1
    packed_calls.clear()
    plain = target.generate(**prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(plain, stock)  # a tiny model without near-ties: the kernels' last bits change no argmax
    assert 3 in packed_calls, "plain decoding's one-token steps should run the packed kernel too (padded to 3 rows)"
    oracle = make_oracle(target, plain[:, 12:], corruption=0.3, seed=1)
    spec = target.generate(**prompt, max_new_tokens=20, do_sample=False, assistant_model=oracle)
    assert torch.equal(spec, plain)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    batch = _batch(2, length=9, seed=4)
    plain2 = target.generate(**batch, max_new_tokens=16, do_sample=False)
    packed_calls.clear()
    spec2 = target.generate(**batch, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    assert torch.equal(spec2, plain2)
    assert any(rows > 3 for rows in packed_calls), "the verification passes never reached the packed kernel"
    packed.restore()


def test_a_weight_changed_after_packing_is_never_read_stale(packed_calls):
    target = make_target(seed=2)
    x = torch.randint(6, 90, (1, 6))
    with pack_linear_weights(target):
        with torch.no_grad():
            target.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # in place: the tensor's version moves
            target.model.layers[1].self_attn.q_proj.weight = torch.nn.Parameter(
                torch.randn_like(target.model.layers[1].self_attn.q_proj.weight)
            )
            target.model.layers[2].self_attn.k_proj.weight.data = torch.randn_like(  # no version bump
                target.model.layers[2].self_attn.k_proj.weight
            )
            logits = target(x).logits
    assert "forward" not in target.model.layers[0].mlp.down_proj.__dict__
    with torch.no_grad():
        torch.testing.assert_close(logits, target(x).logits, rtol=1e-5, atol=1e-5)
    assert packed_calls, "the unchanged layers should still use the packed kernel"


def test_training_through_a_packed_target_gets_the_stock_gradients():
    target, reference = make_target(seed=5), make_target(seed=5)
    x = torch.randint(6, 90, (2, 7))
    with pack_linear_weights(target):
        target(x, labels=x).loss.backward()
    reference(x, labels=x).loss.backward()
    for (name, p), q in zip(target.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_only_plain_fp32_cpu_linears_are_packed():
    class Custom(torch.nn.Linear):
        pass

    hooked = torch.nn.Linear(8, 8)
    hooked._hf_hook = object()  # accelerate owns its forward
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16), Custom(8, 8), hooked, torch.nn.Linear(8, 4)
    )
    handle = pack_linear_weights(model)
    assert handle.modules == [model[0], model[4]]
    handle.restore()
    assert len(handle) == 0 and all("forward" not in m.__dict__ for m in model)


def test_bad_options_and_builds_without_the_kernel(monkeypatch):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="max_rows must be at least 1"):
        pack_linear_weights(model, max_rows=0)
    with pytest.raises(ValueError, match="packed, stock"):
        linear_kernels_for(model, "fast")
    assert len(linear_kernels_for(model, "stock")) == 0
    with linear_kernels_for(model, "packed") as handle:
        assert len(handle) == 1
    monkeypatch.setattr(cpu_kernels, "packed_linears_supported", lambda: False)
    with pytest.raises(RuntimeError, match="no oneDNN packed linear kernels"):
        pack_linear_weights(model)
    assert len(linear_kernels_for(model, "packed")) == 0


@pytest.mark.parametrize(
    "pack, kernel, error",
    [
        (pack_linear_weights, (torch.ops.mkldnn, "_linear_pointwise"), 1e-2),
        pytest.param(pack_draft_weights, (torch.ops.mkldnn, "_linear_pointwise"), 0.2, marks=needs_bf16),
        pytest.param(
            functools.partial(pack_draft_weights, weights="int8"), (torch, "_weight_int8pack_mm"), 0.2, marks=needs_bf16
        ),  # fmt: skip
    ],
)
def test_a_kernel_that_disagrees_with_linear_is_refused(monkeypatch, pack, kernel, error):
    model = make_target(seed=1)
    real = getattr(*kernel)
    monkeypatch.setattr(*kernel, lambda *args: real(*args) + error)
    with pytest.raises(RuntimeError, match="disagrees with F.linear"):
        pack(model)
    assert all("forward" not in m.__dict__ for m in _plain_linears(model))


@needs_bf16
def test_draft_layers_compute_in_bf16_over_any_rows(packed_calls):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    with pack_draft_weights(layer) as packed, torch.no_grad():
        assert len(packed) == 1
        for shape in [(1, 48), (2, 48), (3, 5, 48), (300, 48)]:
            x = torch.randn(*shape)
            before = len(packed_calls)
            out = layer(x)
            assert packed_calls[before:] == [x.numel() // 48]  # one row unpadded, a long prompt's rows too
            assert out.dtype == torch.float32 and out.shape == (*shape[:-1], 80)
            bf16 = [t.to(torch.bfloat16).float() for t in (x, layer.weight, layer.bias)]
            torch.testing.assert_close(out, F.linear(*bf16), rtol=1e-2, atol=1e-2)
            assert not torch.equal(out, F.linear(x, layer.weight, layer.bias))  # bf16 weights, not the fp32 ones
        before = len(packed_calls)
        layer.weight.mul_(2.0)  # changed after packing: the stock layer, never the stale copy
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(packed_calls) == before
    assert "forward" not in layer.__dict__


@pytest.fixture
def int8_calls(monkeypatch):
    """Counts the rows of every call that reaches the weight-only int8 kernel."""
    calls, real = [], torch._weight_int8pack_mm

    def counting(x, weight, scales):
        calls.append(x.shape[0])
        return real(x, weight, scales)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counting)
    return calls


@needs_bf16
def test_int8_draft_layers_read_int8_weights_over_one_or_two_rows(packed_calls, int8_calls):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    with pack_draft_weights(layer, weights="int8") as packed, torch.no_grad():
        assert len(packed) == 1
        for shape in [(1, 48), (1, 2, 48), (3, 48), (3, 5, 48), (300, 48)]:
            x = torch.randn(*shape)
            before = (len(int8_calls), len(packed_calls))
            out = layer(x)
            rows = x.numel() // 48  # one or two rows (draft steps): the int8 kernel; more: the bf16 one
            assert (len(int8_calls) - before[0], len(packed_calls) - before[1]) == ((1, 0) if rows <= 2 else (0, 1))
            expected = F.linear(x, layer.weight, layer.bias)
            assert out.dtype == torch.float32 and out.shape == expected.shape
            error = float((out - expected).abs().max() / expected.abs().max())
            assert 0 < error < 0.02  # int8 or bf16 weights, bf16 inputs, the bias added: close to the fp32 layer
        before = len(int8_calls)
        layer.weight.mul_(2.0)  # changed after packing: the stock layer, never the stale copy
        x = torch.randn(1, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(int8_calls) == before
    assert "forward" not in layer.__dict__


@needs_bf16
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_a_cheaper_drafter_leaves_greedy_output_identical_and_the_target_alone(packed_calls, int8_calls, weights):
    target = make_target(seed=3)
    batch = _batch(2, length=9, seed=4)
    plain = target.generate(**batch, max_new_tokens=16, do_sample=False)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    drafter.lm_head.weight = target.lm_head.weight  # shared with the target: never packed
    with draft_kernels_for([drafter, None, drafter, target], weights, [target]) as packed:
        assert len(packed) == len(_plain_linears(drafter)) - 1
        assert "forward" not in drafter.lm_head.__dict__
        assert all("forward" not in m.__dict__ for m in target.modules())
        calls = packed_calls if weights == "bf16" else int8_calls
        calls.clear()
        spec = target.generate(**batch, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                               draft_length="fixed")  # fmt: skip
        assert calls, f"the drafter's layers never reached the {weights} kernel"
    assert torch.equal(spec, plain)
    assert all("forward" not in m.__dict__ for m in drafter.modules())


def test_draft_kernel_options_and_cpus_without_them(monkeypatch):
    target, drafter = make_target(seed=1), torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="bf16, int8, stock"):
        draft_kernels_for([drafter], "fp16", [target])
    with pytest.raises(ValueError, match="bf16, int8"):
        pack_draft_weights(drafter, weights="int4")
    assert len(draft_kernels_for([drafter], "stock", [target])) == 0
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_kernels.bf16_linears_supported()
    with pytest.raises(RuntimeError, match="no bf16 linear kernels"):
        pack_draft_weights(drafter)
    assert len(draft_kernels_for([drafter], "bf16", [target])) == 0 and "forward" not in drafter.__dict__
    monkeypatch.setattr(cpu_kernels, "int8_linears_supported", lambda: False)
    with pytest.raises(RuntimeError, match="no int8 linear kernels"):
        pack_draft_weights(drafter, weights="int8")
    assert len(draft_kernels_for([drafter], "int8", [target])) == 0 and "forward" not in drafter.__dict__


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records, for every SDPA call of the target, whether it had a mask and whether it used the grouped kernel."""
    calls, real = [], F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, enable_gqa=False, **kwargs):
        calls.append((attn_mask is not None, bool(enable_gqa), key.shape[1] < query.shape[1]))
        return real(query, key, value, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    monkeypatch.delenv(cpu_kernels.GQA_SWITCH, raising=False)
    return calls


def test_speculative_passes_attend_with_the_grouped_kernel_and_leave_the_switch_as_it_was(sdpa_calls):
    target = make_target(seed=5)
    assert target.config._attn_implementation == "sdpa"
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    batch = _batch(2, length=9, seed=5)
    plain = target.generate(**batch, max_new_tokens=12, do_sample=False)
    assert any(masked and not grouped for masked, grouped, _ in sdpa_calls), "plain decoding should copy K/V here"
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    sdpa_calls.clear()
    spec = target.generate(**batch, max_new_tokens=12, do_sample=False, assistant_model=drafter, draft_length="fixed")
    assert torch.equal(spec, plain)
    masked = [grouped for has_mask, grouped, _ in sdpa_calls if has_mask]
    assert masked and all(masked), "a masked pass (target or drafter) copied K/V to every head"
    assert all(fewer_kv_heads for _, grouped, fewer_kv_heads in sdpa_calls if grouped)
    assert cpu_kernels.GQA_SWITCH not in __import__("os").environ


def test_the_grouped_query_switch_counts_its_users_and_keeps_a_users_value(monkeypatch):
    import os

    target = make_target(seed=6)
    monkeypatch.delenv(cpu_kernels.GQA_SWITCH, raising=False)
    with cpu_kernels.grouped_query_sdpa(target) as applied:
        assert applied and os.environ[cpu_kernels.GQA_SWITCH] == "1"
        with cpu_kernels.grouped_query_sdpa(target):
            pass
        assert os.environ[cpu_kernels.GQA_SWITCH] == "1"  # the outer caller is still inside
    assert cpu_kernels.GQA_SWITCH not in os.environ
    monkeypatch.setenv(cpu_kernels.GQA_SWITCH, "0")  # a user's choice stays
    with cpu_kernels.grouped_query_sdpa(target):
        assert os.environ[cpu_kernels.GQA_SWITCH] == "0"
    assert os.environ[cpu_kernels.GQA_SWITCH] == "0"
    monkeypatch.delenv(cpu_kernels.GQA_SWITCH)
    target.config._attn_implementation = "eager"  # eager attention has no such switch: nothing to change
    with cpu_kernels.grouped_query_sdpa(target) as applied:
        assert not applied and cpu_kernels.GQA_SWITCH not in os.environ
    target.config._attn_implementation = "sdpa"
    target.config.num_key_value_heads = target.config.num_attention_heads  # no grouped heads: nothing to copy
    assert not cpu_kernels.grouped_query_sdpa_applies(target)


def _stock_faster_below(monkeypatch, rows: int) -> list:
    """Timings (replacing the conftest's) that find the packed kernel faster from ``rows`` rows on; returns the
    row counts measured."""
    measured = []

    def faster(state, bias, probe, repeats):
        measured.append(probe)
        return probe >= rows

    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    monkeypatch.setattr(cpu_kernels, "_packed_is_faster", faster)
    return measured


def test_a_measured_plan_packs_only_the_row_counts_where_the_packed_kernel_was_faster(packed_calls, monkeypatch):
    """On an Intel Xeon VM without native bf16 the packed fp32 kernel took 1.1-6.9 times the stock one over a row, and
    a target packed for every call decoded plainly at 0.66 of the stock speed: a call goes to the packed kernel only
    at the row counts where it was measured faster, the others to F.linear, bit for bit."""
    measured = _stock_faster_below(monkeypatch, 4)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(48, 80), torch.nn.Linear(48, 80)]
    with pack_linear_weights(torch.nn.Sequential(*layers), max_rows=16) as packed, torch.no_grad():
        assert measured == [1, 2, 3, 4, 6, 8, 16]  # once for both layers of this shape, up to max_rows
        assert len(packed) == 2 and packed.row_plans() == {"80x48": "4-16"}
        for rows in (1, 2, 3, 4, 5, 16, 17):
            x = torch.randn(rows, 48)
            before = len(packed_calls)
            out = layers[0](x)
            if 4 <= rows <= 16:
                assert packed_calls[before:] == [rows]
                torch.testing.assert_close(out, F.linear(x, layers[0].weight, layers[0].bias))
            else:
                assert len(packed_calls) == before and torch.equal(out, F.linear(x, layers[0].weight, layers[0].bias))
    with pytest.raises(ValueError, match="rows must be one of measured, all"):
        pack_linear_weights(layers[0], rows="some")


def test_a_layer_whose_packed_kernel_is_never_faster_keeps_its_stock_forward(monkeypatch):
    _stock_faster_below(monkeypatch, 10**9)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with pack_linear_weights(model) as packed:
        assert len(packed) == 0 and packed.row_plans() == {}
        assert all("forward" not in m.__dict__ and not hasattr(m, "_hf_specdec_packed") for m in model)
    with pack_linear_weights(model, rows="all") as packed:  # asked for every call: packed all the same
        assert len(packed) == 2 and packed.row_plans() == {"8x8": "1-64", "4x8": "1-64"}


@needs_bf16
def test_int8_draft_weights_serve_the_rows_they_were_measured_faster_at(packed_calls, int8_calls, monkeypatch):
    """Measured on a CPU without native bf16: the int8 kernel faster over one row (on the wide layers), the bf16 one
    slower than the stock fp32 layer over more (3.7-4.5 times over a prompt's rows there): one-row draft steps read
    int8 weights, every other call is the fp32 layer's own."""
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    monkeypatch.setattr(cpu_kernels, "_packed_is_faster", lambda state, bias, rows, repeats: rows == 1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    with pack_draft_weights(layer, weights="int8") as packed, torch.no_grad():
        assert packed.row_plans() == {"80x48": "1"}
        for rows in (1, 2, 7, 300):
            x = torch.randn(rows, 48)
            before = (len(int8_calls), len(packed_calls))
            out = layer(x)
            assert (len(int8_calls) - before[0], len(packed_calls) - before[1]) == ((1, 0) if rows == 1 else (0, 0))
            if rows > 1:
                assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_the_timing_behind_a_plan_compares_the_two_kernels_on_this_machine(monkeypatch):
    import time

    layer = torch.nn.Linear(16, 16)
    with pack_linear_weights(layer, rows="all"):
        state = layer._hf_specdec_packed
        real_compute = state.compute
        monkeypatch.setattr(state, "compute", lambda x, bias: time.sleep(0.002) or real_compute(x, bias))
        assert not timed_packed_is_faster(state, layer.bias, 4, repeats=2)  # the packed call is the slow one
        monkeypatch.setattr(state, "compute", real_compute)
        stock = F.linear
        monkeypatch.setattr(F, "linear", lambda *args: time.sleep(0.002) or stock(*args))
        assert timed_packed_is_faster(state, layer.bias, 4, repeats=2)  # now the stock one is
