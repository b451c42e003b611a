"""transformers (v5) on flash_attn_cuda's kernels: attn_implementation="flash_attn_cuda".

CPU path, fp32, tiny random-init models (2 layers, hidden 64): Llama (GQA), Mistral
(MQA, sliding window) and Gemma 2 (softcap, alternating sliding / full layers), each
run with "flash_attn_cuda" and with "eager" on the same weights and inputs: logits of
padded, left-padded and packed batches, the gradients of a training step, greedy
generation with the dynamic cache, and continuous batching. Direct calls of the
attention function cover what the models do not reach (bidirectional padding, a
smaller value head dim, the paged-cache branch). Skipped when transformers >= 5 is
not importable.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers import AttentionInterface, GenerationConfig
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # not installed, or transformers 4.x
    pytest.skip(f"needs transformers >= 5 ({exc})", allow_module_level=True)

from flash_attn_cuda.integrations import transformers as fa_transformers  # noqa: E402

NAME = fa_transformers.register()
VOCAB = 96
# fp32 on both sides: the two paths differ by summation order only.
ATOL, RTOL = 2e-5, 1e-4


def _config(family, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    if family == "llama":
        common.update(num_key_value_heads=2)  # GQA 2:1
        common.update(overrides)
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if family == "mistral":
        common.update(num_key_value_heads=1, sliding_window=5)  # MQA, window of 5 tokens
        common.update(overrides)
        return transformers.MistralConfig(**common), transformers.MistralForCausalLM
    if family == "gemma2":
        common.update(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=30.0,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh",
        )
        common.update(overrides)
        return transformers.Gemma2Config(**common), transformers.Gemma2ForCausalLM
    raise ValueError(family)


def _model(family, impl="eager", **overrides):
    config, cls = _config(family, **overrides)
    torch.manual_seed(1234)
    model = cls._from_config(config, attn_implementation=impl, dtype=torch.float32)
    return model.eval()


FAMILIES = ["llama", "mistral", "gemma2"]


@pytest.fixture(scope="module")
def models():
    return {family: _model(family) for family in FAMILIES}


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def _padded_batch(side):
    lengths = [17, 11, 4]
    ids = torch.randint(2, VOCAB, (len(lengths), max(lengths)))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, -n:] = 1
        else:
            mask[b, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


# --------------------------------------------------------------------------- #
# Registration
# --------------------------------------------------------------------------- #


def test_register_names_both_interfaces():
    assert NAME == "flash_attn_cuda"
    for name in (NAME, "paged|" + NAME):
        assert AttentionInterface._global_mapping[name] is fa_transformers.attention_forward
        assert AttentionMaskInterface._global_mapping[name] is fa_transformers.attention_mask
    assert fa_transformers.register() == NAME  # idempotent
    assert fa_transformers.is_registered()


def test_model_init_does_not_pose_as_flash_attn():
    from transformers.utils import is_flash_attn_2_available

    had_flash_attn = "flash_attn" in sys.modules
    before = is_flash_attn_2_available()
    model = _model("llama", impl=NAME)
    assert model.config._attn_implementation == NAME
    assert is_flash_attn_2_available() == before
    # Nothing named flash_attn was planted (flash-attn's own package may be installed).
    assert had_flash_attn or "flash_attn" not in sys.modules
    # transformers' flash lookup serves our functions for our name.
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

    functions = lazy_import_flash_attention(NAME)[0]
    import flash_attn_cuda

    assert functions[0] is flash_attn_cuda.flash_attn_func
    assert functions[1] is flash_attn_cuda.flash_attn_varlen_func


# --------------------------------------------------------------------------- #
# Logits
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_unpadded(models, family):
    ids = torch.randint(2, VOCAB, (2, 19))
    ref = _logits(models[family], "eager", input_ids=ids)
    out = _logits(models[family], NAME, input_ids=ids)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_padded(models, family, side):
    ids, mask = _padded_batch(side)
    ref = _logits(models[family], "eager", input_ids=ids, attention_mask=mask)
    out = _logits(models[family], NAME, input_ids=ids, attention_mask=mask)
    valid = mask.bool()
    assert torch.isfinite(out[valid]).all()
    torch.testing.assert_close(out[valid], ref[valid], atol=ATOL, rtol=RTOL)


def _packed(lengths):
    ids = torch.randint(2, VOCAB, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return ids, position_ids, cu


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_packed(models, family):
    model = models[family]
    lengths = [5, 9, 7]
    ids, position_ids, cu = _packed(lengths)
    # Each sequence alone, through eager: what packing must reproduce.
    alone = torch.cat(
        [_logits(model, "eager", input_ids=part) for part in ids.split(lengths, dim=1)], dim=1
    )
    eager_packed = _logits(
        model, "eager", input_ids=ids, position_ids=position_ids, use_cache=False
    )
    torch.testing.assert_close(eager_packed, alone, atol=ATOL, rtol=RTOL)
    from_positions = _logits(model, NAME, input_ids=ids, position_ids=position_ids, use_cache=False)
    torch.testing.assert_close(from_positions, alone, atol=ATOL, rtol=RTOL)
    from_cu = _logits(
        model,
        NAME,
        input_ids=ids,
        position_ids=position_ids,
        use_cache=False,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
    )
    torch.testing.assert_close(from_cu, alone, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #


def _grads(model, impl, **inputs):
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    model.eval()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_padded(models, family):
    # Right padding, as in training: no loss term reads the output of a padded row.
    ids, mask = _padded_batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    loss_ref, ref = _grads(
        models[family], "eager", input_ids=ids, attention_mask=mask, labels=labels
    )
    loss, ours = _grads(models[family], NAME, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    assert ours.keys() == ref.keys() and ref
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], atol=ATOL, rtol=RTOL, msg=name)


def test_training_step_gradients_packed(models):
    model = models["llama"]
    ids, position_ids, _ = _packed([6, 10, 3])
    inputs = dict(input_ids=ids, position_ids=position_ids, labels=ids, use_cache=False)
    loss_ref, ref = _grads(model, "eager", **inputs)
    loss, ours = _grads(model, NAME, **inputs)
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], atol=ATOL, rtol=RTOL, msg=name)


def test_dropout_in_training_only():
    model = _model("llama", impl=NAME, attention_dropout=0.5)
    ids = torch.randint(2, VOCAB, (2, 16))

    def train_loss(seed):
        model.train()
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    first, again, other = train_loss(7), train_loss(7), train_loss(8)
    assert torch.isfinite(first)
    assert torch.equal(first, again)  # the dropout mask follows torch's seed
    assert not torch.equal(first, other)
    # Eval mode: no dropout, same as eager.
    model.eval()
    out = _logits(model, NAME, input_ids=ids)
    ref = _logits(model, "eager", input_ids=ids)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    model.train()
    torch.manual_seed(7)
    with torch.no_grad():
        dropped = model(input_ids=ids).logits
    assert not torch.allclose(dropped, ref, atol=1e-3)


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #


def _generate(model, impl, ids, mask, new_tokens, **kwargs):
    model.set_attn_implementation(impl)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, **kwargs
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_left_padded(models, family):
    ids, mask = _padded_batch("left")
    ref = _generate(models[family], "eager", ids, mask, 8)
    out = _generate(models[family], NAME, ids, mask, 8)
    assert out.shape == ref.shape == (ids.shape[0], ids.shape[1] + 8)
    assert torch.equal(out, ref)


def test_greedy_generation_unpadded(models):
    # Past the sliding window (5) of Mistral: the cache keeps only the window.
    ids = torch.randint(2, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    ref = _generate(models["mistral"], "eager", ids, mask, 10)
    out = _generate(models["mistral"], NAME, ids, mask, 10)
    assert torch.equal(out, ref)


def test_continuous_batching(models):
    """transformers' paged cache (continuous batching): packed varlen prefill and decode."""
    import inspect

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        pytest.skip("this transformers has no ContinuousBatchingConfig")
    model = models["llama"]
    if "continuous_batching_config" not in inspect.signature(model.generate_batch).parameters:
        pytest.skip("this transformers' generate_batch takes no continuous_batching_config")
    prompts = [torch.randint(2, VOCAB, (n,)) for n in (5, 9, 3)]
    expected = [
        _generate(model, "eager", p[None], torch.ones(1, len(p), dtype=torch.long), 6)[0, len(p) :]
        for p in prompts
    ]
    model.set_attn_implementation(NAME)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    # The page size's keyword was block_size before page_size (transformers 5.17 has
    # only block_size); pass whichever this version takes.
    params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    page_kw = "page_size" if "page_size" in params else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{page_kw: 16}, num_blocks=16, max_batch_tokens=64, max_memory_percent=0.01
    )
    try:
        out = model.generate_batch(
            inputs=[p.tolist() for p in prompts],
            generation_config=config,
            continuous_batching_config=cb_config,
        )
    except ValueError as exc:
        # Older transformers (5.17 among them) set the CUDA device from the model's
        # device in the generation thread whenever CUDA is present, which raises for
        # this CPU model; later versions check the device type first.
        if torch.cuda.is_available() and "cuda" in str(exc).lower():
            pytest.skip(f"this transformers' continuous batching needs a CUDA model here: {exc}")
        raise
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert got == [e.tolist() for e in expected]


# --------------------------------------------------------------------------- #
# The attention function alone
# --------------------------------------------------------------------------- #


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _reference(q, k, v, allowed, scale, softcap=None):
    """q (B, H, Sq, D), k / v (B, Hk, Sk, Dv), allowed (B, Sq, Sk) bool -> (B, Sq, H, Dv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, v)


def _qkv(b=3, h=4, hk=2, sq=9, sk=9, d=32, dv=None):
    q = torch.randn(b, h, sq, d)
    k = torch.randn(b, hk, sk, d)
    v = torch.randn(b, hk, sk, dv or d)
    return q, k, v


def test_bidirectional_padding_every_query_row():
    q, k, v = _qkv()
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[2, :3] = False
    out, weights = fa_transformers.attention_forward(
        _Module(is_causal=False), q, k, v, mask, scaling=0.2, softcap=3.0
    )
    assert weights is None
    allowed = mask[:, None, :].expand(3, 9, 9)
    torch.testing.assert_close(
        out.double(), _reference(q, k, v, allowed, 0.2, 3.0), atol=1e-5, rtol=1e-5
    )


def test_sliding_window_both_directions():
    q, k, v = _qkv(sq=12, sk=12)
    i = torch.arange(12)
    dist = i[:, None] - i[None, :]
    for causal, allowed in ((True, (dist >= 0) & (dist < 4)), (False, dist.abs() <= 4)):
        out, _ = fa_transformers.attention_forward(
            _Module(is_causal=causal), q, k, v, None, scaling=0.3, sliding_window=4
        )
        torch.testing.assert_close(
            out.double(), _reference(q, k, v, allowed.expand(3, 12, 12), 0.3), atol=1e-5, rtol=1e-5
        )


def test_smaller_value_head_dim():
    q, k, v = _qkv(d=24, dv=16)
    out, _ = fa_transformers.attention_forward(_Module(), q, k, v, None, scaling=0.25)
    assert out.shape == (3, 9, 4, 16)
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    torch.testing.assert_close(
        out.double(), _reference(q, k, v, causal, 0.25), atol=1e-5, rtol=1e-5
    )


def test_chunk_of_queries_against_left_padded_cache():
    # 3 new queries against 10 cached + new keys, left padding: the queries are the
    # last 3 positions of each sequence, aligned bottom-right.
    q, k, v = _qkv(sq=3, sk=10)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :4] = False
    out, _ = fa_transformers.attention_forward(_Module(), q, k, v, mask, scaling=0.2)
    qi = torch.arange(7, 10)[:, None]
    allowed = (torch.arange(10)[None, :] <= qi)[None] & mask[:, None, :]
    torch.testing.assert_close(
        out.double(), _reference(q, k, v, allowed, 0.2), atol=1e-5, rtol=1e-5
    )


def test_paged_cache_branch_appends_and_attends():
    # Decode step of 3 sequences on a paged cache (pages of 4 rows), as transformers'
    # continuous batching passes it: block_table, k_cache / v_cache, cu_seq_lens_k
    # counting the new token.
    hk, h, d, page = 2, 4, 32, 4
    lens_before = [5, 1, 7]
    k_cache = torch.randn(10, page, hk, d)
    v_cache = torch.randn(10, page, hk, d)
    block_table = torch.tensor([[3, 7], [0, 9], [5, 2]], dtype=torch.int32)
    q = torch.randn(1, h, 3, d)  # (1, heads, total_q, d): one token per sequence
    k_new = torch.randn(1, hk, 3, d)
    v_new = torch.randn(1, hk, 3, d)
    cu_k = F.pad(torch.tensor(lens_before).add(1).cumsum(0), (1, 0)).to(torch.int32)

    def gather(cache, b, n):
        rows = [cache[block_table[b, p // page], p % page] for p in range(n)]
        return torch.stack(rows)  # (n, hk, d)

    expected = []
    for b, n in enumerate(lens_before):
        kb = torch.cat([gather(k_cache, b, n), k_new[0, :, b][None]])
        vb = torch.cat([gather(v_cache, b, n), v_new[0, :, b][None]])
        allowed = torch.ones(1, 1, n + 1, dtype=torch.bool)
        expected.append(
            _reference(
                q[:, :, b : b + 1], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], allowed, 0.2
            )
        )
    out, _ = fa_transformers.attention_forward(
        _Module(),
        q,
        k_new,
        v_new,
        None,
        scaling=0.2,
        block_table=block_table,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seq_lens_q=torch.arange(4, dtype=torch.int32),
        cu_seq_lens_k=cu_k,
        max_length_q=1,
        max_length_k=8,
    )
    assert out.shape == (1, 3, h, d)
    torch.testing.assert_close(out.double(), torch.cat(expected, dim=1), atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lens_before):  # the new keys were written into the pages
        torch.testing.assert_close(k_cache[block_table[b, n // page], n % page], k_new[0, :, b])


def test_attention_sinks_s_aux():
    """gpt-oss's sinks: one logit per query head beside the scaled scores, no value."""
    q, k, v = _qkv()
    sinks = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :2] = False  # left padding: the varlen path
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    for padding in (None, mask):
        out, _ = fa_transformers.attention_forward(
            _Module(), q, k, v, padding, scaling=0.3, s_aux=sinks
        )
        allowed = causal if padding is None else causal & padding[:, None, :]
        rep = q.shape[1] // k.shape[1]
        kk, vv = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
        s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * 0.3
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        sink = sinks.detach().double().view(1, -1, 1, 1).expand(3, 4, 9, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        expected = torch.einsum("bhqk,bhkd->bqhd", p, vv)
        rows = slice(None) if padding is None else slice(2, None)
        torch.testing.assert_close(out.double()[1, rows], expected[1, rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double()[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
    # The gradient reaches the model's parameter in its own dtype.
    out, _ = fa_transformers.attention_forward(_Module(), q, k, v, None, scaling=0.3, s_aux=sinks)
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16


def test_gpt_oss_sinks_logits_and_gradients():
    """gpt-oss end to end: its sinks reach the kernels as learnable_sink. The
    model admits only the flash implementations it lists under names that
    contain "flash", so this registers a name without it."""
    name = fa_transformers.register("fa_cuda_sinks")
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = transformers.GptOssForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)  # zeros at init would hide a wrong formula
    ids, mask = _padded_batch("left")
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
        ref = _logits(model, "eager", **inputs)
        out = _logits(model, name, **inputs)
        valid = inputs.get("attention_mask", torch.ones_like(ids)).bool()
        torch.testing.assert_close(out[valid], ref[valid], atol=ATOL, rtol=RTOL)
    ids = torch.randint(2, VOCAB, (2, 13))
    loss_ref, ref = _grads(model, "eager", input_ids=ids, labels=ids)
    loss, got = _grads(model, name, input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    sinks = [n for n in ref if n.endswith("sinks")]
    assert sinks and all(ref[n].abs().max() > 0 for n in sinks)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-3, msg=n)


def test_unservable_calls_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="s_aux"):
        fa_transformers.attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="2-D"):
        fa_transformers.attention_forward(
            _Module(), q, k, v, torch.ones(3, 1, 9, 9, dtype=torch.bool)
        )


def test_mask_function():
    mask = torch.ones(2, 6, dtype=torch.long)
    assert fa_transformers.attention_mask(2, 6, 6, attention_mask=mask.bool()) is None
    mask[0, 0] = 0
    # Sliced to the last kv_length keys (a sliding-window layer): no padding left there.
    assert fa_transformers.attention_mask(2, 1, 4, attention_mask=mask.bool()) is None
    mask[1, -2] = 0
    got = fa_transformers.attention_mask(2, 1, 4, attention_mask=mask.bool())
    assert got.shape == (2, 4) and got[0].all() and not got[1, -2]
    mask[1, -2] = 1
    got = fa_transformers.attention_mask(2, 6, 6, attention_mask=mask.bool())
    assert got.dtype == torch.bool and not got[0, 0]
    # Shorter than kv_length (a static cache): kept, so that the rest is ignored.
    short = torch.ones(2, 5, dtype=torch.bool)
    assert fa_transformers.attention_mask(2, 5, 8, attention_mask=short).shape == (2, 5)


# --------------------------------------------------------------------------- #
# The end-to-end benchmark's CPU smoke run
# --------------------------------------------------------------------------- #


def test_benchmark_e2e_quick_cpu(tmp_path):
    import json
    import os
    import subprocess

    from conftest import PACKAGE_PARENT

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "benchmark_e2e.py"),
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["command"] and meta["commit"] and meta["device"]
    measured = {(r["regime"], r["variant"]) for r in rows if "ms" in r}
    for variant in ("sdpa_default", NAME):
        assert ("train_fwd_bwd", variant) in measured and ("generate", variant) in measured
    # On the CPU the SDPA provider (CUDA only) is reported as skipped, with its reason.
    assert any(r["variant"] == "sdpa_provider" and r.get("skipped") for r in rows)
    # The decode loop of flash_attn_with_kvcache runs on the CPU too; its CUDA graph
    # and SDPA's FLASH backend are reported as skipped.
    assert ("decode_loop", "kvcache_eager") in measured
    skipped = {r["variant"] for r in rows if r.get("regime") == "decode_loop" and r.get("skipped")}
    assert {"kvcache_graph", "sdpa_flash"} <= skipped
    for r in rows:
        if r.get("regime") == "train_fwd_bwd" and "ms" in r:
            assert r["max_logit_diff_vs_first"] < 1e-4
        if r.get("regime") == "generate" and "ms" in r:
            assert r["same_tokens_as_first"] == 1.0
        if r.get("regime") == "decode_loop" and "ms" in r:
            # The host's issue time of the first steps, per call: on the CPU the
            # calls run as they are issued, so it cannot be far below the loop's.
            assert 0 < r["host_us_per_call"] < 10 * r["us_per_call"]
