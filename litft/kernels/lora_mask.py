"""The dropout mask of the LoRA kernels (lora_a, swiglu_lora): a hash of the forward pass's seed, a layer's salt and
each element's place, drawn as a kernel reads its input and drawn again in the backward pass, never kept in memory.

The mask of a LoRA layer's input x (rows, K) is the same in the forward kernel and the backward kernel whatever
their tiles: element (row, col) is kept when its 16-bit uniform is at least p16 = round(p x 65,536). The uniforms
come two to a 32-bit word: word row x ceil(K / 64) x 32 + col // 2, XORed with a 32-bit key of seed + salt, through
_mix32 (low half: the even column, high half: the odd one). The kept probability is 1 - p16 / 65,536 (p = 0.05:
0.9499970), and the kept elements are scaled by its inverse, so the expectation is x's.

Why a hash and not Philox: the kernels draw every mask twice (forward, and again backward), and measured on an
H100 Philox's draws were 6% of a TinyLlama LoRA step (50.2 ms at dropout 0.05 against 47.3 ms at 0, no mask drawn).
Philox-4x32 with 10 rounds (Triton's randint4x) costs ~100 integer operations per call for 8 halves, ~12 per
element plus the shuffles that interleave its 4 words; _mix32 costs 8 per word, 4 per element, and one interleave.
A dropout mask needs independent-looking bits, not Philox's statistical margin; tests/test_kernels.py checks the
kept fraction and the independence of neighbouring elements and of salts. Measured on an H100 (TinyLlama LoRA, 60
steps, twice each): Philox-10 74,962 / 73,419 real tok/s, Philox-7 75,174 / 74,295, this hash 75,294 / 76,126
(+2.0% on Philox-10's mean); per step the four LoRA kernels took 10.7 ms with the hash, 11.8 with Philox-10 and 8.8
without any mask (dropout 0) (docs/speed.md). What is left of the mask's cost is mostly lora_down_backward's (2.73
against 1.82 ms): Triton computes the mask there once per layout it is used in (the dropped x for A's gradient, the
input gradient's share), so it hashes every word twice (the sm_90 code's TTGIR shows both).

The kernels read x in tiles of 64 columns or more: Triton 3.6-3.9 fails to compile (an assertion in
ConvertTritonGPUToLLVM, sm_90) a kernel that reads it in 16-column tiles once x's row stride is known to be a
multiple of 16.
"""

from __future__ import annotations

from litft.kernels import tl, triton

_LORA_P_BITS = 16


def _lora_p16(p: float) -> tuple[int, float]:
    """The kernels' integer threshold for dropout probability p, and the scale of kept elements."""
    p16 = round(p * (1 << _LORA_P_BITS))
    if p > 0 and p16 == 0 or p16 >= 1 << _LORA_P_BITS:
        raise ValueError(f"LoRA dropout {p} is outside what a 16-bit threshold draws: (2^-16, 1 - 2^-16)")
    return p16, (1 << _LORA_P_BITS) / ((1 << _LORA_P_BITS) - p16)


def _lora_check_counters(rows: int, k: int) -> None:
    if rows * triton.cdiv(k, 64) * 32 >= 2**31:  # the masks' word numbers are 32-bit (int32 before the key's XOR)
        raise ValueError(f"LoRA dropout kernels: {rows:,} x {k:,} elements, over 2^32")


if triton is not None:

    @triton.jit
    def _mix32(x):
        # a bijection of 32-bit words in which every output bit depends on every input bit: two xorshift-multiply
        # rounds and a final xorshift (the "lowbias32" constants of Chris Wellons' hash-prospector search)
        x = (x ^ (x >> 16)) * 0x7FEB352D
        x = (x ^ (x >> 15)) * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _lora_key(seed):
        # the 32-bit key of a mask: seed (int64: the forward pass's seed + the layer's salt) hashed, both halves
        return _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((seed >> 32).to(tl.uint32)))

    @triton.jit
    def _lora_keep(key, rows, first_column, row_words, p16, BLOCK_K: tl.constexpr, DROPOUT: tl.constexpr):
        # the (BLOCK_M, BLOCK_K) keep mask of columns first_column ... + BLOCK_K (first_column even) under key
        # (_lora_key); without DROPOUT (p = 0) all true, and no random numbers drawn: the compiler drops the selects
        keep = tl.full((rows.shape[0], BLOCK_K), 1, tl.int1)
        if DROPOUT:
            words = (rows[:, None] * row_words + first_column // 2 + tl.arange(0, BLOCK_K // 2)[None, :]).to(tl.uint32)
            uniforms = _mix32(words ^ key)
            halves = tl.join(uniforms & 0xFFFF, uniforms >> 16)  # (BLOCK_M, BLOCK_K // 2, 2): even, odd column
            keep = tl.reshape(halves, (rows.shape[0], BLOCK_K)) >= p16
        return keep
