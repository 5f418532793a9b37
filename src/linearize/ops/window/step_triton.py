"""The sliding-window softmax's decode step on the fast decoder's ring as one Triton launch (CUDA; the ring of a
small batch read in parts, merged in the same launch).

``window_step_ring_triton`` is the twin of ``window_softmax_step_ring`` (``ops/window/__init__.py``), which
stays the reference and the CPU path. One program per (sequence, key head, part of the ring):

0. with ``position_embeddings`` (the window mixer's fast path) q and k are rotated here, RoPE by rotating
   halves in fp32, so the layer's RoPE costs no launches of its own;
1. the new key and value, cast to the ring's dtype (on a float8 ring quantised), take slot ``s = state.slot``
   (written, with ``valid[b, s]``, by the program whose part holds the slot);
2. the ``G`` query heads of the key head, one ``[BG, D]`` tile, start an online softmax (fp32 scores and
   sums) from the new token, held in registers, then take the part's other valid slots in blocks of ``BW``.
   No program reads slot ``s`` from memory, so none races with its write;
3. with one part per (sequence, key head) the program writes the output; with several parts (a small batch
   would leave most of the GPU idle) each writes its running maximum, sum and weighted values and counts
   itself in (an atomic add on the ring's ``counters``), and the last of the (sequence, key head) to arrive
   merges them into the output (``_merge``), as a split-K GEMM's last block reduces the others' partials;
4. the last (sequence, key head) to finish, counted the same way, advances the slot counter: every program has
   read it by then. The counts are left zero for the next step. (Before, a second launch did steps 3 and 4:
   one launch a layer and step more, 14 a step on the default SmolLM2 student.)

The products ``q k^T`` and ``p v`` are ``tl.dot`` tiles (the query heads padded to 16 rows, which costs
nothing in a step bound by reading the ring): for a half-precision ring their inputs are in the ring's
dtype (the query rounded to it as the reference's SDPA call does, the softmax weights as a flash kernel
rounds them) with fp32 accumulation; for an fp32 ring full fp32 products. Triton's interpreter cannot
multiply bf16 tiles: there the same rounded inputs are multiplied in fp32. ``STEP_MMA = False`` computes
both products as broadcast sums on the CUDA cores instead (fp32 throughout), for comparison.

``window_step_ring_float8_triton`` is the same kernel on a float8 ring (``float8.py``, ``FP8``), RoPE included.
The new token comes as the layer computed it: each program quantises its key head's key and value as
``float8.quantize`` does (scale ``max|x| / 448`` in fp32, ``div_rn`` divisions, e4m3 codes rounded to nearest
even by ``_e4m3_code``, bit for bit as torch's conversion), the program holding slot ``s`` writes the codes (as
bytes) and the scales there, and all take the read-back values (code times scale, rounded to q's dtype as
``dequantize`` rounds them) from registers. The ring's codes are read as bytes (a byte per element and a
float32 scale per slot: about half the bytes of a bf16 ring) and decoded (``_e4m3_value``: the GPU's own
conversion on sm_89 and later, integer arithmetic, ``_e4m3``, under the interpreter, whose NumPy has no
float8), times their slot's scale in fp32, then rounded to q's dtype as the reference reads the ring back.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..hybrid.step_triton import _rope, rope_arguments

# Ring slots per block of the loop (halved for heads over 128 wide), warps per program, the programs a step
# aims for (parts of the ring are added until it has about this many; None: four per multiprocessor), the
# products on the tensor cores (tl.dot) or as broadcast sums, and the loop's pipeline stages (None: Triton's
# default). Module constants so that ``dev/window_step_bench.py`` can sweep them: on an H200 (bf16 ring of 1,280, 9 on 3
# heads) blocks of 128 with 4 warps were the fastest or within 1 % at batch 1, 8, 64 and within 5 % at 256.
STEP_BLOCK = 128
STEP_WARPS = 4
STEP_PROGRAMS: int | None = None
STEP_MMA = True
STEP_STAGES: int | None = None
# The (products on the tensor cores, block, warps) of a float8 ring's step when it is crowded: one program per
# (sequence, key head) and at least the programs a step aims for (batch 256 on 3 key heads). On an H200, batch 256,
# the fastest tensor-core tiles of blocks 32 / 64 / 128 x warps 2 / 4 / 8: 213 against 232 µs a layer at a ring of
# 4,164 slots, 75 against 87 at 1,284; at batch 1 and 64 (rings split in parts) the defaults above stay the fastest.
# Broadcast sums (``False``) read the value codes as words but took 5.8-15x as long (blocks 16-64, 2-4 warps: 1,232
# to 3,210 µs at 4,164 slots). None: the defaults above always (sweeps set it).
STEP_CROWDED_FP8: tuple[bool, int, int] | None = (True, 64, 2)
# A step is crowded once its (sequence, key head) pairs reach this share of the programs it aims for. On an H200 at
# Llama-3-8B's heads (8 key heads of 128), batch 64 has 512 pairs against 528 aimed for: the crowded tiles took 115
# / 349 µs a layer against 140 / 399 for the defaults (float8 rings of 1,284 / 4,292 slots, full;
# ``dev/window_step_bench.py --shape llama-3-8b --float8 --batches 16 64 256 --programs 0 256``), and the fast
# decoder's batch-64 step 8.21 against 8.45 ms (``gpu_scale.sh decode``). SmolLM2's batch 64 (192 pairs) stays
# below and is read in two parts: 28.9 µs, against 39.8 whole (``--programs 528`` / ``264``).
STEP_CROWDED_SHARE = 0.5
# On the tensor cores Triton moves a float8 ring's value decoding past shared memory: the codes are stored there and
# read back into the product's (transposed) operand byte by byte, 64 ``ld.shared.b8`` a block, 186-225 registers
# (``dev/sm90_compile.py --ptx``). True: the values are held decoded where they are loaded (``_held``), stored as
# 16-bit words and read with ``ldmatrix.trans``: 8 of them a block, 128-168 registers. On an H200
# (``dev/window_step_bench.py --float8 --hold``) 4-7 % faster at batch 1 / 64 / 256: 15.4 / 63.8 / 202.8 against
# 16.1 / 66.9 / 217.8 µs a layer at 4,292 slots, 9.4 / 27.3 / 68.7 against 10.0 / 28.7 / 73.7 at 1,284.
STEP_HOLD_VALUES: bool = True
# The parts of a ring that its last part merges a tile at a time (``_merge``; a power of two), at most
# ``MERGE_ELEMENTS`` fp32 terms a tile (parts x padded query heads x head width): sm_90 builds (``dev/sm90_compile.py
# --hold``) of the float8 step in parts take 150 registers merging one part at a time and 168 merging 8 of 64-wide
# heads or 4 of 128-wide ones, 245 merging 8 of 128-wide ones. One at a time is the faster on an H200 (float8 rings,
# ``bash dev/gpu_hybrid.sh merge``, 72a188b): 21.8 against 23.7 µs a layer at batch 1 and 4,292 slots, 11.9
# against 14.1 at 1,284; at batch 64 the same within 1 %; with one part's tiles two-dimensional again (``_merge``'s
# first branch) 15.5 against 16.2 merging 2 a tile, 9.8 against 10.4 (``dev/window_step_bench.py --float8 --window
# 4292|1284 --batches 1 64 --merge-parts 1 2``, H200). Larger tiles stay for other GPUs and shapes to sweep.
MERGE_PARTS = 1
MERGE_ELEMENTS = 8192
# The fewest parts a ring is read in, however many programs the batch already gives (as many as its blocks at most):
# 1 reads a crowded batch's rings whole (one program per sequence and key head). The parts' merge costs no launch of
# its own, so a crowded batch may gain from more programs reading shorter parts; ``dev/window_step_bench.py
# --min-parts`` sweeps it.
STEP_MIN_PARTS = 1  # 2, 4, 8 parts: 3-82 % slower at batch 256 on an H200 (gpu_hybrid.sh merge at 72a188b)
# The most parts a ring is read in (None: as many as the programs aimed for and its blocks give). Its last part merges
# the parts one by one, so a long ring in many parts is bound by that merge: at Llama-3-8B's heads, batch 1, a full
# float8 ring of 4,292 slots took 29.6 µs a layer in 34 parts and 23.9 in 16 (a 1,284-slot ring: 13.1 in 11 parts;
# ``dev/window_step_bench.py --shape llama-3-8b --float8 --window 4292 --batches 1 --programs 0 128``, H200, 28353a7).
# Not the default until SmolLM2's batch 1 (3 key heads: 102 programs in 34 parts, 48 in 16) is timed with it
# (``--max-parts 0 16``).
STEP_MAX_PARTS: int | None = None
# Blocks of the ring before its part's first valid slot and after its last are not read: a ring that is not full yet
# (a window longer than the context so far, e.g. 4,288 slots after a 1k prompt) costs what its tokens take. The
# bounds come from a scan of the part's valid flags before the loop. 8f4ece1 skipped empty blocks by a branch inside
# the loop instead; Triton then did not pipeline the loop's loads (no cp.async in the sm_90 PTX), and full float8
# rings of 1,284 slots at Llama-3-8B's heads took 115 / 436 µs a layer at batch 64 / 256 on an H200, against 84 / 315
# before it (dev/window_step_bench.py, 28353a7 against bab3af6). A 4,292-slot ring holding 1,280 tokens: 165 / 530 µs
# with that skip, 283 / 969 without (--filled 1280 --skip 0 1). False: every block read (for the bench's --skip).
STEP_SKIP_EMPTY = True


@triton.jit
def _e4m3(b):
    """float8 e4m3fn codes (uint8) as fp32, by integer arithmetic (the interpreter's NumPy has no float8):
    ``(1 + m/8) 2^(e-7)``, or ``m 2^-9`` for ``e = 0``, signed. NaN codes (0x7F, 0xFF) are not decoded."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # fp32 bits: exponent e - 7 + 127
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    # the sign as a bit (code 0x80 is -0.0; a negation may compile to 0 - x, which gives +0.0 on CUDA)
    return (mag.to(tl.int32, bitcast=True) | ((b & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_as(b, NATIVE: tl.constexpr, ty: tl.constexpr):
    """float8 e4m3fn codes (uint8) as ``ty`` (every e4m3 value is exact in bf16, fp16 and fp32): the GPU's own
    conversion (NATIVE: a bitcast to ``tl.float8e4nv``, sm_89 and later) or ``_e4m3`` (the interpreter, older
    GPUs) then a cast."""
    if NATIVE:
        x = b.to(tl.float8e4nv, bitcast=True).to(ty)
    else:
        x = _e4m3(b).to(ty)
    return x


@triton.jit
def _held(x):
    """``x`` (bf16/fp16) unchanged, through an inline-asm move Triton may not move or merge: the values a product
    takes stay converted where they are loaded, so the product's operand layout reads them from shared memory as
    16-bit words (``ldmatrix``) instead of the float8 codes byte by byte (CUDA only; not under the interpreter)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _e4m3_value(b, NATIVE: tl.constexpr):
    """float8 e4m3fn codes (uint8) as fp32 (``_e4m3_as``)."""
    return _e4m3_as(b, NATIVE, tl.float32)


@triton.jit
def _e4m3_code(x):
    """fp32 ``x`` as its float8 e4m3fn code (int32, 0..255) bit for bit as ``torch.Tensor.to(float8_e4m3fn)``
    (c10's ``fp8e4m3fn_from_fp32_value``): to nearest, ties to even, signed zeros kept. Normals (|x| >= 2^-6):
    the fp32 bit pattern rounded to 3 mantissa bits by adding ``0x7FFFF`` plus the lowest kept bit, the
    exponent rebased; below 2^-6 the fp32 addition of 2^14 (whose ulp, 2^-9, is e4m3's subnormal step)
    rounds, and the low bits are the code. Beyond 448 (and inf) saturated to 448 as torch 2.13 does (its
    older releases gave NaN past 464), NaN as NaN (0x7F, with the sign); the kernel's codes never get there."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    mag = bits & 0x7FFFFFFF
    small = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = tl.minimum((mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20, 126)
    code = tl.where(mag < (121 << 23), small, normal)
    code = tl.where(mag > 0x7F800000, 127, tl.where(mag >= (1087 << 20), 126, code))
    return code | sign


@triton.jit
def _quantize(x, mask):
    """One vector ``x`` ``[BD]`` (fp32, ``mask`` its real entries) as ``float8.quantize`` keeps it: the scale
    ``max|x| / 448`` (at least float32's tiny) and the e4m3 codes (int32) of ``x / scale``, both divisions
    rounded as IEEE (``div_rn``: Triton's ``/`` on fp32 is approximate on CUDA)."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full([], 448.0, tl.float32)), 1.1754943508222875e-38)
    return _e4m3_code(tl.math.div_rn(x, scale)), scale


@triton.jit
def _window_ring_step(q_ptr, k_ptr, v_ptr, keys_ptr, values_ptr, ks_ptr, vs_ptr, valid_ptr, slot_ptr, o_ptr, m_ptr,
                      l_ptr, acc_ptr, cnt_ptr, cos_ptr, sin_ptr, qs_ptr, rc_ptr, rs_ptr, pos_ptr, sq_b, sq_h, sq_d,
                      sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, sc_b, sc_d, ss_b, ss_h, ss_d, sp_b, scale, softcap, HK, G, W,
                      D, L, R, S, reach, HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, FP8: tl.constexpr,
                      NATIVE_FP8: tl.constexpr, MMA: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr,
                      ROPE: tl.constexpr, SINK_Q: tl.constexpr, SINK_ROPE: tl.constexpr, HOLD_VALUES: tl.constexpr,
                      SKIP_EMPTY: tl.constexpr,
                      BG: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, SCAN: tl.constexpr):
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    part = tl.program_id(2)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    gm, dm = g < G, d < D
    out = gm[:, None] & dm[None, :]
    s = tl.load(slot_ptr)
    head = (bi * HK + hk).to(tl.int64)
    lo = part * L
    hi = tl.minimum(lo + L, W)
    mine = (s >= lo) & (s < hi)  # this part holds slot s

    if FP8:  # the codes read back in q's dtype, as the reference reads the ring back
        k_ty = q_ptr.dtype.element_ty
        v_ty = q_ptr.dtype.element_ty
    else:
        k_ty = keys_ptr.dtype.element_ty
        v_ty = values_ptr.dtype.element_ty

    # RoPE by rotating halves over the first R dims (ROPE: q and k come unrotated), in fp32
    if ROPE:
        half = R // 2
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + bi * sc_b + d * sc_d, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + bi * sc_b + d * sc_d, mask=rot, other=0.0).to(tl.float32) * sign

    # 1. the new token, rounded as the ring stores it, takes slot s; every program of the (sequence, key head)
    #    computes it alike in registers, the one whose part holds slot s writes it
    keys_ptr += head * W * D  # this head's ring [W, D]
    values_ptr += head * W * D
    write = tl.where(mine, dm, False)
    if FP8:  # quantised here as float8.quantize (k rotated first, in fp32, and rounded to k's dtype)
        k_in = tl.load(k_ptr + bi * sk_b + hk * sk_h + d * sk_d, mask=dm, other=0.0)
        if ROPE:  # dims past R kept as they are (a rotation would turn -0 into +0)
            k_in = tl.where(d < R, _rope(k_ptr + bi * sk_b + hk * sk_h, sk_d, cos_ptr + bi * sc_b,
                                         sin_ptr + bi * sc_b, sc_d, d, D, R), k_in.to(tl.float32)).to(k_in.dtype)
        v_in = tl.load(v_ptr + bi * sv_b + hk * sv_h + d * sv_d, mask=dm, other=0.0)
        k_code, k_scale = _quantize(k_in.to(tl.float32), dm)
        v_code, v_scale = _quantize(v_in.to(tl.float32), dm)
        k_code = k_code.to(tl.uint8)
        v_code = v_code.to(tl.uint8)
        ks_ptr += head * W  # this head's scales [W]
        vs_ptr += head * W
        tl.store(keys_ptr + s * D + d, k_code, mask=write)
        tl.store(values_ptr + s * D + d, v_code, mask=write)
        tl.store(ks_ptr + s, k_scale, mask=mine)
        tl.store(vs_ptr + s, v_scale, mask=mine)
        # the new token's key and value as the ring gives them back (dequantize: code * scale in fp32)
        k_new = (_e4m3_value(k_code, NATIVE_FP8) * k_scale).to(k_ty)
        v_new = (_e4m3_value(v_code, NATIVE_FP8) * v_scale).to(v_ty)
    else:
        if ROPE:  # the LoLCATs fused step's RoPE of one head
            k_new = _rope(k_ptr + bi * sk_b + hk * sk_h, sk_d, cos_ptr + bi * sc_b, sin_ptr + bi * sc_b, sc_d, d,
                          D, R).to(k_ty)
        else:
            k_new = tl.load(k_ptr + bi * sk_b + hk * sk_h + d * sk_d, mask=dm, other=0.0).to(k_ty)
        v_new = tl.load(v_ptr + bi * sv_b + hk * sv_h + d * sv_d, mask=dm, other=0.0).to(v_ty)
        tl.store(keys_ptr + s * D + d, k_new, mask=write)
        tl.store(values_ptr + s * D + d, v_new, mask=write)
    tl.store(valid_ptr + bi * W + s, tl.full([], 1, tl.int1), mask=mine)

    # 2. the group's query heads [BG, BD] in the ring's (read-back) dtype, as the reference's SDPA call reads them
    q_at = q_ptr + bi * sq_b + (hk * G + g)[:, None] * sq_h
    q = tl.load(q_at + d[None, :] * sq_d, mask=out, other=0.0)
    if ROPE:
        q_raw = q.to(tl.float32)
        q_turn = tl.load(q_at + partner[None, :] * sq_d, mask=gm[:, None] & rot[None, :], other=0.0).to(tl.float32)
        q = q_raw * cos[None, :] + q_turn * sin[None, :]
        if SINK_ROPE:  # the sinks' queries: q rotated at min(position, reach) (sinks.py's reach)
            over = tl.load(pos_ptr + bi * sp_b) > reach
            at_cos = tl.where(over, tl.load(rc_ptr + d, mask=rot, other=1.0), cos)
            at_sin = tl.where(over, tl.load(rs_ptr + d, mask=rot, other=0.0) * sign, sin)
            qs = q_raw * at_cos[None, :] + q_turn * at_sin[None, :]
    q = q.to(k_ty)
    if F32_DOT:
        q = q.to(tl.float32)
    if SINK_Q:  # the queries that score the S sink slots, rotated already (sinks.py's reach)
        qs = tl.load(qs_ptr + bi * ss_b + (hk * G + g)[:, None] * ss_h + d[None, :] * ss_d, mask=out,
                     other=0.0).to(q.dtype)
    if SINK_ROPE:
        qs = qs.to(k_ty).to(q.dtype)
    # the online softmax starts from the new token (in the part holding slot s), read from registers
    new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    if HAS_SOFTCAP:
        new = softcap * (2.0 * tl.sigmoid(2.0 * new / softcap) - 1.0)  # softcap * tanh(new / softcap)
    m = tl.where(mine, new, float("-inf"))
    l = tl.where(mine, 1.0, 0.0) + tl.zeros([BG], dtype=tl.float32)
    acc = tl.where(mine, v_new.to(tl.float32), 0.0)[None, :] + tl.zeros([BG, BD], dtype=tl.float32)

    # 3. the part's other slots in blocks of BW (slot s is never read: its write may not have landed); with
    #    SKIP_EMPTY only the blocks from the first valid slot's to the last's: a ring not yet full (or a left-padded
    #    sequence's) is read as far as it holds tokens. The bounds come from a scan of the valid flags first, so that
    #    the loop itself has no branch (see STEP_SKIP_EMPTY).
    begin = lo
    top = hi
    if SKIP_EMPTY:
        first = hi
        top = lo
        for scan in range(lo, hi, SCAN):
            ws = scan + tl.arange(0, SCAN)
            lives = tl.load(valid_ptr + bi * W + ws, mask=(ws < hi) & (ws != s), other=0).to(tl.int1)
            first = tl.minimum(first, tl.min(tl.where(lives, ws, hi), axis=0))
            top = tl.maximum(top, tl.max(tl.where(lives, ws + 1, lo), axis=0))
        begin = lo + ((first - lo) // BW) * BW
    for start in range(begin, top, BW):
        w = start + tl.arange(0, BW)
        old = (w < hi) & (w != s)
        live = tl.load(valid_ptr + bi * W + w, mask=old, other=0).to(tl.int1)
        tile = w[:, None] * D + d[None, :]
        if FP8:  # codes times the slot's scale in fp32, then rounded as ``dequantize`` rounds them
            k_codes = tl.load(keys_ptr + tile, mask=old[:, None] & dm[None, :], other=0)
            v_codes = tl.load(values_ptr + tile, mask=old[:, None] & dm[None, :], other=0)
            k_sc = tl.load(ks_ptr + w, mask=old, other=0.0)
            v_sc = tl.load(vs_ptr + w, mask=old, other=0.0)
            keys = (_e4m3_value(k_codes, NATIVE_FP8) * k_sc[:, None]).to(k_ty)
            values = (_e4m3_value(v_codes, NATIVE_FP8) * v_sc[:, None]).to(v_ty)
            if MMA and NATIVE_FP8 and HOLD_VALUES and not F32_DOT:  # 16-bit values only
                values = _held(values)
        else:
            keys = tl.load(keys_ptr + tile, mask=old[:, None] & dm[None, :], other=0.0)
            values = tl.load(values_ptr + tile, mask=old[:, None] & dm[None, :], other=0.0)
        if F32_DOT:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)
        if MMA:
            scores = tl.dot(q, tl.trans(keys), input_precision=PREC) * scale  # [BG, BW]
        else:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale
        if SINK_Q or SINK_ROPE:
            if MMA:
                lead = tl.dot(qs, tl.trans(keys), input_precision=PREC) * scale
            else:
                lead = tl.sum(qs.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale
            scores = tl.where((w < S)[None, :], lead, scores)
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no live slot yet: nothing to weigh
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if MMA:  # the weights in the ring's dtype, as a flash kernel rounds them
            acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values.to(tl.float32)[None, :, :], axis=1)
        m = m_new

    # 4. the output; with the ring in parts, this part's terms ([B, Hk, P, G] and [B, Hk, P, G, D]), and the last
    #    part of the (sequence, key head) to arrive (counted in cnt[head]) merges them into the output
    last = True
    if SPLIT:
        parts = tl.num_programs(2)
        at = (head * parts + part) * G + g
        tl.store(m_ptr + at, m, mask=gm)
        tl.store(l_ptr + at, l, mask=gm)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=out)
        tl.debug_barrier()  # every thread's terms stored before the count releases them
        last = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel") == parts - 1
        if last:
            tl.store(cnt_ptr + head, 0)  # zero again for the next step (a launch of its own, after this one)
            o = _merge(m_ptr, l_ptr, acc_ptr, head, parts, G, D, g, d, gm, out, BP)
            tl.store(o_ptr + (head * G + g)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=out)
    else:
        o = acc / tl.where(gm, l, 1.0)[:, None]  # l >= 1 on a real row: its largest term is exp(0)
        tl.store(o_ptr + (head * G + g)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=out)
    # 5. the slot counter advanced by the last (sequence, key head) to finish (counted in cnt[B * Hk]): every
    #    program has read the slot by then (each head's other parts before that head's last one counted)
    if last:
        heads = tl.num_programs(0) * HK
        if tl.atomic_add(cnt_ptr + heads, 1, sem="acq_rel") == heads - 1:
            tl.store(cnt_ptr + heads, 0)
            tl.store(slot_ptr, _next_slot(s, W, S))


@triton.jit
def _next_slot(s, W, S):
    """The slot after ``s`` on a ring of ``W`` slots whose first ``S`` (the sinks') never move
    (``RingHybridState.advance``)."""
    return S + (s - S + 1) % (W - S)


@triton.jit
def _merge(m_ptr, l_ptr, acc_ptr, head, P, G, D, g, d, gm, out, BP: tl.constexpr):
    """The output ``[BG, BD]`` (fp32) of one (sequence, key head) from its ``P`` parts' running maxima, sums and
    weighted values, ``BP`` parts a tile, their loads in flight together (merged one part at a time, a chain of
    dependent loads, 10 to 34 parts took 5.8 µs a layer at batch 1 on an H200, as long as a part's ring step), read
    past the L1 cache (``.cg``: the other parts' programs wrote them on other multiprocessors in this launch)."""
    m = tl.full(g.shape, float("-inf"), tl.float32)
    l = tl.zeros(g.shape, dtype=tl.float32)
    acc = tl.zeros(out.shape, dtype=tl.float32)
    if BP == 1:  # two-dimensional tiles: the [1, BG, BD] form below took 21.8 / 11.9 µs a layer at batch 1 over 4,292 /
        # 1,284 float8 slots on an H200 (72a188b), this one 15.5 / 9.8 (``dev/window_step_bench.py --float8``)
        for part in range(P):
            at = (head * P + part) * G + g
            m_p = tl.load(m_ptr + at, mask=gm, other=float("-inf"), cache_modifier=".cg")
            m_new = tl.maximum(m, m_p)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # parts without a live slot weigh nothing
            alpha = tl.exp(m - m_safe)
            beta = tl.exp(m_p - m_safe)
            l = l * alpha + tl.load(l_ptr + at, mask=gm, other=0.0, cache_modifier=".cg") * beta
            terms = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=out, other=0.0, cache_modifier=".cg")
            acc = acc * alpha[:, None] + terms * beta[:, None]
            m = m_new
        return acc / tl.where(gm, l, 1.0)[:, None]
    j = tl.arange(0, BP)
    for start in range(0, P, BP):
        at = (head * P + start + j)[:, None] * G + g[None, :]  # [BP, BG]
        mask = (start + j < P)[:, None] & gm[None, :]
        m_p = tl.load(m_ptr + at, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_p = tl.load(l_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
        terms = tl.load(acc_ptr + at[:, :, None] * D + d[None, None, :], mask=mask[:, :, None] & out[None, :, :],
                        other=0.0, cache_modifier=".cg")  # [BP, BG, BD]
        m_new = tl.maximum(m, tl.max(m_p, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # parts without a live slot weigh nothing
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_p - m_safe[None, :])  # [BP, BG]
        l = l * alpha + tl.sum(l_p * beta, axis=0)
        acc = acc * alpha[:, None] + tl.sum(terms * beta[:, :, None], axis=0)
        m = m_new
    return acc / tl.where(gm, l, 1.0)[:, None]


_PROGRAMS: dict[int, int] = {}


def _target_programs(device: torch.device) -> int:
    """``STEP_PROGRAMS``, else four per multiprocessor of ``device`` (asked once per device)."""
    if STEP_PROGRAMS is not None:
        return STEP_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROGRAMS:
        _PROGRAMS[index] = 4 * torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS[index]


def step_tiles(batch: int, n_kv: int, d: int, fp8: bool, programs: int) -> tuple[bool, int, int]:
    """The ring step's ``(products on the tensor cores, block of slots, warps)`` for ``batch`` sequences of
    ``n_kv`` key heads of width ``d`` when a step aims for ``programs`` programs: ``STEP_CROWDED_FP8`` for a
    float8 ring whose (sequence, key head) pairs reach ``STEP_CROWDED_SHARE`` of them, else ``STEP_MMA`` /
    ``STEP_BLOCK`` / ``STEP_WARPS``; the block halved for heads over 128 wide."""
    mma, block, warps = STEP_MMA, STEP_BLOCK, STEP_WARPS
    if fp8 and STEP_CROWDED_FP8 is not None and batch * n_kv >= STEP_CROWDED_SHARE * programs:
        mma, block, warps = STEP_CROWDED_FP8
    return mma, (block if d <= 128 else max(16, block // 2)), warps


def ring_parts(batch: int, n_kv: int, window: int, block: int, programs: int) -> int:
    """Parts of the ring per (sequence, key head): about ``programs`` programs in all and at least
    ``STEP_MIN_PARTS`` (at most ``STEP_MAX_PARTS``), each part at least one block of ``block`` slots."""
    parts = max(STEP_MIN_PARTS, programs // max(batch * n_kv, 1))
    if STEP_MAX_PARTS is not None:
        parts = min(parts, STEP_MAX_PARTS)
    return max(1, min(triton.cdiv(window, block), parts))


def window_step_ring_triton(q, k, v, state, *, scale: float, softcap=None, parts: int | None = None,
                            position_embeddings=None, sink_q=None, sink_rope=None):
    """The window softmax's decode step on a ``RingHybridState``, in place, as ``window_softmax_step_ring``.

    ``q`` ``[B, H, 1, D]`` and ``k``/``v`` ``[B, Hk, 1, D]`` with any strides, q and k rotated, or with
    ``position_embeddings`` ``(cos, sin)`` ``[B or 1, 1, R]`` rotated here (RoPE by rotating halves over the
    first R dims, in fp32: the launches of the layer's RoPE saved); ``state.keys`` and ``state.values``
    ``[B, Hk, W, D]`` and ``state.valid`` ``[B, W]`` contiguous. ``parts``: the ring's parts per (sequence, key
    head) (default: by ``STEP_PROGRAMS``). Returns ``(o [B, H, 1, D] in q's dtype, state)``; the slot counter
    is advanced (no host sync: the launch's shapes are the tensors'). ``sink_q`` (like ``q``, rotated whatever
    ``position_embeddings``): the queries that score the ring's ``state.sinks`` sink slots (``sinks.py``'s reach);
    or, with ``position_embeddings``, ``sink_rope`` ``(cos, sin, positions, reach)``: q rotated here by ``cos``/``sin``
    ``[R]`` (fp32, the tables at ``reach``) for the sequences whose position ``[B]`` (or ``[1]``) is past ``reach``."""
    return _step(q, k, v, state, state.keys, state.values, None, None, scale=scale, softcap=softcap, parts=parts,
                 position_embeddings=position_embeddings, sink_q=sink_q, sink_rope=sink_rope)


def window_step_ring_float8_triton(q, k, v, state, *, scale: float, softcap=None, parts: int | None = None,
                                   position_embeddings=None, sink_q=None, sink_rope=None):
    """The decode step on a float8 ring (``float8.Float8RingState``), in place, as ``float8_window_step_ring``'s
    PyTorch path (the reference): ``k``/``v`` are the new token's key and value as the layer computed them
    (unrotated with ``position_embeddings``, which rotate q and k here as ``window_step_ring_triton`` does).
    The kernel quantises them as ``float8.quantize`` (a scale per vector, e4m3 codes rounded as torch rounds
    them), writes their codes and scales into slot ``state.slot`` (with ``valid`` there) and attends with
    their read-back values (``dequantize`` in q's dtype) over the ring, whose codes it reads as bytes and
    decodes times their slot's scale; the counter is advanced. Shapes and the rest as
    ``window_step_ring_triton``; ``state.key_scale``/``value_scale`` ``[B, Hk, W, 1]`` contiguous."""
    return _step(q, k, v, state, state.keys.view(torch.uint8), state.values.view(torch.uint8), state.key_scale,
                 state.value_scale, scale=scale, softcap=softcap, parts=parts,
                 position_embeddings=position_embeddings, sink_q=sink_q, sink_rope=sink_rope)


_NATIVE_FP8: dict[int, bool] = {}


def _native_float8(device: torch.device) -> bool:
    """Whether the kernel decodes e4m3 with the GPU's own conversion: not under the interpreter (whose NumPy
    has no float8), and on NVIDIA GPUs of compute capability 8.9 or later (asked once per device)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NATIVE_FP8:
        _NATIVE_FP8[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _NATIVE_FP8[index]


def _step(q, k, v, state, keys, values, key_scale, value_scale, *, scale, softcap, parts, position_embeddings=None,
          sink_q=None, sink_rope=None):
    """One launch (two with the ring in parts) on the ring's ``keys``/``values``: float8 codes as bytes with
    their scales (the new token quantised here), or (scales None) the ring's own buffers; with
    ``position_embeddings``, q and k rotated here."""

    fp8 = key_scale is not None
    b, h, _, d = q.shape
    hk, w = k.shape[1], keys.shape[2]
    if h % hk:
        raise ValueError(f"{h} query heads are not a multiple of {hk} key heads")
    g = h // hk
    bd = max(16, triton.next_power_of_2(d))
    # the programs a step aims for (on the CPU, the interpreter's, only when STEP_PROGRAMS sets them)
    programs = _target_programs(q.device) if q.is_cuda or STEP_PROGRAMS is not None else 1 << 30
    mma, bw, warps = step_tiles(b, hk, bd, fp8, programs)
    bg = max(16 if mma else 1, triton.next_power_of_2(g))
    if parts is None:
        parts = ring_parts(b, hk, w, bw, programs) if q.is_cuda else 1
    span = triton.cdiv(triton.cdiv(w, parts), bw) * bw  # slots per part, whole blocks
    parts = triton.cdiv(w, span)
    o = torch.empty(b, h, 1, d, device=q.device, dtype=q.dtype)
    if parts > 1:
        m = torch.empty(b, hk, parts, g, device=q.device, dtype=torch.float32)
        lsum = torch.empty_like(m)
        acc = torch.empty(b, hk, parts, g, d, device=q.device, dtype=torch.float32)
    else:
        m = lsum = acc = o  # never read
    read = (q.dtype,) if fp8 else (keys.dtype, values.dtype)  # the dtypes the products take the ring in
    f32_dot = os.environ.get("TRITON_INTERPRET") == "1" or torch.float32 in read
    if not fp8:
        key_scale = value_scale = state.valid  # never read
    cos, sin, rot, sc_b, sc_d = rope_arguments(position_embeddings, q)
    use_qs = sink_q is not None and state.sinks > 0
    qs = sink_q if use_qs else q  # q: never read
    turn = sink_rope is not None and state.sinks > 0 and rot > 0 and not use_qs
    if turn:
        reach_cos, reach_sin, positions, reach = sink_rope
        positions = positions.reshape(-1)
    else:
        reach_cos = reach_sin = positions = cos  # never read
        reach = 0
    _window_ring_step[(b, hk, parts)](
        q, k, v, keys, values, key_scale, value_scale, state.valid, state.slot, o, m, lsum, acc,
        _counters(state, b * hk + 1, q.device), cos, sin, qs,
        reach_cos, reach_sin, positions, q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3), sc_b, sc_d, qs.stride(0), qs.stride(1), qs.stride(3),
        positions.stride(0) if turn and positions.shape[0] > 1 else 0, float(scale), float(softcap or 1.0), hk, g, w,
        d, span, rot, state.sinks, int(reach), HAS_SOFTCAP=softcap is not None, SPLIT=parts > 1, FP8=fp8,
        NATIVE_FP8=fp8 and _native_float8(q.device), MMA=mma, F32_DOT=f32_dot,
        PREC="ieee" if f32_dot else "tf32", ROPE=rot > 0, SINK_Q=use_qs, SINK_ROPE=turn, HOLD_VALUES=STEP_HOLD_VALUES, SKIP_EMPTY=STEP_SKIP_EMPTY,
        SCAN=min(1024, triton.next_power_of_2(span)),
        BG=bg, BW=bw, BD=bd, BP=min(MERGE_PARTS, triton.next_power_of_2(parts), max(1, MERGE_ELEMENTS // (bg * bd))),
        num_warps=warps,
        **({} if STEP_STAGES is None else dict(num_stages=STEP_STAGES)))
    return o, state


def _counters(state, n: int, device: torch.device) -> torch.Tensor:
    """``state.counters``: ``n`` (or more) int32 zeros for the step's arrival counts, made once per ring (the
    step leaves them zero again; a CUDA graph captures the one buffer)."""
    have = state.counters
    if have is None or have.numel() < n or have.device != device:
        have = state.counters = torch.zeros(n, dtype=torch.int32, device=device)
    return have
