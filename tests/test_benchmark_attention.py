"""benchmarks/benchmark_attention.py without a GPU: the training grid's GQA cells, its
head-dim pairs (d_qk, d_v) and the FlashAttention-4 anchor.

FA4 (flash_attn.cute) is never installed here, so its import failure is real, and the
provider's path is walked with a stand-in module (SDPA behind FA4's signature) on the
CPU stand-in grid.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    """A fresh copy of the script per test: its import caches start empty."""
    name = "benchmark_attention_under_test"
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "benchmarks" / "benchmark_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up by name while the script runs.
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


class FakeFA4:
    """flash_attn.cute.flash_attn_func's signature over SDPA; scale makes it wrong."""

    def __init__(self, scale=1.0):
        self.scale = scale
        self.calls = []

    def __call__(self, q, k, v, causal=False, softmax_scale=None, deterministic=False):
        self.calls.append(
            dict(causal=causal, deterministic=deterministic, nheads_k=k.shape[2], dv=v.shape[-1])
        )
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=causal,
            scale=softmax_scale,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return out * self.scale, lse


def _shapes(bench, grid):
    run = bench.Run.__new__(bench.Run)
    run.grid = grid
    return list(run.train_shapes())


def test_full_gpu_grid_has_gqa_4_to_1_at_d128_only(bench):
    shapes = _shapes(bench, bench.gpu_grid(quick=False))
    gqa = [s for s in shapes if s.nheads != s.nheads_k]
    mha = [s for s in shapes if s.nheads == s.nheads_k and s.headdim_v is None]
    pairs = [s for s in shapes if s.headdim_v is not None]
    # 2 dtypes x 3 head dims x 2 causal x 6 seqlens, plus d128's 2 x 2 x 6 GQA cells,
    # plus the (192, 128) pair's 2 x 2 x 6 cells.
    assert len(mha) == 72 and len(gqa) == 24 and len(pairs) == 24
    assert {(s.headdim, s.nheads, s.nheads_k) for s in gqa} == {(128, 16, 4)}
    # Issue 56's cell: q and k of head dim 192, v of 128, 2048 // 128 = 16 heads, no GQA.
    assert {(s.headdim, s.headdim_v, s.nheads, s.nheads_k) for s in pairs} == {(192, 128, 16, 16)}
    assert {s.seqlen_q for s in gqa} == set(bench.pow2_range(512, 16384))
    assert all(s.batch * s.seqlen_q == 16384 for s in shapes)


def test_quick_gpu_grid_has_one_gqa_seqlen(bench):
    gqa = [s for s in _shapes(bench, bench.gpu_grid(quick=True)) if s.nheads != s.nheads_k]
    assert {(s.headdim, s.nheads_k, s.seqlen_q) for s in gqa} == {(128, 4, 8192)}
    assert {s.causal for s in gqa} == {False, True}


def test_headdim_pairs_in_the_grids(bench):
    assert bench.gpu_grid(quick=True).headdim_pairs == [(192, 128)]
    assert bench.gpu_grid(quick=False).headdim_pairs == [(192, 128)]
    assert bench.cpu_grid(quick=False).headdim_pairs == []
    # A machine without a GPU walks the d_v < d_qk path too.
    assert all(dv < d for d, dv in bench.cpu_grid(quick=True).headdim_pairs)
    assert all(dv < d for d, dv in bench.standin_grid().headdim_pairs)
    pairs = [s for s in _shapes(bench, bench.gpu_grid(quick=True)) if s.headdim_v is not None]
    assert {(s.seqlen_q, s.batch, s.causal) for s in pairs} == {
        (s, 16384 // s, c) for s in (2048, 8192) for c in (False, True)
    }


def test_headdim_pairs_option(bench):
    def grid_of(*argv):
        return bench.select(bench.build_parser().parse_args(["--cpu-standin", *argv]))[1]

    assert grid_of("--headdim-pairs", "192x128,576x512").headdim_pairs == [(192, 128), (576, 512)]
    assert grid_of("--headdim-pairs", "").headdim_pairs == []
    assert grid_of().headdim_pairs == bench.standin_grid().headdim_pairs
    for bad in ("192", "192x128x1", "128x192", "0x0", "ax128"):
        with pytest.raises(SystemExit):
            grid_of("--headdim-pairs", bad)


def test_attention_flops_with_headdim_v(bench):
    b, h, s = 2, 16, 1024
    fwd = bench.attention_flops(b, h, s, s, 192, False, "fwd", 128)
    assert fwd == 2.0 * b * h * s * s * (192 + 128)
    assert bench.attention_flops(b, h, s, s, 192, True, "fwd", 128) == fwd / 2
    assert bench.attention_flops(b, h, s, s, 192, False, "bwd", 128) == 2.5 * fwd
    assert bench.attention_flops(b, h, s, s, 192, False, "fwd_bwd", 128) == 3.5 * fwd
    # Without d_v (or with d_v = d), the usual 4 * d.
    assert bench.attention_flops(b, h, s, s, 128, False, "fwd") == 4.0 * b * h * s * s * 128
    assert bench.attention_flops(b, h, s, s, 128, False, "fwd", 128) == 4.0 * b * h * s * s * 128


def test_gqa_ratios_option_replaces_the_default_cells(bench):
    args = bench.build_parser().parse_args(
        ["--cpu-standin", "--headdims", "32", "--gqa-ratios", "2", "--seqlens", "64"]
    )
    _, grid, _ = bench.select(args)
    shapes = _shapes(bench, grid)
    pairs = [s for s in shapes if s.headdim_v is not None]
    shapes = [s for s in shapes if s.headdim_v is None]
    assert shapes and all(s.nheads_k == s.nheads // 2 for s in shapes)
    # Head-dim pairs are MHA whatever the ratios.
    assert pairs and all(s.nheads_k == s.nheads for s in pairs)
    with pytest.raises(SystemExit):
        bench.select(bench.build_parser().parse_args(["--cpu-standin", "--gqa-ratios", "0"]))


def test_fa4_that_does_not_import_is_no_default_and_says_why(bench):
    fn, reason = bench.load_fa4()
    if fn is not None:
        pytest.skip("flash_attn.cute imports here")
    assert "flash_attn.cute" in reason
    assert bench.FA4 not in bench.gpu_default_providers()
    shape = bench.Shape("fp32", 1, 16, 16, 2, 2, 32, False)
    with pytest.raises(bench.Unavailable, match="flash_attn.cute"):
        bench.build_train(bench.FA4, shape, torch.device("cpu"), True)
    # No deterministic anchor to pair with ours.
    assert bench.with_paired_anchors([bench.OURS_DETERMINISTIC]) == [bench.OURS_DETERMINISTIC]


def test_fa4_that_imports_is_a_default_with_its_deterministic_pair(bench, monkeypatch):
    monkeypatch.setattr(bench, "load_fa4", lambda: (FakeFA4(), None))
    assert bench.gpu_default_providers()[-1] == bench.FA4
    assert bench.with_paired_anchors([bench.OURS, bench.OURS_DETERMINISTIC, "sdpa_cudnn"]) == [
        bench.OURS,
        bench.OURS_DETERMINISTIC,
        bench.FA4_DETERMINISTIC,
        "sdpa_cudnn",
    ]
    assert bench.with_paired_anchors([bench.OURS]) == [bench.OURS]


def _standin(bench, tmp_path, providers, extra=()):
    out = tmp_path / "out"
    argv = [
        "--cpu-standin",
        "--no-plots",
        "--out",
        str(out),
        "--cpu-budget-s",
        "0.002",
        "--regimes",
        "train,decode,memory",
        "--seqlens",
        "64",
        "--decode-seqlens-k",
        "256",
        "--decode-batches",
        "1",
        "--providers",
        ",".join(providers),
        *extra,
    ]
    status = bench.main(argv)
    return status, json.loads((out / "results.json").read_text())


def test_fa4_rows_on_the_standin(bench, tmp_path, monkeypatch, capsys):
    fake = FakeFA4()
    monkeypatch.setattr(bench, "load_fa4", lambda: (fake, None))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    status, data = _standin(
        bench,
        tmp_path,
        [bench.OURS, bench.FA4, bench.OURS_DETERMINISTIC],
        extra=["--gqa-ratios", "1,2"],
    )
    assert status == 0
    rows = data["rows"]
    fa4 = [r for r in rows if r["provider"] == bench.FA4]
    det = [r for r in rows if r["provider"] == bench.FA4_DETERMINISTIC]
    # Training only: FA4 has no KV-cache call and is no memory anchor.
    assert fa4 and {r["regime"] for r in fa4 + det} == {"train"}
    assert {r["mode"] for r in fa4} == {"fwd", "bwd", "fwd_bwd"}
    assert {r["mode"] for r in det} == {"bwd", "fwd_bwd"}
    assert not [r for r in fa4 + det if r["error"]]
    assert all(r["max_abs_diff_vs_sdpa"] is not None for r in fa4 + det)
    assert all(not r.get("warning") for r in fa4 + det)
    assert {r["nheads"] // r["nheads_k"] for r in fa4} == {1, 2}
    assert {c["deterministic"] for c in fake.calls} == {False, True}
    # The d32 cells at both ratios, and the stand-in's (32, 16) pair: 64 // 16 heads, MHA.
    assert {(c["nheads_k"], c["dv"]) for c in fake.calls} == {(1, 32), (2, 32), (4, 16)}
    pair = [r for r in fa4 if r["headdim_v"] == 16]
    assert pair and all(r["headdim"] == 32 and r["nheads"] == r["nheads_k"] == 4 for r in pair)
    assert data["meta"].get("fa4_error") is None
    printed = capsys.readouterr().out
    assert "GQA 2:1" in printed
    assert "headdim=32/16" in printed
    assert (
        "vs fa4_deterministic" in printed and "(against flash_attn_cuda_deterministic)" in printed
    )


def test_a_wrong_fa4_is_flagged(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "load_fa4", lambda: (FakeFA4(scale=1.5), None))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    status, data = _standin(bench, tmp_path, [bench.OURS, bench.FA4], extra=["--modes", "fwd"])
    fa4 = [r for r in data["rows"] if r["provider"] == bench.FA4]
    assert fa4 and all("differs from SDPA" in (r.get("warning") or "") for r in fa4)
    # The exit status gates on this project's kernels; the anchor's warning is printed.
    assert status == 0
    assert "WARNING" in capsys.readouterr().out


def test_fa4_unavailable_rows_carry_the_reason(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_fa4", lambda: (None, "FA4 unavailable: not staged"))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    status, data = _standin(bench, tmp_path, [bench.OURS, bench.FA4], extra=["--modes", "fwd"])
    fa4 = [r for r in data["rows"] if r["provider"] == bench.FA4]
    assert fa4 and all(r["error"] == "FA4 unavailable: not staged" for r in fa4)
    assert data["meta"]["fa4_error"] == "FA4 unavailable: not staged"
    assert status == 0


def _ours_or_skip():
    try:
        import flash_attn_cuda  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"flash_attn_cuda is not built here: {exc}")


def test_dropout_rows_are_checked_against_their_mask(bench, tmp_path, monkeypatch, capsys):
    _ours_or_skip()
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--no-plots", "--out", str(out), "--cpu-budget-s", "0.002"]
    argv += ["--regimes", "train", "--seqlens", "64", "--headdims", "32", "--dtypes", "fp32"]
    argv += ["--gqa-ratios", "1,2", "--providers", f"{bench.OURS},{bench.OURS_DROPOUT}"]
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    dropout = [r for r in rows if r["provider"] == bench.OURS_DROPOUT]
    # Both causal settings, both head groupings, every mode; no decode or memory rows.
    assert {(r["causal"], r["nheads"] // r["nheads_k"]) for r in dropout} == {
        (c, g) for c in (False, True) for g in (1, 2)
    }
    assert {r["mode"] for r in dropout} == {"fwd", "bwd", "fwd_bwd"}
    assert {r["regime"] for r in dropout} == {"train"}
    assert all(not r["error"] and not r.get("warning") for r in dropout)
    assert all(r["note"].startswith(f"dropout_p={bench.DROPOUT_P}") for r in dropout)
    assert all(r["max_abs_diff_vs_reference"] < 1e-4 for r in dropout)
    assert "(what dropout_p=0.1 costs)" in capsys.readouterr().out


def test_a_wrong_dropout_output_is_flagged(bench):
    _ours_or_skip()
    import flash_attn_cuda

    def without_the_rescale(*args, dropout_p=0.0, **kwargs):
        out, lse, s_dmask = flash_attn_cuda.flash_attn_func(*args, dropout_p=dropout_p, **kwargs)
        return out * (1.0 - dropout_p), lse, s_dmask

    shape = bench.Shape("fp32", 1, 48, 48, 2, 2, 32, True)
    q, k, v = (torch.randn(1, 48, 2, 32) for _ in range(3))
    good = bench.check_dropout(flash_attn_cuda.flash_attn_func, q, k, v, shape, 0.3)
    assert good["max_abs_diff_vs_reference"] < 1e-4 and "warning" not in good
    bad = bench.check_dropout(without_the_rescale, q, k, v, shape, 0.3)
    assert "output with dropout differs from the float64 reference" in bad["warning"]


def test_headdim_pair_rows_on_the_standin(bench, tmp_path, monkeypatch, capsys):
    """Every provider gets v (and dout) with d_v columns; ours is checked against SDPA."""
    _ours_or_skip()
    monkeypatch.setattr(bench, "load_fa4", lambda: (FakeFA4(), None))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    providers = [bench.OURS, bench.FA4, "sdpa_math", "sdpa_efficient"]
    status, data = _standin(
        bench, tmp_path, providers, extra=["--regimes", "train", "--headdim-pairs", "32x16"]
    )
    assert status == 0
    rows = [r for r in data["rows"] if r["headdim_v"] is not None]
    assert {r["provider"] for r in rows} == set(providers)
    assert {(r["headdim"], r["headdim_v"], r["nheads"], r["nheads_k"]) for r in rows} == {
        (32, 16, 4, 4)
    }
    # Ordinary cells keep headdim_v null.
    assert {r["headdim_v"] for r in data["rows"] if r["headdim"] == 32} == {None, 16}
    for r in rows:
        if r["provider"] in (bench.OURS, bench.FA4):
            assert not r["error"] and not r.get("warning"), r
            assert r["max_abs_diff_vs_sdpa"] < 1e-4
            if r["mode"] != "fwd":
                assert r["max_abs_diff_grad_vs_sdpa"] < 1e-4
        if r["ms"]:
            flops = bench.attention_flops(
                r["batch"],
                r["nheads"],
                r["seqlen_q"],
                r["seqlen_k"],
                32,
                r["causal"],
                r["mode"],
                16,
            )
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
    assert all(not r["error"] for r in rows if r["provider"] == "sdpa_math")
    printed = capsys.readouterr().out
    assert "train fp32 headdim=32/16 non-causal fwd" in printed
    assert "train fp32 headdim=32 non-causal fwd" in printed

    # The JSON's consumers take rows with and without headdim_v.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_table
    finally:
        sys.path.pop(0)
    for r in data["rows"]:
        if r["provider"] == "sdpa_math":
            r["provider"] = "sdpa_flash"  # an anchor the tables know
    table = results_table.full_table(data["meta"], data["rows"])
    assert "| 32/16 |" in table and "| 32 |" in table
    summary = results_table.summary(data["meta"], data["rows"], "results.json")
    assert "| 32/16 |" in summary and "over v of 16" in summary
    old_rows = [{k: v for k, v in r.items() if k != "headdim_v"} for r in data["rows"]]
    assert "| 32 |" in results_table.full_table(data["meta"], old_rows)


def test_headdim_pair_on_the_cpu_quick_grid(bench, tmp_path, monkeypatch):
    """The CPU quick grid's pair: ours' CPU path against SDPA on the CPU."""
    _ours_or_skip()
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
    argv += ["--cpu-budget-s", "0.002", "--regimes", "train", "--seqlens", "128"]
    argv += ["--dtypes", "fp32", "--headdims", "32", "--modes", "fwd,fwd_bwd"]
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    (d, dv), *_ = bench.cpu_grid(quick=True).headdim_pairs
    pair = [r for r in rows if r["headdim_v"] == dv]
    assert {r["provider"] for r in pair} == {bench.OURS, "sdpa_cpu"}
    assert {(r["headdim"], r["nheads"]) for r in pair} == {(d, 256 // dv)}
    ours = [r for r in pair if r["provider"] == bench.OURS]
    assert ours and all(not r["error"] and not r.get("warning") for r in ours)
    assert all(r["max_abs_diff_vs_sdpa"] is not None for r in ours)


def test_bits_digest_tells_one_bit_apart(bench):
    """ab_builds.py's bitwise check rests on this fingerprint."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(3, 70, 5, 24).to(dtype)
        assert bench.bits_digest(x) == bench.bits_digest(x.clone())
        # Same values as another layout's copy: the digest reads the values, not strides.
        assert bench.bits_digest(x) == bench.bits_digest(
            x.transpose(1, 2).contiguous().transpose(1, 2)
        )
        y = x.clone()
        flat = y.view(torch.int16 if y.element_size() == 2 else torch.int32).view(-1)
        flat[1234] ^= 1  # the lowest bit of one element
        assert bench.bits_digest(x) != bench.bits_digest(y)
        # Two equal values swapped between places are told apart too (position weights).
        z = x.clone().view(-1)
        z[[0, 1]] = z[[1, 0]]
        if not torch.equal(z.view_as(x), x):
            assert bench.bits_digest(x) != bench.bits_digest(z.view_as(x))
    assert bench.bits_digest(torch.ones(4), torch.zeros(4)).count("/") == 1


def test_ours_rows_carry_digests_on_the_cpu(bench, tmp_path, monkeypatch):
    """Ours' rows carry the output digest (and, with a backward, the gradients'),
    the same in two runs of the same grid: what ab_builds.py compares."""
    _ours_or_skip()
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    digests = []
    for run in range(2):
        out = tmp_path / f"out{run}"
        argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
        argv += ["--cpu-budget-s", "0.002", "--regimes", "train", "--seqlens", "128"]
        argv += ["--dtypes", "fp32", "--headdims", "32", "--headdim-pairs", ""]
        argv += ["--modes", "fwd,fwd_bwd"]
        assert bench.main(argv) == 0
        rows = json.loads((out / "results.json").read_text())["rows"]
        ours = [r for r in rows if r["provider"] == bench.OURS and not r["error"]]
        assert ours and all(r.get("output_digest") for r in ours)
        assert all(r.get("grad_digest") for r in ours if r["mode"] == "fwd_bwd")
        digests.append(
            sorted((r["mode"], r["causal"], r["output_digest"], r.get("grad_digest")) for r in ours)
        )
    assert digests[0] == digests[1]


def test_ab_builds_bits_verdict():
    ab = load_script(ROOT / "benchmarks" / "ab_builds.py", "ab_builds_under_test")
    same, other = ("o1", "g1"), ("o2", "g1")
    assert ab.bits_verdict([same, same], [same, same]) == "equal"
    assert ab.bits_verdict([same, same], [other, other]) == "differ"
    # A's own rounds disagree (a kernel without a fixed summation order): no verdict on B.
    assert ab.bits_verdict([same, other], [same, same]) == "varies"
    assert ab.bits_verdict([same], [None]) is None
    assert ab.digest_of({"output_digest": "x"}) == ("x", None)
    assert ab.digest_of({"ms": 1.0}) is None


def test_ab_builds_keys_tell_every_case_apart(bench, tmp_path, monkeypatch):
    """ab_builds.py pairs A's and B's rows by key_of: two cases of one run that
    share a key (a decode shape timed on a contiguous and on a paged cache, say)
    would be merged into one case and their times mixed."""
    _ours_or_skip()
    ab = load_script(ROOT / "benchmarks" / "ab_builds.py", "ab_builds_under_test")
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
    argv += ["--cpu-budget-s", "0.002", "--regimes", "decode,paged_prefill", "--decode-paged"]
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    ours = [r for r in rows if r["provider"] == bench.OURS and r.get("ms")]
    layouts = {r["kv_layout"] for r in ours}
    assert "contiguous" in layouts and len(layouts) > 1
    keys = [ab.key_of(r) for r in ours]
    assert len(set(keys)) == len(keys)
    groups = {ab.group_of(dict(zip(ab.KEY_FIELDS, k))) for k in keys}
    assert (bench.OURS, "decode", "fwd") in groups
    assert any(regime.startswith("decode[paged") for _, regime, _ in groups)


@pytest.mark.parametrize("reduced", [True, False])
def test_left_out_head_dim_is_a_skip_on_a_reduced_build(bench, tmp_path, monkeypatch, reduced):
    """A cell whose head dim a reduced build left out (the 192 / 128 pair of a
    d128 build, say) is recorded as skipped and does not fail the run; on a
    build of every kernel the same refusal fails it."""
    _ours_or_skip()
    from reduced_build import LEFT_OUT_MESSAGE, REDUCED_KERNEL_SET_MARK

    import flash_attn_cuda

    refusal = (
        f"flash_attn_cuda: head_dim 32 in fp32 needs the compiled head dim 32, {LEFT_OUT_MESSAGE}"
    )

    def refusing(name, device):
        def op(*args, **kwargs):
            raise RuntimeError(refusal)

        return op

    info = "hdims 128; dtypes bf16" + (f"; {REDUCED_KERNEL_SET_MARK}" if reduced else "")
    monkeypatch.setattr(flash_attn_cuda, "build_info", info)
    monkeypatch.setattr(bench, "ours_op", refusing)
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
    argv += ["--cpu-budget-s", "0.002", "--regimes", "train", "--seqlens", "128"]
    argv += ["--dtypes", "fp32", "--headdims", "32", "--headdim-pairs", "", "--modes", "fwd"]
    assert bench.main(argv) == (0 if reduced else 1)
    rows = json.loads((out / "results.json").read_text())["rows"]
    ours = [r for r in rows if r["provider"] == bench.OURS]
    assert ours and all(r["error"] for r in ours)
    assert all(r["error"].startswith("skipped:") == reduced for r in ours)


def test_decode_headdim_argument(bench, tmp_path, monkeypatch):
    """--decode-headdim sets the decode regime's head dim (512 is served by
    flash_attn_with_kvcache on CUDA); ours and the anchors run at it."""
    _ours_or_skip()
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
    argv += ["--cpu-budget-s", "0.002", "--regimes", "decode", "--decode-headdim", "40"]
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    ours = [r for r in rows if r["provider"] == bench.OURS and r.get("ms")]
    assert ours and {r["headdim"] for r in rows} == {40}
    with pytest.raises(SystemExit, match="--decode-headdim must be in"):
        bench.main(argv[:-1] + ["4"])


def test_decode_mla_rows(bench, tmp_path, monkeypatch):
    """--decode-mla adds absorbed MLA decode rows (128:1 heads, 576 / 512, v_cache
    a view of k_cache): ours only, contiguous and paged, checked against SDPA,
    and bytes counted once per latent row."""
    _ours_or_skip()
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--no-plots", "--out", str(out)]
    argv += ["--cpu-budget-s", "0.002", "--regimes", "decode", "--decode-mla"]
    argv += ["--decode-paged", "--decode-page-sizes", "1,64", "--decode-seqlens-k", "256"]
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    mla = [r for r in rows if r.get("headdim_v") == 512]
    assert {r["provider"] for r in mla} == {bench.OURS}
    assert {r["kv_layout"] for r in mla} == {"contiguous", "paged1", "paged64"}
    assert all((r["nheads"], r["nheads_k"], r["headdim"]) == (128, 1, 576) for r in mla)
    assert all(not r["error"] and r["max_abs_diff_vs_sdpa"] is not None for r in mla)
    for r in mla:
        latent_bytes = r["batch"] * r["seqlen_k"] * 576 * (4 if r["dtype"] == "fp32" else 2)
        assert r["gbps"] == pytest.approx(latent_bytes / (r["ms"] * 1e-3) / 1e9)
    assert any(r.get("headdim_v") is None for r in rows if r["provider"] == bench.OURS)


def test_fp8kv_decode_rows(bench):
    """flash_attn_cuda_fp8kv (named in --providers): decode over an e4m3 cache
    holding the same values, contiguous and paged, checked against SDPA on the
    cache's values; refused with the reason at fp32 (q must be bf16 / fp16)
    and for absorbed MLA; no training or memory rows."""
    _ours_or_skip()
    cpu = torch.device("cpu")
    shape = bench.Shape("bf16", 2, 1, 64, 8, 2, 64, False)
    for page_size in (None, 16):
        prepared = bench.build_decode(bench.OURS_FP8KV, shape, page_size, cpu)
        out = prepared.forward()
        assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 8, 64)
        assert prepared.extra["kv_layout"] == ("contiguous" if page_size is None else "paged16")
        assert prepared.extra["max_abs_diff_vs_sdpa"] < 0.05
    with pytest.raises(bench.Unavailable, match="read with a bf16 / fp16 q"):
        bench.build_decode(
            bench.OURS_FP8KV, bench.Shape("fp32", 2, 1, 64, 8, 2, 64, False), None, cpu
        )
    with pytest.raises(bench.Unavailable, match="absorbed MLA"):
        bench.build_decode(bench.OURS_FP8KV, bench.mla_decode_shape("bf16", 1, 1, 64), None, cpu)
    assert bench.OURS_FP8KV in bench.MEMORY_EXCLUDED and bench.OURS_FP8KV in bench.DECODE_ONLY
