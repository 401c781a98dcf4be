"""The kernels' C library as one unit: tformer.h declares every exported function and
structure, every source includes it and none declares its own, the compiler checks each
definition against it, and library.py's table of signatures and ctypes structures say
what the header says."""

import ctypes
import re
import shutil
import subprocess

import pytest

from tformer.kernels import library

HEADER = library.SOURCES[0].with_name("tformer.h")
DECLARATION = re.compile(r"^[a-z][\w ]*?\**\s*\b(tformer_\w+)\(([^;{]*)\);", re.M)
compiler = pytest.mark.skipif(library.compiler() is None or shutil.which("cc") is None,
                              reason="no C compiler")


def declared() -> dict[str, str]:
    """tformer.h's functions: name -> parameter list."""
    return {name: params for name, params in DECLARATION.findall(HEADER.read_text())}


def test_every_source_includes_the_header_and_declares_nothing_of_its_own():
    for source in library.SOURCES:
        text = source.read_text()
        assert '#include "tformer.h"' in text, source.name
        assert DECLARATION.findall(text) == [], source.name


def test_the_signature_table_names_the_header_functions_with_their_arity():
    functions = declared()
    assert sorted(functions) == sorted(library.SIGNATURES)
    for name, params in functions.items():
        arity = 0 if params.strip() == "void" else params.count(",") + 1
        assert len(library.SIGNATURES[name][1]) == arity, name


@compiler
def test_the_build_refuses_a_definition_or_call_without_a_declaration(tmp_path):
    # Every build of the library (compile_library) is made with these flags.
    flags = [f for f in library.FLAGS if f not in ("-shared", "-fPIC")]
    assert {"-Werror=missing-prototypes", "-Werror=implicit-function-declaration"} <= set(flags)
    for body in ("int tformer_undeclared(int x) { return x; }",
                 '#include "tformer.h"\nstatic int f(void) { return tformer_nowhere(); }'):
        source = tmp_path / "wrong.c"
        source.write_text(body + "\n")
        done = subprocess.run([library.compiler(), *flags, f"-I{HEADER.parent}", "-c",
                               str(source), "-o", str(tmp_path / "wrong.o")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "error" in done.stderr


OFFSETS = r"""
#include <stddef.h>
#include <stdio.h>
#include "tformer.h"
#define SHOW(S, F) printf("%s %s %zu\n", #S, #F, offsetof(struct S, F));
#define SIZE(S) printf("%s sizeof %zu\n", #S, sizeof(struct S));
int main(void)
{
    FIELDS
    return 0;
}
"""
STRUCTURES = {"tformer_linear": library.Linear, "tformer_norm": library.Norm,
              "tformer_decoder_layer": library.DecoderLayer, "tformer_lm_layer": library.LMLayer,
              "tformer_kv": library.KV, "tformer_experts": library.Experts,
              "tformer_router": library.Router, "tformer_moe": library.Moe,
              "tformer_activations": library.Activations}


@compiler
def test_the_ctypes_structures_lay_out_their_fields_as_the_header_does(tmp_path):
    lines = [f"SIZE({c_name})" for c_name in STRUCTURES]
    lines += [f"SHOW({c_name}, {field})" for c_name, mirror in STRUCTURES.items()
              for field, _ in mirror._fields_]
    source = tmp_path / "offsets.c"
    source.write_text(OFFSETS.replace("FIELDS", "\n    ".join(lines)))
    subprocess.run([library.compiler(), f"-I{HEADER.parent}", str(source), "-o",
                    str(tmp_path / "offsets")], check=True, timeout=60)
    out = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    for line in filter(None, out):
        c_name, field, value = line.split()
        mirror = STRUCTURES[c_name]
        got = ctypes.sizeof(mirror) if field == "sizeof" else getattr(mirror, field).offset
        assert got == int(value), (c_name, field)
