"""benchmarks/llama_cpp.py without building anything: the instruction-set switches chosen
from a CPU's flags, and the parsers on output captured from the real tools."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_cpp.py"
spec = importlib.util.spec_from_file_location("benchmark_llama_cpp", PATH)
tools = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tools)

# The flags line of this Sapphire Rapids Xeon's /proc/cpuinfo (a virtual machine), cut to the
# ISA flags, and of an AVX2-only host (a Haswell-era Xeon).
SAPPHIRE_RAPIDS = (
    "flags\t\t: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c "
    "bmi1 avx2 bmi2 avx512f avx512dq avx512ifma avx512cd sha_ni avx512bw avx512vl avx_vnni "
    "avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq amx_bf16 avx512_fp16 amx_tile amx_int8\n")
HASWELL = ("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt "
           "aes xsave avx f16c rdrand bmi1 avx2 bmi2\n")


def test_flags_are_read_from_the_flags_line():
    assert {"avx2", "amx_tile", "avx512_vnni"} <= tools.cpu_flags(SAPPHIRE_RAPIDS)
    assert tools.cpu_flags("processor\t: 0\n") == set()


def test_amx_listed_but_the_probe_failing_builds_without_amx():
    chosen = tools.choose_flags(tools.cpu_flags(SAPPHIRE_RAPIDS), amx=False)
    assert not any(chosen[option] for option in tools.AMX_OPTIONS)
    assert chosen["GGML_AVX512"] and chosen["GGML_AVX512_VNNI"] and chosen["GGML_AVX512_BF16"]
    assert chosen["GGML_AVX_VNNI"] and chosen["GGML_AVX2"] and chosen["GGML_FMA"]
    assert tools.describe(chosen) == "AVX-512 VNNI, AMX off"
    args = tools.cmake_args(chosen)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args


def test_amx_is_built_where_the_probe_runs_it():
    chosen = tools.choose_flags(tools.cpu_flags(SAPPHIRE_RAPIDS), amx=True)
    assert all(chosen[option] for option in tools.AMX_OPTIONS)
    assert tools.describe(chosen) == "AVX-512 VNNI, AMX on"


def test_an_avx2_host_gets_no_avx512_and_no_amx():
    chosen = tools.choose_flags(tools.cpu_flags(HASWELL), amx=True)
    assert chosen["GGML_AVX2"] and chosen["GGML_FMA"] and chosen["GGML_F16C"]
    assert chosen["GGML_BMI2"] and chosen["GGML_AVX"] and chosen["GGML_SSE42"]
    assert not any(on for option, on in chosen.items() if "AVX512" in option or "AMX" in option)
    assert not chosen["GGML_AVX_VNNI"]
    assert tools.describe(chosen) == "AVX2, AMX off"
    assert "-DGGML_AVX512=OFF" in tools.cmake_args(chosen)


def test_part_of_avx512_is_not_enough_for_ggml_s_avx512_switch():
    # ggml compiles its AVX512 variant with -mavx512f/cd/vl/dq/bw together.
    flags = tools.cpu_flags(HASWELL) | {"avx512f", "avx512cd"}
    assert not tools.choose_flags(flags, amx=False)["GGML_AVX512"]


# llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 4 -t 1 -r 2 -o json as it printed
# here (AVX-512 VNNI, AMX off), less the settings the parser does not read; the figures mean
# nothing on a shared machine.
BENCH_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "type_k": "f16",
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 224744556,
    "stddev_ns": 18175526,
    "avg_ts": 71.425507,
    "stddev_ts": 5.776319,
    "samples_ns": [
      237596594,
      211892518
    ],
    "samples_ts": [
      67.341,
      75.51
    ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "type_k": "f16",
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "avg_ns": 166748877,
    "stddev_ns": 8598500,
    "avg_ts": 24.020102,
    "stddev_ts": 1.23861,
    "samples_ns": [
      172828935,
      160668819
    ],
    "samples_ts": [
      23.1443,
      24.8959
    ]
  }
]
"""


def test_llama_bench_json_is_parsed_to_one_row_per_test():
    # Its log lines may come first where stderr is merged into stdout.
    rows = tools.parse_bench("load_backend: loaded CPU backend\n" + BENCH_JSON)
    assert [(r.n_prompt, r.n_gen) for r in rows] == [(16, 0), (0, 4)]
    assert rows[0].tokens_per_s == pytest.approx(71.425507)
    assert rows[1].stddev == pytest.approx(1.23861)
    assert rows[1].samples == pytest.approx((23.1443, 24.8959))
    assert rows[0].n_threads == 1 and rows[0].n_batch == 2048


def test_llama_bench_without_json_is_one_error():
    with pytest.raises(ValueError, match="no JSON"):
        tools.parse_bench("error: failed to load model\n")


# llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -c 128 -f (3,000 characters of
# WikiText-2) --kl-divergence-base BASE: the end of its output, stdout then stderr as _run
# joins them (the estimate lands on the line of the ETA its progress left open). Then the
# same for a llama-quantize Q4_K_M of the file with --kl-divergence-base BASE --kl-divergence.
PERPLEXITY_OUT = """\
0.05 minutes
[1]19.8472,[2]10.8436,[3]12.6688,[4]16.0156,[5]14.6075,[6]19.3077,

0.00.525.721 I perplexity: tokenization took 3.097 ms
0.00.525.810 I perplexity: calculating perplexity over 6 chunks, n_ctx=128, batch_size=2048, \
n_seq=16
0.10.426.725 I perplexity: 9.89 seconds per pass - ETA 0.10.761.970 I Final estimate: \
PPL = 19.3077 +/- 3.02181
"""
KL_OUT = (
    "0.03 minutes\n\n"
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
    "              Δp RMS            Same top p\n"
    "   1      19.6056 ±    7.0357      -0.01224 ±    0.04670       0.04658 ±    0.00569"
    "     5.336 ±  1.256 %    92.063 ±  3.433 %\n"
    "   6      19.4826 ±    3.0570       0.00902 ±    0.01847       0.04792 ±    0.00233"
    "     4.997 ±  0.429 %    87.037 ±  1.730 %\n"
    """
====== Perplexity statistics ======
Mean PPL(Q)                   :  19.482596 ±   3.057014
Mean PPL(base)                :  19.307684 ±   3.021806
Mean ln(PPL(Q)/PPL(base))     :   0.009018 ±   0.018474
Mean PPL(Q)/PPL(base)         :   1.009059 ±   0.018641
Mean PPL(Q)-PPL(base)         :   0.174912 ±   0.359942

====== KL divergence statistics ======
Mean    KLD:   0.047920 ±   0.002325
Maximum KLD:   0.256901
Median  KLD:   0.035623
Minimum KLD:   0.000002

====== Token probability statistics ======
Mean    Δp: -0.154 ± 0.257 %
RMS Δp    :  4.997 ± 0.429 %
Same top p: 87.037 ± 1.730 %


0.00.677.797 I kl_divergence: computing over 6 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.06.991.695 I kl_divergence: 6.31 seconds per pass - ETA
""")


def test_perplexity_output_is_parsed():
    got = tools.parse_perplexity(PERPLEXITY_OUT)
    assert got.ppl == pytest.approx(19.3077) and got.ppl_error == pytest.approx(3.02181)
    assert got.kld is None and got.same_top is None


def test_kl_divergence_output_is_parsed():
    got = tools.parse_perplexity(KL_OUT)
    assert got.ppl == pytest.approx(19.482596) and got.ppl_error == pytest.approx(3.057014)
    assert got.kld == pytest.approx(0.04792) and got.kld_error == pytest.approx(0.002325)
    assert got.same_top == pytest.approx(0.87037)


def test_perplexity_output_without_an_estimate_is_one_error():
    with pytest.raises(ValueError, match="no perplexity"):
        tools.parse_perplexity("perplexity: you need at least 256 tokens\n")


def test_a_missing_tool_tells_to_run_make_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tools.cache_dir() == tmp_path / "tformer" / f"llama.cpp-{tools.VERSION}"
    assert not tools.available()
    with pytest.raises(SystemExit, match="make bench"):
        tools.binary("llama-bench")
    with pytest.raises(SystemExit, match="no llama.cpp tool 'llama-cli'"):
        tools.binary("llama-cli")


def test_the_summary_comes_from_build_json(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = tools.bin_dir()
    out.mkdir(parents=True)
    for tool in tools.TOOLS:
        (out / tool).write_text("")
    record = {"summary": "llama.cpp 0c1e570 (llama-cpp-python 0.3.36), AVX2, AMX off"}
    (out / "build.json").write_text(json.dumps(record))
    assert tools.available()
    assert tools.isa_summary() == record["summary"]


def test_an_unknown_quantization_type_is_one_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown quantization type 'q4_k_x'"):
        tools.quantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q4_k_x")


def test_a_tool_dying_with_sigill_turns_amx_off(tmp_path, monkeypatch):
    """The built llama-bench decides in the end: GCC 12 miscompiles ggml's tile setup, and
    its first tile instruction raises SIGILL where the probe's ran."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(tools, "smoke_gguf", lambda: tmp_path / "model.gguf")
    runs, why = tools.amx_build_runs(fake)
    assert not runs and "signal 4" in why
    fake.write_text("#!/bin/sh\necho '[]'\n")
    assert tools.amx_build_runs(fake)[0]
