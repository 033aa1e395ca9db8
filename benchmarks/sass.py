"""What the sm_90 kernel tools (benchmarks/*_kernel_sass.py) share: a compiled kernel's cubin read by Triton's bundled
cuobjdump (registers, spill stack, SASS), the main loop found in the SASS (the longest backward branch's body) and
its opcode counts. Runs without a GPU."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
TARGET = GPUTarget("cuda", 90, 32)


class Sm90Driver:
    """Just enough of a Triton driver for JITFunction.run to specialize a launch and compile it for TARGET on a
    machine without a GPU (the tools catch the launch before anything runs)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def cubin_report(cubin: bytes) -> tuple[int, int, str]:
    """(registers per thread, stack bytes per thread, SASS text) of a cubin."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(m.group(1)), int(m.group(2)), sass


def instructions(sass: str) -> list[str]:
    return [line for line in sass.splitlines() if _INSTRUCTION.match(line)]


def loops(sass: str) -> list[list[str]]:
    """Every loop body (a backward branch's range) of the SASS, longest first; branch targets as addresses or as
    `(.L_x_N)` labels."""
    flat = instructions(sass)
    addr = [int(_INSTRUCTION.match(line).group(1), 16) for line in flat]
    bodies = []
    for i, line in enumerate(flat):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", line)
        if m and m.group(1) and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            bodies.append(flat[addr.index(int(m.group(1), 16)):i + 1])
    if not bodies:  # labels instead of addresses: match `(.L_x_N)` targets to their label lines
        labels, pos = {}, 0
        for line in sass.splitlines():
            lab = re.match(r"\.L_x_(\d+):", line.strip())
            if lab:
                labels[lab.group(1)] = pos
            elif _INSTRUCTION.match(line):
                pos += 1
        for i, line in enumerate(flat):
            m = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", line)
            if m and m.group(1) in labels and labels[m.group(1)] <= i:
                bodies.append(flat[labels[m.group(1)]:i + 1])
    return sorted(bodies, key=len, reverse=True)


def opcodes(body: list[str]) -> collections.Counter:
    """Opcode counts of SASS lines (the predicate and the modifiers dropped: `@!P0 LDG.E.128` counts as LDG)."""
    return collections.Counter(re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", b).split()[0].split(".")[0]
                               for b in body)


def loop_mix(sass: str, names: tuple[str, ...]) -> dict:
    """The main loop's length and the counts of `names` in it (zeros kept)."""
    bodies = loops(sass)
    body = bodies[0] if bodies else []
    ops = opcodes(body)
    return {"instructions": len(body), **{n: ops[n] for n in names}}


def compile_sass(fn, types: dict, consts: dict, warps: int, stages: int, maxnreg: int | None):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # as a launch specializes them at these shapes: pointers and strides divisible by 16 (not the KV heads, 8, the
    # position offset or the split count)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n not in ("HKV", "POS0", "NSPLIT"))}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=TARGET, options=options)
    registers, stack, sass = cubin_report(k.asm["cubin"])
    return registers, stack, k.metadata.shared, sass
