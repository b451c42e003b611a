"""The committed kernel instantiation files are what csrc/cuda/generate_instantiations.py
writes: the head-dim / dtype lists and the files that define CuTe's extended wgmma
shapes have one source, the generator."""

from pathlib import Path

from script_module import load_script

CUDA_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cuda"


def load_generator():
    return load_script(CUDA_DIR / "generate_instantiations.py", "generate_instantiations")


def test_committed_files_match_the_generator(tmp_path):
    load_generator().write_instantiations(tmp_path)
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.cu")}
    committed = {p.name: p.read_text() for p in (CUDA_DIR / "instantiations").glob("*.cu")}
    assert sorted(generated) == sorted(committed)
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"rerun csrc/cuda/generate_instantiations.py: {stale} differ"


def test_extended_wgmma_switch_comes_before_any_include():
    generator = load_generator()
    for kernel, head_dims in generator.EXTENDED_WGMMA_HEAD_DIMS.items():
        for head_dim in head_dims:
            for dtype in generator.DTYPES:
                text = (
                    CUDA_DIR / "instantiations" / f"flash_{kernel}_hdim{head_dim}_{dtype}.cu"
                ).read_text()
                define = text.index("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED")
                assert define < text.index("#include")
