"""What iktools writes, loaded and run by ik_llama.cpp itself (tests/ik_engine.py: PyPI's ik-llama-cpp-python wheel,
its libllama and llama-quantize): every architecture both know, every quant type, repacked and mixed files; and the
wheel's own plans and bytes against ikquant's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.errors import QuantizeError
from ikquant.ftypes import file_type
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikquant.quantize import QuantizeOptions, check_writable, make_plan
from ikquant.shards import GGUFModel
from ikrun import Model, tokenize_chunks
from ikrun.cli import app as ikrun_app
from ikrun.options import RuntimeOptions
from tests import ik_engine

runner = CliRunner()
DATA = Path(__file__).parent / "data"

#: every type the wheel's llama-quantize takes, as the file type whose --pure base it is
TYPES = ["F16", "BF16", "BF16_R16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_0", "Q8_0", "MXFP4", "IQ4_NL", "Q2_K", "Q3_K_M",
         "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
         "IQ1_BN", "IQ2_BN", "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ2_KS", "IQ2_KL", "IQ3_KS", "IQ4_KS",
         "IQ4_KSS", "IQ5_KS", "IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT", "Q8_KV", "Q4_0_R8", "Q5_0_R4", "Q6_0_R4",
         "Q8_0_R8", "IQ4_NL_R4", "IQ4_XS_R8", "Q2_K_R4", "Q3_K_R4", "Q4_K_R4", "Q5_K_R4", "Q6_K_R4", "IQ2_XXS_R4",
         "IQ2_XS_R4", "IQ3_XXS_R4", "IQ3_S_R4", "IQ1_S_R4", "IQ1_M_R4", "IQ2_BN_R4", "IQ2_K_R4", "IQ3_K_R4",
         "IQ4_K_R4", "IQ5_K_R4", "IQ4_KS_R4", "IQ5_KS_R4", "Q8_K_R8", "Q8_KV_R8"]
#: what the wheel's generic x86-64 build cannot compute, and what it says: BitNet activations need rows of at least
#: 512 values (this model's are 256; the interleaved IQ2_BN_R4 has a kernel of its own that runs)
IK_CANNOT_RUN = {"IQ1_BN": "QK_IQ1BN", "IQ2_BN": "QK_IQ1BN"}
#: what the wheel's build computes wrongly on its own files (byte-identical to ikquant's): BF16_R16 products, a mean
#: KLD of 0.28 where ikrun's is 4e-5 (why is not established here; its BF16 files it computes right)
IK_WRONG = {"BF16_R16": 0.1}
#: the wheel's build searches IQ2_KS scales with ik's scalar code (no AVX2 path compiled in): without an imatrix that
#: is ikquant's --slow-iq2ks, byte for byte; with one its bytes differ from both of ikquant's searches (the generic
#: build's float order, likely its lack of fused multiply-adds: not established here)
SCALAR_SEARCH = {"IQ2_KS": "--slow-iq2ks"}


def _logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kld(base: np.ndarray, other: np.ndarray) -> float:
    """Mean KL-divergence of `other`'s token distributions from `base`'s, over every position."""
    lb, lo = _logsoftmax(base), _logsoftmax(other)
    return float((np.exp(lb) * (lb - lo)).sum(-1).mean())


def _run(app, *args: object) -> None:  # type: ignore[no-untyped-def]
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ik-archs")
    sources = {"qwen3": (make_tiny_checkpoint(folder / "qwen3", TinySpec(arch="qwen3", seed=1)), "qwen2"),
               "llama": (make_tiny_checkpoint(folder / "llama", TinySpec(arch="llama", seed=1)), "llama-bpe"),
               "deepseek2": (DATA / "convert" / "deepseek-v3" / "hf", "deepseek-v3"),
               "glm-dsa": (DATA / "convert" / "glm-dsa" / "hf", "glm4")}
    return {arch: Converter(hf, "f32", pre).write(folder / f"{arch}-f32.gguf") for arch, (hf, pre) in sources.items()}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek2"])
def test_conversions_run_in_ik_as_in_ikrun(converted: dict[str, Path], arch: str) -> None:
    # ik's default cache on both sides; ik_engine runs -fa off, where ik's MLA takes the decode path at any length
    model = Model(converted[arch], kv_cache="f16", options=RuntimeOptions(mla="decode") if arch == "deepseek2" else None)
    for ctx in (64, 200):
        chunk = tokenize_chunks(model, CORPUS.read_text(), ctx, 1)[0]
        assert mean_kld(ik_engine.logits(converted[arch], [int(t) for t in chunk]), model.logits(chunk)) <= 1e-5


def test_the_wheels_glm_dsa_predates_the_layout_ik_loads_now(converted: dict[str, Path]) -> None:
    with pytest.raises(ik_engine.IkFailed, match="indexer.k_norm.weight"):
        ik_engine.logits(converted["glm-dsa"], list(range(1, 9)))


@pytest.fixture(scope="module")
def model256(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """A tiny Qwen3 with 256-wide rows (every type's blocks fit), its imatrix, and both engines' base logits."""
    folder = tmp_path_factory.mktemp("ik-types")
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                      head_dim=64, ffn=256, seed=5))
    base = Converter(hf, "f32", "qwen2").write(folder / "f32.gguf")
    imatrix = folder / "imatrix.dat"
    _run(ikrun_app, "imatrix", base, "--text", CORPUS, "--ctx", "64", "--chunks", "4", "-o", imatrix)
    model = Model(base, kv_cache="f16")
    chunk = tokenize_chunks(model, CORPUS.read_text(), 128, 1)[0]
    tokens = [int(t) for t in chunk]
    return {"folder": folder, "base": base, "imatrix": imatrix, "chunk": chunk, "tokens": tokens,
            "ik_base": ik_engine.logits(base, tokens), "our_base": model.logits(chunk)}


def _both_agree(m: dict, path: Path) -> tuple[float, float]:  # type: ignore[type-arg]
    """(ik's KLD, ikrun's KLD) of `path` against the F32 base, each engine against its own base logits; ik's may
    exceed ikrun's (exact weights and activations) by what its own arithmetic adds: 8-bit activations before every
    quantized matmul (6e-5 on this model, the Q8_0 file's difference) and int16 pair sums that saturate on some
    5- and 6-bit types (IQ4_XS, IQ5_KS, IQ6_K: up to +25%), so the two agree within 15% + 5e-4; a broken file
    (a wrong type id or offset) is off by orders of magnitude."""
    ours = mean_kld(m["our_base"], Model(path, kv_cache="f16").logits(m["chunk"]))
    theirs = mean_kld(m["ik_base"], ik_engine.logits(path, m["tokens"]))
    assert abs(theirs - ours) <= 0.15 * ours + 5e-4, (theirs, ours)
    return theirs, ours


@pytest.mark.parametrize("ftype", TYPES)
def test_every_type_ik_knows_loads_and_runs_in_ik(model256: dict, ftype: str) -> None:  # type: ignore[type-arg]
    folder = model256["folder"]
    ours, theirs = folder / f"{ftype}.gguf", folder / f"ik-{ftype}.gguf"
    # every weight in the type; embeddings and output in Q8_0, which needs no importance data
    args = ["--pure", "--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0"]
    if ftype not in SCALAR_SEARCH:
        args += ["--imatrix", str(model256["imatrix"])]
    scalar = [SCALAR_SEARCH[ftype]] if ftype in SCALAR_SEARCH else []
    # the threads set how ik batches its quantize calls, which some types' bytes depend on: 2, as the wheel's run
    _run(ikquant_app, model256["base"], ours, "--type", ftype, "--threads", "2", *args, *scalar)
    res = ik_engine.llama_quantize(*args, str(model256["base"]), str(theirs), ftype, "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert ours.read_bytes() == theirs.read_bytes()
    assert GGUFFile(ours).info("blk.0.ffn_up.weight").type.name == file_type(ftype).default_type
    if ftype in IK_CANNOT_RUN:
        with pytest.raises(ik_engine.IkFailed, match=IK_CANNOT_RUN[ftype]):
            ik_engine.logits(ours, model256["tokens"])
        return
    if ftype in IK_WRONG:
        assert mean_kld(model256["ik_base"], ik_engine.logits(ours, model256["tokens"])) > IK_WRONG[ftype]
        assert mean_kld(model256["our_base"], Model(ours, kv_cache="f16").logits(model256["chunk"])) < 1e-4
        return
    _both_agree(model256, ours)


def test_repacked_and_mixed_files_run_in_ik(model256: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    base = model256["base"]
    _run(ikquant_app, base, tmp_path / "q.gguf", "--type", "Q4_K_M")
    _run(ikquant_app, tmp_path / "q.gguf", tmp_path / "r.gguf", "--repack")
    assert "Q4_K_R4" in {t.type.name for t in GGUFFile(tmp_path / "r.gguf").tensors.values()}
    mixed = "ffn_down=iq5_ks,ffn_up=iq2_kl,attn_v=q8_0,attn_q=iq3_k_r4,blk\\.1\\.ffn_gate=iq4_kt"
    _run(ikquant_app, base, tmp_path / "mix.gguf", "--type", "IQ4_KS", "--imatrix", model256["imatrix"],
         "--custom-q", mixed)
    for name in ("q.gguf", "r.gguf", "mix.gguf"):
        _both_agree(model256, tmp_path / name)


_PLAN_ENTRY = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+) - \[[^]]*\], type =\s+(\w+),(.*?)(?=\[\s*\d+/\s*\d+\]|\Z)",
                         re.DOTALL)


def ik_plan(log: str) -> dict[str, str]:
    """Each tensor's type in llama-quantize's log: 'converting to T', else its input type (a note such as 'did not
    find weights' may cut the line before 'converting to')."""
    plan = {}
    for m in _PLAN_ENTRY.finditer(log):
        converted = re.search(r"converting to (\w+)", m[3])
        plan[m[1]] = converted[1] if converted else m[2]
    return plan


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_S", "IQ4_KS", "IQ3_K", "IQ2_KS", "IQ2_M", "IQ1_S_R4", "Q6_0_R4"])
@pytest.mark.parametrize("variant", ["qwen3-plan", "deepseek-v3-plan"])
def test_the_wheels_plans_equal_ikquants(tmp_path: Path, variant: str, ftype: str, imat: bool) -> None:
    header = (DATA / "plans" / variant / "ik-f16.header.bin").read_bytes()
    model = tmp_path / "m.gguf"  # the plan input: the golden header, its weights as zeros in a sparse file
    with open(model, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + (64 << 20))
    imatrix = DATA / "plans" / variant / "imatrix.dat"
    args = ["--imatrix", str(imatrix)] * imat
    res = ik_engine.llama_quantize("--dry-run", *args, str(model), str(tmp_path / "out.gguf"), ftype, "1")
    if res.returncode != 0 and not imat:  # ik refuses the very-low-bit types without importance data: so do we
        assert "importance matrix" in res.stderr, res.stderr[-2000:]
        with pytest.raises(QuantizeError, match="imatrix|importance"):
            check_writable(make_plan(GGUFModel(model), QuantizeOptions(file_type(ftype))))
        return
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = ik_plan(res.stdout + res.stderr)
    plan = make_plan(GGUFModel(model), QuantizeOptions(file_type(ftype), imatrix=read_imatrix_dat(imatrix) if imat
                                                      else None, ignore_imatrix_rules=True))
    assert {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors} == theirs
