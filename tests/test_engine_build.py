"""The installed llama.cpp is the portable build: no AMX tiles, no AVX-512 (issue 8, section 1).

A llama.cpp compiled with GGML_NATIVE on a Xeon with AMX kills the server with SIGILL on the
first multi-token chat (the AMX kernels run on OpenMP threads that never asked the kernel for
the tile permission), and one compiled on an AVX-512 machine dies the same way on a machine
without AVX-512. scripts/setup.sh builds `llama-server`, the runner of every GGUF model, for the
AVX2/FMA/F16C/BMI2 baseline with llama.cpp linked in; these tests read the machine code of that
binary (.venv/bin/llama-server, with objdump) and fail on any AMX or AVX-512 instruction, naming
the function and the first instructions found. The matcher is tested on its own, on sample
text and on the real output of `as` + `objdump`, so that a passing scan means something.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

OBJDUMP = ("objdump", "-d", "--no-show-raw-insn")
SHOWN = 8  # offending instructions named per library in a failure message

# AMX: every tile instruction (AMX-TILE, -INT8, -BF16, -FP16, -COMPLEX) and any tile register.
AMX_MNEMONICS = frozenset({
    "tilezero", "tileloadd", "tileloaddt1", "tilestored", "tilerelease", "ldtilecfg",
    "sttilecfg", "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud", "tdpbf16ps", "tdpfp16ps",
    "tcmmimfp16ps", "tcmmrlfp16ps",
})
AMX_PREFIXES = ("tile", "tdp", "tcmm")
# AVX-512: a zmm register, an opmask register (`{%k1}`, `kmovw %k1,...`), xmm/ymm 16-31 (and
# AMX's tile registers); embedded broadcast, zeroing, embedded rounding / suppress-all-exceptions
REGISTERS = re.compile(r"%(?:zmm\d|k[0-7]\b|[xy]mm(?:1[6-9]|2\d|3[01])\b|tmm\d)")
DECORATIONS = re.compile(r"\{(?:1to\d+|z|r[nduz]-sae|sae)\}")
# ... or an instruction that exists only as EVEX (AVX-512VL forms on xmm/ymm 0-15).
AVX512_MNEMONICS = r"""
    vpternlog[dq] | vperm[it]2(?:b|w|d|q|ps|pd) | vpro[lr]v?[dq] | vp?compress(?:p[sd]|[bwdq])
  | vp?expand(?:p[sd]|[bwdq]) | vpconflict[dq] | vplzcnt[dq] | vrndscale[ps][sd] | vrange[ps][sd]
  | vreduce[ps][sd] | vgetexp[ps][sd] | vgetmant[ps][sd] | vscalef[ps][sd] | vfixupimm[ps][sd]
  | vfpclass[ps][sd][xyz]? | vrcp(?:14|28)[ps][sd] | vrsqrt(?:14|28)[ps][sd] | vexp2p[sd]
  | vpmovm2[bwdq] | vpmov[bwdq]2m | vpmov(?:us|s)?(?:qb|qw|qd|db|dw|wb)
  | v(?:extract|insert)[if](?:32x4|32x8|64x2|64x4) | vbroadcast[if](?:32x2|32x4|32x8|64x2|64x4)
  | vshuf[if](?:32x4|64x2) | valign[dq] | vpabsq | vp(?:max|min)[su]q | vpsrav?q | vpmullq
  | vcvtt?p[sd]2u?qq[xy]? | vcvtt?[ps][sd]2u(?:dq|si)[xy]? | vcvtu(?:dq|qq|si)2[ps][sd][xy]?
  | vcvtqq2p[sd][xy]? | vmovdq[au](?:8|16|32|64) | vp(?:and|andn|or|xor)[dq] | vperm[bw]
  | vpmultishiftqb | vpsh[lr]dv?[wdq] | vpopcnt[bwdq] | v(?:gather|scatter)pf[01][dq]p[sd]
  | vpscatter[dq][dq] | vscatter[dq]p[sd] | vdbpsadbw | vps(?:ll|rl|ra)vw | vpshufbitqmb
  | vptestn?m[bwdq] | vpcmpu?[bwdq] | vpblendm[bwdq] | vblendmp[sd] | vpbroadcastm(?:b2q|w2d)
  | vcvtne2ps2bf16 | vdpbf16ps
"""
# These are AVX-512 as EVEX, and AVX-VNNI / AVX-IFMA / AVX-NE-CONVERT when objdump prints
# `{vex}` before them: only the former is flagged.
AVX512_UNLESS_VEX = r"vpdp(?:busd|wssd)s? | vpmadd52[lh]uq | vcvtneps2bf16"
_AVX512_MNEMONIC = re.compile(AVX512_MNEMONICS, re.X)
_AVX512_UNLESS_VEX = re.compile(AVX512_UNLESS_VEX, re.X)

_PREFIXES = frozenset({"lock", "rep", "repz", "repnz", "repe", "repne", "notrack", "bnd",
                       "data16", "addr32", "cs", "ds", "es", "fs", "gs", "ss", "xacquire",
                       "xrelease", "rex", "rex.w"})
_INSN = re.compile(r"^\s*([0-9a-f]+):\t(.*)$")
# Lines worth classifying, found in the whole text at C speed: a superset of classify()'s
# positives (objdump prints a tab only between an address and its instruction).
_SUSPECT_MNEMONIC = re.compile(
    r"\t(?:(?:\{[^}\n]*\}|" + "|".join(re.escape(p) for p in sorted(_PREFIXES)) + r")[ ]+)*"
    r"(?:ldtilecfg|sttilecfg|tile\w*|tdp\w*|tcmm\w*|" + AVX512_MNEMONICS + "|"
    + AVX512_UNLESS_VEX + r")(?=[ ]|$)", re.X | re.M)
_SUSPECTS = (REGISTERS, DECORATIONS, _SUSPECT_MNEMONIC)


def classify(instruction: str) -> str | None:
    """'amx', 'avx512' or None for one instruction as objdump prints it (AT&T syntax)."""
    text = re.sub(r"<[^>]*>", "", instruction.split("#", 1)[0])  # comment, symbol names
    tokens = text.split()
    vex = False
    while tokens and (tokens[0] in _PREFIXES or tokens[0].startswith("{")):
        vex = vex or tokens[0].startswith("{vex")
        tokens.pop(0)
    if not tokens:
        return None
    mnemonic, operands = tokens[0], " ".join(tokens[1:])
    registers = REGISTERS.findall(operands)
    if (mnemonic in AMX_MNEMONICS or mnemonic.startswith(AMX_PREFIXES)
            or any(r.startswith("%tmm") for r in registers)):
        return "amx"
    if (registers or DECORATIONS.search(operands) or _AVX512_MNEMONIC.fullmatch(mnemonic)
            or (not vex and _AVX512_UNLESS_VEX.fullmatch(mnemonic))):
        return "avx512"
    return None


@dataclass
class Scan:
    """What one library's disassembly holds: instruction count and the offending ones."""

    library: str
    instructions: int = 0
    ymm: int = 0  # ymm operands: the AVX2 baseline is really used
    found: dict[str, list[str]] = field(default_factory=lambda: {"amx": [], "avx512": []})
    counts: dict[str, int] = field(default_factory=lambda: {"amx": 0, "avx512": 0})


def scan_disassembly(library: str, text: str) -> Scan:
    """Classify the instructions of objdump's output; keep the first few of each kind."""
    scan = Scan(library, instructions=text.count(":\t"), ymm=text.count("%ymm"))
    starts = sorted({text.rfind("\n", 0, m.start()) + 1
                     for rx in _SUSPECTS for m in rx.finditer(text)})
    for start in starts:
        end = text.find("\n", start)
        m = _INSN.match(text[start:end if end >= 0 else len(text)])
        kind = classify(m.group(2)) if m else None
        if m is None or kind is None:
            continue
        scan.counts[kind] += 1
        if len(scan.found[kind]) < SHOWN:
            header = text.rfind(">:\n", 0, start)
            function = text[text.rfind("<", 0, header) + 1:header] if header >= 0 else "?"
            scan.found[kind].append(f"0x{m.group(1)} in {function}: {m.group(2).strip()}")
    return scan


def objdump(path: Path, library: str) -> Scan:
    proc = subprocess.run([*OBJDUMP, str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"objdump failed on {path} (exit {proc.returncode}): {proc.stderr.strip()}")
    return scan_disassembly(library, proc.stdout)


def runner() -> Path:
    """The llama-server binary of this environment, built by scripts/setup.sh."""
    path = Path(sys.prefix) / "bin" / "llama-server"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run scripts/setup.sh")
    return path


@pytest.fixture(scope="module")
def scan() -> Scan:
    """One objdump of the runner per test run (a few seconds)."""
    if shutil.which("objdump") is None:
        pytest.fail("objdump is not on PATH: install binutils (apt-get install binutils) "
                    "to check the llama.cpp build")
    result = objdump(runner(), "llama-server")
    assert result.instructions > 0, "objdump printed no instructions for llama-server"
    return result


def offenders(scans: list[Scan], kind: str) -> str:
    label = {"amx": "AMX", "avx512": "AVX-512"}[kind]
    return "\n".join(
        f"{s.library}: {s.counts[kind]} {label} instructions, first:\n    "
        + "\n    ".join(s.found[kind]) for s in scans if s.counts[kind])


def test_the_runner_contains_no_amx_tile_instructions(scan: Scan) -> None:
    bad = offenders([scan], "amx")
    assert not bad, ("llama-server was built with AMX kernels (SIGILL on OpenMP threads on AMX "
                     "Xeons, issue 8): rebuild it with scripts/setup.sh\n" + bad)


def test_the_runner_contains_no_avx512_instructions(scan: Scan) -> None:
    bad = offenders([scan], "avx512")
    assert not bad, ("llama-server was built with AVX-512 (SIGILL on machines without it): "
                     "rebuild it with scripts/setup.sh\n" + bad)


def test_the_runner_uses_the_avx2_baseline(scan: Scan) -> None:
    # The scan really read machine code, and the build is not a slow pre-AVX2 one.
    assert scan.ymm > 1000, scan.ymm


def test_one_cpu_backend_linked_in_so_every_cpu_makes_the_same_choices() -> None:
    """llama.cpp is linked into the runner (no libggml or libllama beside it, so no
    GGML_BACKEND_DL variants picked by cpuid at run time): ggml chooses its kernels and which
    weights it repacks at compile time (`ggml_cpu_has_avx2` and the like are `#if`s), and the
    same binary holds the same memory on an AMD EPYC and on an Intel Xeon, which is what keeps
    the footprint estimate true on both (issue 13)."""
    linked = subprocess.run(["ldd", str(runner())], capture_output=True, text=True,
                            check=True).stdout
    assert "libc.so" in linked, linked  # ldd read it
    assert not any(name in linked for name in ("libggml", "libllama")), linked


def test_the_build_carries_packserves_patches() -> None:
    """The installed runner was built with every patch in scripts/patches/ as it is now
    (setup.sh records their checksums with the build and beside the install)."""
    root = Path(__file__).resolve().parents[1]
    recorded = root / ".venv" / ".llama-server-patches"
    assert recorded.is_file(), f"{recorded} is missing: run scripts/setup.sh"
    built = {name: digest for digest, name in
             (line.split() for line in recorded.read_text().splitlines())}
    now = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted((root / "scripts" / "patches").glob("*.patch"))}
    assert now and built == now, (
        f"llama-server was built with patches {built}, scripts/patches/ has {now}: "
        f"run scripts/setup.sh")


def test_the_metadata_patch_is_in_the_runner() -> None:
    """scripts/patches/llama-cpp-python-metadata-dump.patch, read from the binary itself: the
    loader's metadata log stops formatting a tokenizer array at its 40 shown characters. The
    patched function takes a third argument, the limit (a size_t). (The special-token patch
    changes no symbol.)"""
    if shutil.which("nm") is None:
        pytest.fail("nm is not on PATH: install binutils (apt-get install binutils)")
    symbols = subprocess.run(["nm", "--defined-only", "--demangle", str(runner())],
                             capture_output=True, text=True, check=True).stdout
    names = [line.split(" ", 2)[-1] for line in symbols.splitlines()
             if "gguf_kv_to_str" in line]
    assert names and all("(gguf_context const*, int, unsigned long)" in n for n in names), (
        f"llama-server was built without scripts/patches/ (gguf_kv_to_str: {names}): "
        f"rebuild it with scripts/setup.sh")


# --- the matcher itself --------------------------------------------------------------------

SAMPLE = """\

libggml-cpu.so:     file format elf64-x86-64


Disassembly of section .text:

0000000000013210 <_Z19tiled_run_microtileILi16ELb0ELi4ELb1EEv@plt>:
   13210:\tjmp    *0x129eda(%rip)        # 13d0f0 <tiled_run_microtile@@Base+0xc40d0>

00000000000a1000 <ggml_backend_amx_mul_mat>:
   a1000:\tldtilecfg (%rax)
   a1004:\ttilezero %tmm0
   a1008:\ttileloadd (%rsi,%rdx,1),%tmm1
   a100f:\ttdpbssd %tmm2,%tmm1,%tmm0
   a1014:\ttilerelease
   a1018:\tcall   a2000 <tilezero_helper>

00000000000b2000 <ggml_vec_dot_q4_0_q8_0>:
   b2000:\tvfmadd231ps %zmm1,%zmm2,%zmm0
   b2006:\tvmovups (%rdi),%ymm0{%k1}{z}
   b200c:\tkmovw  %eax,%k2
   b2010:\tvaddps %ymm1,%ymm2,%ymm0
   b2014:\tvfmadd231ps %ymm1,%ymm2,%ymm0
   b2019:\tvpternlogd $0x96,%ymm2,%ymm1,%ymm0
   b201f:\tvpxord %xmm17,%xmm17,%xmm17
   b2025:\t{vex} vpdpbusd %ymm2,%ymm1,%ymm0
   b202b:\tvpdpbusd %ymm2,%ymm1,%ymm0
   b2031:\tvcvtps2ph $0x0,%ymm0,%xmm1
   b2037:\tvaddps 0x10(%rax){1to8},%ymm1,%ymm0
   b203f:\ttzcnt  %eax,%eax
"""


def test_the_matcher_classifies_sample_disassembly() -> None:
    scan = scan_disassembly("libggml-cpu.so", SAMPLE)
    assert scan.instructions == 19
    assert scan.counts == {"amx": 5, "avx512": 7}
    assert scan.found["amx"][0] == "0xa1000 in ggml_backend_amx_mul_mat: ldtilecfg (%rax)"
    avx512 = [line.split(": ", 1)[1] for line in scan.found["avx512"]]
    assert avx512 == ["vfmadd231ps %zmm1,%zmm2,%zmm0", "vmovups (%rdi),%ymm0{%k1}{z}",
                      "kmovw  %eax,%k2", "vpternlogd $0x96,%ymm2,%ymm1,%ymm0",
                      "vpxord %xmm17,%xmm17,%xmm17", "vpdpbusd %ymm2,%ymm1,%ymm0",
                      "vaddps 0x10(%rax){1to8},%ymm1,%ymm0"]
    assert scan.ymm == 19


# What `as` assembles and objdump prints back: the matcher reads real objdump text.
FLAGGED = {
    "amx": ["ldtilecfg (%rax)", "sttilecfg (%rax)", "tilezero %tmm0",
            "tileloadd (%rsi,%rdx,1), %tmm1", "tileloaddt1 (%rsi,%rdx,1), %tmm1",
            "tilestored %tmm1, (%rsi,%rdx,1)", "tdpbssd %tmm2, %tmm1, %tmm0",
            "tdpbsud %tmm2, %tmm1, %tmm0", "tdpbusd %tmm2, %tmm1, %tmm0",
            "tdpbuud %tmm2, %tmm1, %tmm0", "tdpbf16ps %tmm2, %tmm1, %tmm0",
            "tdpfp16ps %tmm2, %tmm1, %tmm0", "tilerelease"],
    "avx512": ["vaddps %zmm1, %zmm2, %zmm0", "vmovups (%rdi), %ymm0{%k1}{z}",
               "kmovw %eax, %k1", "vpxord %xmm17, %xmm17, %xmm17",
               "vpternlogd $0x96, %ymm2, %ymm1, %ymm0", "vpermt2ps %ymm2, %ymm1, %ymm0",
               "vaddps (%rax){1to8}, %ymm1, %ymm0", "vmovdqu64 (%rdi), %ymm0",
               "vpmovdb %ymm0, %xmm1", "vextracti32x4 $1, %ymm0, %xmm1",
               "vcvtps2udq %ymm0, %ymm1", "vpdpbusd %ymm2, %ymm1, %ymm0",
               "vdpbf16ps %ymm2, %ymm1, %ymm0", "vrcp14ps %ymm0, %ymm1",
               "vaddps {rn-sae}, %zmm1, %zmm2, %zmm0", "vpcmpud $1, %ymm1, %ymm0, %k1"],
}
CLEAN = ["vaddps %ymm1, %ymm2, %ymm0", "vfmadd231ps (%rdi), %ymm1, %ymm0",
         "vpand %ymm1, %ymm2, %ymm0", "vpmaddubsw %ymm1, %ymm2, %ymm0",
         "vcvtps2ph $0, %ymm0, %xmm1", "vcvtph2ps %xmm1, %ymm0", "vpcmpeqb %ymm1, %ymm2, %ymm0",
         "vpbroadcastd %xmm0, %ymm0", "vextracti128 $1, %ymm0, %xmm1",
         "vpermps %ymm1, %ymm2, %ymm0",
         "vmovdqu (%rdi), %ymm0", "tzcnt %eax, %eax", "shlx %eax, %ebx, %ecx", "vzeroupper",
         "{vex} vpdpbusd %ymm2, %ymm1, %ymm0", "call tilezero_helper", "test %eax, %eax"]


def test_the_matcher_reads_what_objdump_prints(tmp_path: Path) -> None:
    if shutil.which("as") is None or shutil.which("objdump") is None:
        pytest.fail("as/objdump not on PATH: install binutils")
    lines = [*(i for kind in FLAGGED.values() for i in kind), *CLEAN]
    src = tmp_path / "sample.s"
    src.write_text(".text\n.globl tilezero_helper\ntilezero_helper:\n"
                   + "".join(f"\t{line}\n" for line in lines), "utf-8")
    obj = tmp_path / "sample.o"
    subprocess.run(["as", "-o", str(obj), str(src)], check=True, capture_output=True)
    out = subprocess.run([*OBJDUMP, str(obj)], check=True, capture_output=True,
                         text=True).stdout
    printed = [m.group(2).strip() for m in map(_INSN.match, out.splitlines()) if m]
    assert len(printed) == len(lines), out
    got = [classify(insn) for insn in printed]
    want = [kind for kind, insns in FLAGGED.items() for _ in insns] + [None] * len(CLEAN)
    wrong = [(insn, g, w) for insn, g, w in zip(printed, got, want, strict=True) if g != w]
    assert not wrong, wrong
    # The whole-text scan finds each of them too (its prefilter misses none).
    scan = scan_disassembly("sample.o", out)
    assert scan.counts == {kind: len(insns) for kind, insns in FLAGGED.items()}
    assert scan.instructions == len(lines)
