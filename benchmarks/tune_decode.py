"""Time kernel variants of decode attention at one shape (default 32K context, batch 8) against bf16 SDPA in
the same process: how block_t / num_warps / num_stages / splits / rope_mode move each codec. Results as a
table and JSON (benchmarks/NOTES-kernels.md records what was run and why).

    python benchmarks/tune_decode.py --out /tmp/tune.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.runtime.bench import copy_bandwidth, storage_for, time_sdpa, time_storage  # noqa: E402

RECIPES = {"int": "rtn-int{bits}", "kivi": "kivi-{bits}bit", "nuq": "kvquant-nuq{bits}-1pct"}  # the variants' names
VARIANT_SETS = {}  # rounds 1-6: kivi rows with block_t 64 timed two-block tiles, since removed (KIVI tiles now
# lie inside one key block, so block_t 64 runs as 32)
VARIANT_SETS["round1"] = [
    ("int", 4, {}), ("int", 3, {}), ("int", 2, {}), ("kivi", 4, {}), ("kivi", 3, {}), ("kivi", 2, {}),
    ("nuq", 4, {}), ("nuq", 3, {}), ("nuq", 2, {}),
    ("int", 4, {"block_t": 128, "num_warps": 8}), ("int", 4, {"block_t": 64, "num_warps": 8}),
    ("int", 4, {"num_stages": 2}), ("int", 4, {"num_stages": 4}), ("int", 4, {"programs_per_sm": 8}),
    ("int", 4, {"programs_per_sm": 2}), ("int", 2, {"block_t": 128, "num_warps": 8}),
    ("kivi", 4, {"block_t": 32, "num_warps": 2}),
    ("nuq", 4, {"rope_mode": "table"}), ("nuq", 4, {"block_t": 64, "num_warps": 8}),
]
VARIANT_SETS["round2"] = [
    ("int", 4, {}), ("int", 4, {"window": 0}), ("int", 4, {"programs_per_sm": 8}), ("int", 4, {"programs_per_sm": 16}),
    ("int", 4, {"num_stages": 2}), ("int", 4, {"num_stages": 4, "programs_per_sm": 8}),
    ("int", 4, {"block_t": 128, "num_warps": 4, "programs_per_sm": 8}),
    ("int", 4, {"block_t": 128, "num_warps": 8, "programs_per_sm": 8}),
    ("int", 4, {"block_t": 64, "num_warps": 2, "programs_per_sm": 8}),
    ("int", 4, {"block_t": 32, "num_warps": 1, "programs_per_sm": 16}),
    ("int", 2, {}), ("int", 2, {"programs_per_sm": 8}), ("kivi", 4, {}), ("kivi", 4, {"programs_per_sm": 8}),
    ("nuq", 4, {}),
]
VARIANT_SETS["round3"] = [
    ("int", 4, {}), ("int", 4, {"max_registers": 128}), ("int", 4, {"max_registers": 96}),
    ("int", 4, {"num_warps": 1, "block_t": 32}), ("int", 4, {"num_warps": 1, "block_t": 32, "programs_per_sm": 32}),
    ("int", 4, {"programs_per_sm": 32}), ("int", 4, {"num_stages": 2, "max_registers": 128}),
    ("int", 3, {}), ("int", 2, {}), ("kivi", 4, {}), ("kivi", 2, {}), ("nuq", 4, {}), ("nuq", 4, {"block_t": 16}),
]
VARIANT_SETS["round4"] = [
    ("int", 4, {"num_warps": 4, "block_t": 64}), ("int", 4, {"num_warps": 1, "block_t": 32}),
    ("int", 4, {"num_warps": 1, "block_t": 64}), ("int", 4, {"num_warps": 2, "block_t": 64}),
    ("int", 4, {"num_warps": 1, "block_t": 32, "max_registers": 128}),
    ("int", 4, {"num_warps": 1, "block_t": 32, "programs_per_sm": 32}),
    ("int", 2, {"num_warps": 1, "block_t": 32}), ("int", 2, {"num_warps": 4, "block_t": 64}),
    ("int", 3, {"num_warps": 1, "block_t": 32}), ("int", 3, {"num_warps": 4, "block_t": 64}),
    ("kivi", 4, {"num_warps": 4, "block_t": 64}), ("kivi", 4, {"num_warps": 2, "block_t": 64}),
    ("kivi", 2, {"num_warps": 4, "block_t": 64}),
]
VARIANT_SETS["round5"] = [
    ("int", 4, {"num_warps": 1, "block_t": 64}), ("int", 4, {"num_warps": 1, "block_t": 32, "num_stages": 2, "max_registers": 128}),
    ("int", 4, {"num_warps": 1, "block_t": 32, "num_stages": 1, "max_registers": 128}),
    ("int", 4, {"num_warps": 1, "block_t": 32, "num_stages": 2, "max_registers": 96}),
    ("int", 2, {"num_warps": 1, "block_t": 64}), ("int", 2, {"num_warps": 1, "block_t": 32, "num_stages": 2, "max_registers": 128}),
    ("int", 3, {"num_warps": 1, "block_t": 64}), ("int", 3, {"num_warps": 1, "block_t": 32, "num_stages": 2, "max_registers": 128}),
    ("kivi", 4, {"max_registers": 168}), ("kivi", 4, {"max_registers": 128}), ("kivi", 4, {"num_stages": 2, "max_registers": 168}),
    ("nuq", 4, {"num_stages": 2}), ("nuq", 4, {"num_stages": 1}),
]
VARIANT_SETS["round6"] = [  # generic path with the heads padded to 4 instead of 16 (mma.sync)
    ("nuq", 4, {}), ("nuq", 4, {"block_t": 64, "num_warps": 4, "num_stages": 2}),
    ("nuq", 4, {"block_t": 32, "num_warps": 2, "num_stages": 2}), ("nuq", 4, {"block_t": 32, "num_warps": 1, "num_stages": 2}),
    ("nuq", 4, {"block_t": 16, "num_warps": 1, "num_stages": 2}), ("nuq", 4, {"block_t": 64, "num_warps": 2, "num_stages": 2}),
    ("nuq", 4, {"block_t": 32, "num_warps": 4, "num_stages": 2, "max_registers": 128}),
    ("nuq", 4, {"block_t": 32, "num_warps": 4, "num_stages": 1}), ("nuq", 4, {"programs_per_sm": 8}),
    ("nuq", 4, {"programs_per_sm": 32}), ("nuq", 2, {}), ("nuq", 2, {"block_t": 32, "num_warps": 2, "num_stages": 2}),
]
ONE_WARP = {"block_t": 32, "num_warps": 1, "num_stages": 2, "max_registers": 128}  # the int path's default
VARIANT_SETS["round7"] = [  # kivi with a tile inside one key block (q scaled once per tile, no column groups)
    ("int", 4, {}), ("kivi", 4, {}), ("kivi", 4, ONE_WARP), ("kivi", 4, {**ONE_WARP, "max_registers": 168}),
    ("kivi", 4, {"block_t": 32, "num_warps": 1, "num_stages": 2}), ("kivi", 4, {"block_t": 32, "num_warps": 1}),
    ("kivi", 4, {"block_t": 32, "num_warps": 2, "num_stages": 2}), ("kivi", 4, {"block_t": 32, "num_warps": 4}),
    ("kivi", 4, {"block_t": 16, "num_warps": 1, "num_stages": 2}), ("kivi", 3, {}), ("kivi", 3, ONE_WARP),
    ("kivi", 2, {}), ("kivi", 2, ONE_WARP),
]
NO_CAP = {"block_t": 32, "num_warps": 1, "num_stages": 2}
# rounds 8 and 9 timed a kernel option of that session, since removed (benchmarks/NOTES-kernels.md)
VARIANT_SETS["round8"] = [  # + value groups as a batched dot (accumulator [D, heads] instead of [D, 4 x heads])
    ("int", 4, {}), ("kivi", 4, {}), ("kivi", 4, ONE_WARP), ("kivi", 4, NO_CAP),
    ("kivi", 4, {**ONE_WARP, "max_registers": 96}), ("kivi", 4, {**NO_CAP, "num_stages": 3}),
    ("kivi", 4, {**NO_CAP, "block_t": 64}), ("kivi", 4, {**ONE_WARP, "block_t": 64}),
    ("kivi", 4, {"block_t": 32, "num_warps": 2, "num_stages": 2}), ("kivi", 4, {**NO_CAP, "programs_per_sm": 32}),
    ("kivi", 3, ONE_WARP), ("kivi", 3, NO_CAP), ("kivi", 2, ONE_WARP), ("kivi", 2, NO_CAP), ("int", 4, {}),
]
OFF = {"batched_value_groups": False}
VARIANT_SETS["round9"] = [  # value groups batched (default) or as columns, in the same run
    ("int", 4, {}), ("kivi", 4, NO_CAP), ("kivi", 4, {**NO_CAP, **OFF}), ("kivi", 4, {**NO_CAP, "num_stages": 3}),
    ("kivi", 4, {**NO_CAP, "num_stages": 3, **OFF}), ("kivi", 4, {**NO_CAP, "programs_per_sm": 32}),
    ("kivi", 4, {**NO_CAP, "programs_per_sm": 32, **OFF}), ("kivi", 4, {**NO_CAP, "num_stages": 3, "programs_per_sm": 32}),
    ("kivi", 4, {**NO_CAP, "num_stages": 3, "programs_per_sm": 32, **OFF}), ("kivi", 4, {**ONE_WARP, "max_registers": 168}),
    ("kivi", 2, {**NO_CAP, "num_stages": 3, "programs_per_sm": 32}),
    ("kivi", 2, {**NO_CAP, "num_stages": 3, "programs_per_sm": 32, **OFF}),
    ("kivi", 3, {**NO_CAP, "num_stages": 3, "programs_per_sm": 32}),
    ("int", 4, {"num_stages": 3}), ("int", 4, {"programs_per_sm": 32}), ("int", 2, {}), ("int", 2, {"num_stages": 3}),
    ("int", 4, {}),
]
VARIANT_SETS["round10"] = [  # unpack by masks in place + kWidth-2 operands (fewer instructions per tile)
    ("int", 4, {}), ("int", 4, {**ONE_WARP, "max_registers": 96}), ("int", 4, NO_CAP), ("int", 4, {"num_stages": 3}),
    ("int", 4, {"programs_per_sm": 32}), ("int", 4, {**ONE_WARP, "block_t": 64}),
    ("int", 4, {"block_t": 64, "num_warps": 4, "num_stages": 2}), ("int", 4, {"block_t": 64, "num_warps": 2, "num_stages": 2}),
    ("int", 2, {}), ("int", 2, {"num_stages": 3}), ("int", 2, {**ONE_WARP, "block_t": 64}), ("int", 2, {**ONE_WARP, "max_registers": 96}),
    ("int", 3, {}), ("kivi", 4, {}), ("kivi", 4, {**NO_CAP, "max_registers": 168}), ("kivi", 4, {**NO_CAP, "num_stages": 2}),
    ("kivi", 4, {**NO_CAP, "programs_per_sm": 32}), ("kivi", 2, {}), ("kivi", 3, {}), ("nuq", 4, {}),
]
# round 11 timed a kernel option of that session (code words loaded into registers one tile ahead), since removed
VARIANT_SETS["round11"] = [
    ("int", 4, {}), ("int", 4, {**ONE_WARP, "max_registers": 168}), ("int", 4, NO_CAP), ("int", 4, {**ONE_WARP, "num_stages": 1}),
    ("int", 4, {**ONE_WARP, "max_registers": 168, "num_stages": 1}), ("int", 4, {"block_t": 64, "num_warps": 2, "num_stages": 2}),
    ("int", 2, {}), ("int", 2, {**ONE_WARP, "max_registers": 168}), ("int", 2, {**ONE_WARP, "num_stages": 1}),
    ("int", 3, {}), ("kivi", 4, {}), ("kivi", 4, {**NO_CAP, "num_stages": 1}), ("kivi", 4, {**ONE_WARP, "max_registers": 168}),
    ("kivi", 2, {}), ("kivi", 3, {}),
]
VARIANT_SETS["round12"] = [  # register caps that fit more one-warp programs per SM after round 10 (18 at 112, 19 at 104)
    ("int", 4, {}), ("int", 4, {**ONE_WARP, "max_registers": 112, "programs_per_sm": 18}),
    ("int", 4, {**ONE_WARP, "max_registers": 104, "programs_per_sm": 19}), ("int", 4, {**ONE_WARP, "max_registers": 112}),
    ("int", 2, {}), ("int", 2, {**ONE_WARP, "max_registers": 112, "programs_per_sm": 18}),
    ("int", 3, {}), ("int", 3, {**ONE_WARP, "max_registers": 112, "programs_per_sm": 18}),
    ("kivi", 4, {}), ("kivi", 4, {**NO_CAP, "programs_per_sm": 8}), ("kivi", 4, {**NO_CAP, "max_registers": 168, "programs_per_sm": 12}),
    ("kivi", 2, {}), ("kivi", 2, {**NO_CAP, "programs_per_sm": 8}), ("int", 4, {}),
]
VARIANT_SETS["round13"] = [  # unpacked codes stored to shared memory without bank conflicts (words reordered)
    ("int", 4, {}), ("int", 4, {**ONE_WARP, "num_stages": 1}), ("int", 4, {"num_stages": 3}),
    ("int", 4, {**ONE_WARP, "max_registers": 112, "programs_per_sm": 18}), ("int", 4, {"programs_per_sm": 32}),
    ("int", 2, {}), ("int", 2, {**ONE_WARP, "num_stages": 1}), ("int", 2, {"num_stages": 3}),
    ("int", 3, {}), ("int", 3, {**ONE_WARP, "num_stages": 1}),
    ("kivi", 4, {}), ("kivi", 4, {**NO_CAP, "num_stages": 1}), ("kivi", 4, {**NO_CAP, "num_stages": 2}),
    ("kivi", 2, {}), ("kivi", 3, {}), ("int", 4, {}),
]
VARIANT_SETS["round14"] = [  # round 13's candidates again, meant for --repeat (round 13's single pass drifted)
    ("int", 4, {}), ("int", 4, {**ONE_WARP, "num_stages": 1}), ("int", 2, {}), ("int", 2, {**ONE_WARP, "num_stages": 1}),
    ("int", 3, {}), ("int", 3, {**ONE_WARP, "num_stages": 1}), ("kivi", 4, {}), ("kivi", 4, {**NO_CAP, "num_stages": 1}),
    ("kivi", 4, {**NO_CAP, "num_stages": 2}), ("kivi", 2, {}), ("kivi", 2, {**NO_CAP, "num_stages": 1}), ("kivi", 3, {}),
]
VARIANT_SETS["round15"] = [  # L2 prefetch of the code tiles `prefetch` tiles ahead (CUDA-graph timing, --repeat 2)
    ("int", 4, {}), ("int", 4, {"prefetch": 1}), ("int", 4, {"prefetch": 2}), ("int", 4, {"prefetch": 4}),
    ("int", 4, {"prefetch": 8}), ("int", 2, {}), ("int", 2, {"prefetch": 2}), ("int", 2, {"prefetch": 4}),
    ("int", 2, {"prefetch": 8}), ("int", 3, {}), ("int", 3, {"prefetch": 4}), ("kivi", 4, {}), ("kivi", 4, {"prefetch": 2}),
    ("kivi", 4, {"prefetch": 4}), ("kivi", 2, {}), ("kivi", 2, {"prefetch": 4}), ("nuq", 4, {}), ("nuq", 4, {"prefetch": 4}),
    ("int", 4, {**ONE_WARP, "num_stages": 1, "prefetch": 4}), ("int", 2, {**ONE_WARP, "num_stages": 1, "prefetch": 4}),
]
VARIANT_SETS["round16"] = [  # 3-bit codes paired in place; prefetch one tile ahead (CUDA-graph timing, --repeat 2)
    ("int", 4, {}), ("int", 4, {"prefetch": 1}), ("int", 2, {}), ("int", 2, {"prefetch": 1}), ("int", 3, {}),
    ("int", 3, {"prefetch": 1}), ("int", 3, {**ONE_WARP, "num_stages": 1}), ("kivi", 4, {}), ("kivi", 4, {"prefetch": 1}),
    ("kivi", 2, {}), ("kivi", 2, {"prefetch": 1}), ("kivi", 2, {"prefetch": 2}), ("kivi", 3, {}), ("kivi", 3, {"prefetch": 1}),
    ("nuq", 4, {}), ("nuq", 4, {"prefetch": 1}), ("nuq", 4, {"prefetch": 2}),
]
VARIANT_SETS["round17"] = [  # nuq: table values straight into fp16 operands (lut_mma) against the float32 generic path
    ("nuq", 4, {"lut_mma": False}), ("nuq", 4, {}), ("nuq", 4, {"num_warps": 1, "block_t": 32}),
    ("nuq", 4, {"num_warps": 2, "block_t": 32}), ("nuq", 4, {"num_warps": 4, "block_t": 64}),
    ("nuq", 4, {"num_warps": 1, "block_t": 16}), ("nuq", 4, {"num_warps": 2, "block_t": 64}),
    ("nuq", 4, {"num_warps": 4, "block_t": 32, "num_stages": 3}), ("nuq", 3, {}), ("nuq", 2, {}),
    ("nuq", 3, {"lut_mma": False}), ("nuq", 2, {"lut_mma": False}), ("int", 4, {}),
]
VARIANT_SETS["round18"] = [  # lut_mma with key outliers read from memory (since reverted: re-running this set times
    # the current code): one-warp tiles
    ("nuq", 4, {"num_warps": 1, "block_t": 16}), ("nuq", 4, {"num_warps": 1, "block_t": 16, "num_stages": 3}),
    ("nuq", 4, {"num_warps": 1, "block_t": 16, "programs_per_sm": 32}),
    ("nuq", 4, {"num_warps": 1, "block_t": 16, "max_registers": 128}),
    ("nuq", 4, {"num_warps": 1, "block_t": 16, "prefetch": 0}), ("nuq", 4, {"num_warps": 1, "block_t": 32}),
    ("nuq", 4, {"num_warps": 2, "block_t": 32}), ("nuq", 4, {}),
]
VARIANT_SETS["round19"] = [  # lut_mma, lane table entries loaded once per program (correct without outliers too)
    ("nuq", 4, {"lut_mma": False}), ("nuq", 4, {}), ("nuq", 4, {"num_warps": 2, "block_t": 32}),
    ("nuq", 4, {"num_warps": 4, "block_t": 32}), ("nuq", 4, {"num_warps": 1, "block_t": 32}),
    ("nuq", 3, {}), ("nuq", 3, {"num_warps": 2, "block_t": 32}), ("nuq", 2, {}), ("nuq", 2, {"num_warps": 2, "block_t": 32}),
]
VARIANT_SETS["round20"] = [  # three pipeline stages (a load gets a whole iteration; two stages wait for it at the
    # top of the next one), split counts that fit one wave at the occupancy the shared memory allows
    ("int", 4, {}), ("int", 4, {"num_splits": 32}), ("int", 4, {"num_stages": 3, "num_splits": 19}),
    ("int", 4, {"num_stages": 3, "num_splits": 19, "max_registers": 200}),
    ("int", 4, {"num_stages": 3, "num_splits": 19, "prefetch": 2}), ("int", 4, {"num_stages": 3, "num_splits": 19, "prefetch": 0}),
    ("int", 4, {"num_stages": 4, "num_splits": 13, "max_registers": 200}),
    ("int", 2, {}), ("int", 2, {"num_stages": 3, "num_splits": 19}), ("int", 2, {"num_stages": 3, "num_splits": 19, "max_registers": 200}),
    ("int", 2, {"num_stages": 3, "num_splits": 19, "prefetch": 2}), ("kivi", 4, {}), ("kivi", 2, {}),
    ("nuq", 4, {}), ("nuq", 4, {"num_splits": 15}), ("nuq", 4, {"num_splits": 31}),
]
VARIANT_SETS["round21"] = [  # lut_mma: code words and key-outlier slots loaded one tile ahead into registers
    # (then off by default with value outliers; since round30, where the outliers left the kernel, on by default)
    ("nuq", 4, {}), ("nuq", 4, {"lut_ahead": True}), ("nuq", 4, {"lut_mma": False}), ("nuq", 3, {}), ("nuq", 2, {}),
    ("nuq", 3, {"lut_ahead": True}), ("nuq", 2, {"lut_ahead": True}), ("int", 4, {}),
]
VARIANT_SETS["round30"] = [  # sparse outliers as passes around the kernel (attention_outliers); look-ahead now on
    ("nuq", 4, {}), ("nuq", 4, {"lut_ahead": False}), ("nuq", 4, {"lut_mma": False}), ("nuq", 3, {}), ("nuq", 2, {}),
    ("nuq", 2, {"lut_ahead": False}), ("int", 4, {}),
]
VARIANT_SETS["round22"] = [  # attention_frag: vector code loads, and the occupancy by register cap (FRAG_OCCUPANCY);
    # the round's L2-prefetch variants (frag_prefetch) were removed with the knob
    ("int", 4, {}), ("int", 4, {"frag_vector": False}), ("int", 4, {"max_registers": 204, "programs_per_sm": 10}),
    ("int", 2, {}), ("int", 2, {"frag_vector": False}), ("int", 2, {"programs_per_sm": 12}),
]
# round23 timed key codes masked in place against shifted (frag_key_inplace, each twice, alternating; 32K x 8 and
# 131K x 32): faster at both, so it became the only path and the knob went (tune-h100-round23*.json)
# round24 timed per-token scales loaded unmasked from lane pointers against masked loads (a frag_tile_scales knob,
# since removed; 522 -> 449 SASS instructions per int2 tile, 586 -> 511 at int4), each twice, alternating: int2 88.0 ->
# 82.6 us, int4 122.7 -> 122.5 at 32K x 8 (tune-h100-round24*.json)
# round25 timed code words loaded two tiles ahead instead of one (a frag_ahead knob, since removed): slower at every
# register cap (int2 87.6-109.6 against 82.2 us at 32K x 8, int4 129.6-161.8 against 122.2; tune-h100-round25*.json)
VARIANT_SETS["round26"] = [  # attention_frag: constexpr row strides (immediate load offsets) and row masks only in
    # a split's last tile (int2 449 -> 406 SASS instructions per tile, int4 511 -> 441), defaults twice
    ("int", 4, {}), ("int", 2, {}), ("int", 4, {}), ("int", 2, {}),
]
# round27 timed a lane's four tokens of a tile adjacent, their per-token scales one 8-byte load per parameter (a
# frag_lane_tokens knob, since removed; int2 406 -> 399 SASS instructions per tile, 126 -> 116 registers, int4 441 ->
# 415, 153 -> 150), each twice, alternating: int4 122.4 -> 121.8 us, int2 82.2 -> 81.8 at 32K x 8, int2 918.4 -> 894.5
# at 131K x 32; the occupancies the freed registers allow were slower (int2 17 programs per SM under 120 registers
# 101.1 us, int4 13 under 152 147.8, 14 under 144 145.2: more programs than fit at once, a second wave, see round28) (tune-h100-round27-*.json)
VARIANT_SETS["round28"] = [  # attention_frag: one more program per SM than FRAG_OCCUPANCY (the register counts of
    # round27 seemed to allow it): a second wave instead, since each of the 4 schedulers holds 16K registers
    ("int", 4, {}), ("int", 4, {"programs_per_sm": 13}), ("int", 2, {}), ("int", 2, {"programs_per_sm": 17}),
]
VARIANT_SETS["round29"] = [  # attention_frag: register caps that fit 4 more programs per SM (4 per scheduler at 128
    # registers for int4, 5 at 96 for int2) at the cost of spills (SASS: 9 / 18 local stores per tile)
    ("int", 4, {}), ("int", 4, {"max_registers": 128, "programs_per_sm": 16}), ("int", 2, {}),
    ("int", 2, {"max_registers": 96, "programs_per_sm": 20}),
]
DEFAULT_VARIANTS = VARIANT_SETS["round1"]


def sm_clock() -> str:
    """The SM clock and active clock-event reasons as nvidia-smi reports them (latency-bound kernels follow
    the SM clock, SDPA does not), or '?' without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks_event_reasons.active", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default=None, help="JSON list of [codec, bits, options], or a set name")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=1,
                    help="time the whole list (and SDPA) this many times, interleaved; report the median per variant")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="L2 flush before each call: zero 256 MB (do_bench's, leaves the L2 dirty) or read it")
    args = ap.parse_args(argv)
    if args.variants in VARIANT_SETS:
        variants = VARIANT_SETS[args.variants]
    else:
        variants = json.loads(args.variants) if args.variants else DEFAULT_VARIANTS
    dev = torch.device("cuda")
    name = torch.cuda.get_device_properties(dev).name
    copy = copy_bandwidth(dev)
    sdpa_runs, runs = [], [[] for _ in variants]
    for rep in range(args.repeat):
        sdpa_us, sdpa_bytes, backend = time_sdpa(args.batch, 32, 8, 128, args.context, graph=not args.eager,
                                                 flush=args.flush)
        sdpa_runs.append(sdpa_us)
        print(f"{name} (pass {rep + 1}/{args.repeat}): copy {copy:.0f} GB/s; sdpa ({backend}) {sdpa_us:.1f} us "
              f"{sdpa_bytes / sdpa_us / 1e3:.0f} GB/s; SM clock {sm_clock()}", flush=True)
        for i, (codec, bits, opts) in enumerate(variants):
            t0 = time.time()
            try:
                storage, inv_freq = storage_for(RECIPES[codec].format(bits=bits))
                us, nbytes = time_storage(storage, args.batch, 32, 8, 128, args.context, graph=not args.eager,
                                          flush=args.flush, inv_freq=inv_freq, **opts)
            except Exception as e:  # keep going: one failing variant must not lose the others
                print(f"{codec}{bits} {opts}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            runs[i].append((us, nbytes))
            print(f"{codec}{bits:<2d} {json.dumps(opts):45s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                  f"{100 * nbytes / us / 1e3 / copy:5.1f}% copy  x{sdpa_us / us:5.2f}  ({time.time() - t0:.0f} s, "
                  f"SM clock {sm_clock()})", flush=True)
    sdpa_us = statistics.median(sdpa_runs)
    rows = [dict(method="sdpa", bits=16, options={"backend": backend}, us=sdpa_us, bytes=sdpa_bytes, runs=sdpa_runs)]
    for (codec, bits, opts), r in zip(variants, runs):
        if r:
            rows.append(dict(method=codec, bits=bits, options=opts, us=statistics.median(u for u, _ in r),
                             bytes=r[0][1], runs=[u for u, _ in r]))
    for r in rows:
        r["gbps"] = r["bytes"] / r["us"] / 1e3
        r["pct_copy"] = 100 * r["gbps"] / copy
        r["speedup"] = sdpa_us / r["us"]
    res = dict(device=name, context=args.context, batch=args.batch, copy_gbps=copy, torch=torch.__version__,
               timing="eager calls" if args.eager else "CUDA graph replays", flush=args.flush, repeat=args.repeat, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\nmedians over {args.repeat} pass(es)\n| method | options | us | GB/s | % copy | x SDPA |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']}{r['bits']} | {json.dumps(r['options'])} | {r['us']:.1f} | {r['gbps']:.0f} | "
              f"{r['pct_copy']:.0f} | {r['speedup']:.2f} |")


if __name__ == "__main__":
    main()
