"""The CPU kernels are compiled once per x86 ISA (base, AVX2, AVX-512, AVX-512 BF16;
CMakeLists.txt) into one library and chosen at run time (common/cpu_isa.h). Code compiled
for an ISA may run only where that ISA was chosen: a baseline or AVX2 path reaching a
function compiled with AVX-512 would stop with an illegal instruction on a CPU without it
(this machine has AVX-512, so running the tests cannot show it). Inline functions are where
this goes wrong: the linker keeps one copy of each for the whole library. Checked on the
built fastattn._C with objdump: every function holding an AVX-512 instruction belongs to an
AVX-512 copy (its name lies in an avx512 namespace), and every one holding an AVX or AVX2
instruction to an AVX2 or AVX-512 copy.

Skipped: the compiler's clones of a function ([clone .isra.0], ...), local to the file that
made them, so only its own copy calls them; and, for AVX2, std:: templates: the copies link
lowest ISA first (CMakeLists.txt) and a baseline file that calls one out of line emits its
own copy, which then comes first, so an AVX2 copy is kept only where no baseline code calls
it."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fastattn import _native

OBJDUMP = shutil.which("objdump")
pytestmark = [
    pytest.mark.skipif(OBJDUMP is None, reason="needs objdump (binutils)"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA copies are x86's"),
]

# Operands and mnemonics only AVX-512 (EVEX) encodes: zmm registers, opmask registers,
# xmm/ymm 16-31, and instructions without a VEX form.
AVX512 = re.compile(
    r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{sae\}|\{r[nduz]-sae\}|"
    r"\b(vpternlog|vmovdqu(8|16|32|64)|vmovdqa(32|64)|vpermt2|vpermi2|vcompress|vexpand|"
    r"vrndscale|vdpbf16|vcvtne2ps2bf16|vcvtneps2bf16|vscalef|vgetexp|vgetmant|vfixupimm|"
    r"vpbroadcastm|vpmovm2|vpmov[bwdq]2m|vpcmpu?[bwdq]\b|vpro[lr]v?[dq]|vpsravq|vinserti64x|"
    r"vextracti64x|vinsertf64x|vextractf64x|vshuff(32|64)x|vshufi(32|64)x|vbroadcastf(32|64)x|"
    r"vbroadcasti(32|64)x|kmov|kand|kor|kxor|knot|kshift|ktest|kortest|kunpck|kadd)"
)
# VEX-encoded (AVX, AVX2, FMA, F16C) instructions: any v-prefixed SSE/AVX mnemonic.
AVX = re.compile(r"^\s*[0-9a-f]+:\s+v[a-z0-9]+\s")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def functions(path: Path) -> dict[str, list[str]]:
    """Demangled function name -> its disassembled instruction lines."""
    out = subprocess.run(
        [OBJDUMP, "-d", "-C", "--no-show-raw-insn", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = m.group(1)
            found[current] = []
        elif current is not None and ":\t" in line:
            found[current].append(line)
    return found


def misplaced(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Functions whose instructions need a higher ISA than their copy's namespace says."""
    avx512_copy = re.compile(r"fastattn::cpu::(target_)?avx512(bf16)?::")
    avx_copy = re.compile(r"fastattn::cpu::(target_)?(avx2|avx512(bf16)?)::")
    bad: dict[str, list[str]] = {"avx512": [], "avx": []}
    for name, lines in found.items():
        if "[clone ." in name:
            continue  # a compiler clone (.isra, .constprop, .part) is local to its file's copy
        if any(AVX512.search(line) for line in lines):
            if not avx512_copy.search(name):
                bad["avx512"].append(name)
        elif (
            any(AVX.match(line) for line in lines)
            and not avx_copy.search(name)
            and not name.startswith("std::")
        ):
            bad["avx"].append(name)
    return bad


def test_isa_specific_code_only_in_its_copies():
    if _native.C is None:
        pytest.skip(f"fastattn._C did not import: {_native.IMPORT_ERROR}")
    found = functions(Path(_native.C.__file__))
    # The check reads the AVX-512 copies' kernels (they exist in every x86 build).
    assert any("fastattn::cpu::avx512::" in name for name in found), "no AVX-512 copy found"
    bad = misplaced(found)
    assert not bad["avx512"], "AVX-512 code outside the AVX-512 copies:\n" + "\n".join(
        sorted(bad["avx512"])[:40]
    )
    assert not bad["avx"], "AVX code outside the AVX2 / AVX-512 copies:\n" + "\n".join(
        sorted(bad["avx"])[:40]
    )


def test_check_flags_a_shared_function():
    """The check itself: a baseline-named function holding an AVX-512 or an AVX instruction
    is reported, one in an AVX-512 copy is not."""
    found = {
        "std::vector<float, std::allocator<float> >::vector(unsigned long)": [
            "  1000:\tvmovups %zmm0,(%rax)"
        ],
        "fastattn::cpu::exp_shift_sum(float*, long, float)": ["  2000:\tvaddps %ymm1,%ymm2,%ymm3"],
        "void fastattn::cpu::avx512::layer_forward<float>()": [
            "  3000:\tvfmadd231ps %zmm1,%zmm2,%zmm3"
        ],
        "fastattn::cpu::target_avx2::exp_approx(float)": ["  4000:\tvfmadd231ps %ymm1,%ymm2,%ymm3"],
        "plain()": ["  5000:\tmovaps %xmm0,%xmm1"],
        "std::vector<short>::vector(unsigned long)": ["  7000:\tvmovdqu %ymm0,(%rax)"],
        "std::__fill_a1(bool const&) [clone .isra.0]": ["  6000:\tvmovdqu64 %zmm0,(%rax)"],
    }
    bad = misplaced(found)
    assert bad["avx512"] == ["std::vector<float, std::allocator<float> >::vector(unsigned long)"]
    assert bad["avx"] == ["fastattn::cpu::exp_shift_sum(float*, long, float)"]
