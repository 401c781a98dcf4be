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


# llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 4 -t 1 -r 2 -o json, as it printed
# here (samples shortened to two repetitions; the figures mean nothing on a shared machine).
BENCH_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Platinum 8481C",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama ?B Q4_1",
    "model_size": 96567936,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-05T19:30:00Z",
    "avg_ns": 40000000,
    "stddev_ns": 1000000,
    "avg_ts": 400.125,
    "stddev_ts": 10.5,
    "samples_ns": [ 39000000, 41000000 ],
    "samples_ts": [ 410.256, 390.244 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Platinum 8481C",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama ?B Q4_1",
    "model_size": 96567936,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "test_time": "2026-12-05T19:30:01Z",
    "avg_ns": 50000000,
    "stddev_ns": 2000000,
    "avg_ts": 80.5,
    "stddev_ts": 3.25,
    "samples_ns": [ 48000000, 52000000 ],
    "samples_ts": [ 83.3333, 76.9231 ]
  }
]
"""


def test_llama_bench_json_is_parsed_to_one_row_per_test():
    # Its log lines may come first where stderr is merged into stdout.
    rows = tools.parse_bench("load_backend: loaded CPU backend\n" + BENCH_JSON)
    assert [(r.n_prompt, r.n_gen) for r in rows] == [(16, 0), (0, 4)]
    assert rows[0].tokens_per_s == pytest.approx(400.125)
    assert rows[1].stddev == pytest.approx(3.25)
    assert rows[1].samples == pytest.approx((83.3333, 76.9231))
    assert rows[0].n_threads == 1 and rows[0].n_batch == 2048


def test_llama_bench_without_json_is_one_error():
    with pytest.raises(ValueError, match="no JSON"):
        tools.parse_bench("error: failed to load model\n")


# The last lines of llama-perplexity -f wiki.txt -c 128, and of its KL-divergence mode
# (--kl-divergence-base BASE --kl-divergence) against an F32 base.
PERPLEXITY_OUT = """\
perplexity: calculating perplexity over 4 chunks, n_ctx=128, batch_size=128, n_seq=1
perplexity: 0.21 seconds per pass - ETA 0.00 minutes
[1]17.0954,[2]20.1531,[3]21.4617,[4]19.9386,
Final estimate: PPL = 19.9386 +/- 1.20461

llama_perf_context_print:        load time =     184.45 ms
"""
KL_OUT = (
    "kl_divergence: computing over 4 chunks, n_ctx=128, batch_size=128, n_seq=1\n"
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
    "              Δp RMS            Same top p\n"
    "   1      17.4116 ±    2.1562       0.01835 ±   0.01436       0.03364 ±   0.00364"
    "     5.025 ±  0.680 %   90.625 ±  2.591 %\n"
    """
====== Perplexity statistics ======
Mean PPL(Q)                   :  20.391832 ±   1.232861
Mean PPL(base)                :  19.938591 ±   1.204610
Cor(ln(PPL(Q)), ln(PPL(base))):  98.87%
Mean ln(PPL(Q)/PPL(base))     :   0.022477 ±   0.009169

====== KL divergence statistics ======
Mean    KLD:   0.036125 ±   0.002214
Maximum KLD:   1.040713
99.9%   KLD:   0.902131

====== Token probability statistics ======
Mean    Δp: -0.356 ± 0.148 %
Same top p: 91.016 ± 1.264 %
""")


def test_perplexity_output_is_parsed():
    got = tools.parse_perplexity(PERPLEXITY_OUT)
    assert got.ppl == pytest.approx(19.9386) and got.ppl_error == pytest.approx(1.20461)
    assert got.kld is None and got.same_top is None


def test_kl_divergence_output_is_parsed():
    got = tools.parse_perplexity(KL_OUT)
    assert got.ppl == pytest.approx(20.391832) and got.ppl_error == pytest.approx(1.232861)
    assert got.kld == pytest.approx(0.036125) and got.kld_error == pytest.approx(0.002214)
    assert got.same_top == pytest.approx(0.91016)


def test_perplexity_output_without_an_estimate_is_one_error():
    with pytest.raises(ValueError, match="no perplexity"):
        tools.parse_perplexity("perplexity: you need at least 256 tokens\n")


def test_a_missing_tool_tells_to_run_make_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
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
