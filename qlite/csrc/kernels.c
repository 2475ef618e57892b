/* qlite's CPU kernels for x86 with AVX-512 BF16 (loaded by native.py).
 *
 * Matrix-vector products for decoding: y[m, n] = sum_k x[m, k] w[n, k] for a few rows m of
 * activations (bf16 in, bf16 or fp32 out), reading each weight once.
 * Weights stay in qlite's canonical layouts (formats.py), so nothing is repacked:
 *   bf16:  w bf16 [N, K]
 *   int8:  w int8 [N, K], scales fp16 [N, G]                      w = q * s
 *   int4:  w uint8 [N, K/2] (k even: low nibble), scales fp16 [N, G], zeros uint8 [N, G]
 *          w = (q - z) * s; a nibble q becomes the bf16 number 128 + q by OR-ing in 0x4300, so a
 *          group's dot product is sum (128 + q) x - (128 + z) sum x (each product exact in fp32).
 *   int4k: as int4, but scales are uint8 codes c under row_scales fp16 [N]: each block of rows' fp16 scales
 *          fp16(d c) are made first (drivers.h's block_fp16_scales), then the int4 code runs on them.
 * Four weight rows at a time (independent accumulator chains, activations loaded once);
 * rows are split over OpenMP threads (torch's own libgomp, so no second thread pool).
 * With AVX-512 VNNI, qlite_gemv_vnni does the same products with the activations in integers, int4 and int8
 * weights "in lanes" (below, lanes.h), at every row count (qlite_gemv_vnni_lowbit: int3k / int2k); the
 * dequantize_* functions write bf16 weights for a prefill's bf16 matmul where no such product takes a layer (no
 * VNNI, widths it does not take).
 * Then the small ops of a decode step, each one call instead of several torch ops: RMSNorm, silu(gate) * up,
 * and rotary + KV-cache write + attention for the new tokens (one per sequence, or a prefill's of one).
 * Built by native.py: cc -O3 -march=native -fopenmp -shared; without AVX-512 BF16, abi() says 0. */
#include "common.h"

#if !(defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__))
int qlite_gemv_abi(void) { return 0; }
#else
#include <immintrin.h>

int qlite_gemv_abi(void) { return 1; }

/* Prefetch the weights AHEAD rows (row_bytes each) past p, and again twice as far: the second request
 * streams the quantized products 3-16% faster on this project's Zen 4 machine (int4 most; the farther
 * one alone gains nothing). The bf16 product and the AVX2 kernels gained nothing: they keep one. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, long row_bytes) {
    _mm_prefetch((const char *)p + AHEAD * row_bytes, _MM_HINT_T0);
    _mm_prefetch((const char *)p + 2 * AHEAD * row_bytes, _MM_HINT_T0);
}

/* ---- bf16 and int8 weights (rows.h), then int4 ------------------------------------------------ */
/* the vector vocabulary of rows.h's bf16 and int8 bodies: 16 fp32 lanes; bf16 pairs through vdpbf16ps */
typedef __m512 vec;
typedef __m512bh bvec;
#define VW 16  /* fp32 lanes */
#define BW 32  /* bf16 values a bvec holds */
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vset1(x) _mm512_set1_ps(x)
#define vsum(v) _mm512_reduce_add_ps(v)
#define vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define bload(p) ((__m512bh)_mm512_loadu_si512(p))
#define bdot(acc, w, x) _mm512_dpbf16_ps(acc, bload(w), x)
#define BF16_PREFETCH(wr, K) do { _mm_prefetch((const char *)((wr) + AHEAD * (K)), _MM_HINT_T0); \
                                  _mm_prefetch((const char *)((wr) + AHEAD * (K) + 32), _MM_HINT_T0); } while (0)
#define INT8_PREFETCH(wr, K) prefetch_ahead(wr, K)
#include "rows.h"


/* ---- int4 weights ------------------------------------------------------------------------- */
/* xe/xo: the even and odd activations of one row (bf16, K/2 each); xsum: each group's sum of x */
static inline __attribute__((always_inline)) void int4_rows(
        const uint16_t *xe, const uint16_t *xo, const float *xsum, const uint8_t *w, const uint16_t *scales,
        const uint8_t *zeros, long K, long G, int nrows, float *out) {
    long gbytes = K / G / 2;
    const __m512i low = _mm512_set1_epi16(0x0f), magic = _mm512_set1_epi16(0x4300);  /* bf16 128.0 */
    float s32[ROWS][MAX_GROUPS];
    __m512 total[ROWS], corr[ROWS];
    for (int r = 0; r < nrows; r++) {  /* scales to fp32; corr = sum_g s (128 + z) xsum */
        total[r] = corr[r] = _mm512_setzero_ps();
        for (long g = 0; g < G; g += 16) {
            __mmask16 m = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
            __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + r * G + g));
            __m512 zv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, zeros + r * G + g)));
            _mm512_mask_storeu_ps(s32[r] + g, m, sv);
            __m512 t = _mm512_mul_ps(sv, _mm512_add_ps(zv, _mm512_set1_ps(128.f)));
            corr[r] = _mm512_fmadd_ps(t, _mm512_maskz_loadu_ps(m, xsum + g), corr[r]);
        }
    }
    for (long g = 0; g < G; g++) {
        __m512 acc[ROWS];
        for (int r = 0; r < nrows; r++) acc[r] = _mm512_setzero_ps();
        for (long b = g * gbytes; b < (g + 1) * gbytes; b += 32) {  /* 32 bytes = 64 weights */
            __m512bh xev = (__m512bh)_mm512_loadu_si512(xe + b), xov = (__m512bh)_mm512_loadu_si512(xo + b);
            for (int r = 0; r < nrows; r++) {
                const uint8_t *wr = w + r * K / 2 + b;
                prefetch_ahead(wr, K / 2);
                __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)wr));
                __m512i lo = _mm512_ternarylogic_epi32(bytes, low, magic, 0xEA);  /* (a & b) | c */
                __m512i hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), magic);
                acc[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r], (__m512bh)lo, xev), (__m512bh)hi, xov);
            }
        }
        for (int r = 0; r < nrows; r++) total[r] = _mm512_fmadd_ps(_mm512_set1_ps(s32[r][g]), acc[r], total[r]);
    }
    for (int r = 0; r < nrows; r++) out[r] = _mm512_reduce_add_ps(total[r]) - _mm512_reduce_add_ps(corr[r]);
}

typedef uint16_t int4_act;  /* int4_rows takes its activations as bf16 */
static inline uint16_t to_int4_act(uint16_t v) { return v; }

#include "drivers.h"


/* ---- int3k / int2k weights (lowbit.h) ------------------------------------------------------------------
 * Per block of 128 inputs and weight row: the 32 low-bit bytes (and int3's 16 high-bit bytes, as [h, h >> 1]
 * so that one shift by 2 t serves both halves) give the codes of inputs 32 t .. 32 t + 31 by a shift and a
 * mask; each becomes the bf16 number q by a table lookup (vpermw: exact, and unlike int4_rows' 128 + q no
 * cancellation of 128 sum x afterwards), one vdpbf16ps with 32 activations, then the group scales (two groups
 * of 16 side by side in the lanes, or one). */
typedef uint16_t lowbit_act;
static inline uint16_t to_lowbit_act(uint16_t v) { return v; }

static inline __attribute__((always_inline)) void lowbit_rows(
        const uint16_t *x, float (*s32)[LOWBIT_MAX_GROUPS], const uint8_t *w, long row_bytes, const int bits, long K, long G,
        const int nrows, float *out) {
    long gsize = K / G, block_bytes = 16 * bits;
    const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    const __m512i as_bf16 = _mm512_setr_epi32(0x3f800000, 0x40404000, 0x40a04080, 0x40e040c0, 0, 0, 0, 0,  /* bf16 0..7 */
                                              0, 0, 0, 0, 0, 0, 0, 0);
    __m512 total[ROWS];
    for (int r = 0; r < nrows; r++) total[r] = _mm512_setzero_ps();
    for (long b = 0; b < K / 128; b++) {
        __m512bh xv[4];
        for (int t = 0; t < 4; t++) xv[t] = (__m512bh)_mm512_loadu_si512(x + 128 * b + 32 * t);
        for (int r = 0; r < nrows; r++) {
            const uint8_t *wr = w + r * row_bytes + b * block_bytes;
            prefetch_ahead(wr, row_bytes);
            __m256i low = _mm256_loadu_si256((const __m256i *)wr), high = _mm256_setzero_si256();
            if (bits == 3) {
                __m128i h = _mm_loadu_si128((const __m128i *)(wr + 32));
                high = _mm256_set_m128i(_mm_srli_epi16(h, 1), h);  /* inputs 16..31 of each 32: bit 2 t + 1 */
            }
            for (int t = 0; t < 4; t++) {
                __m128i shift = _mm_cvtsi32_si128(2 * t);
                __m256i q = _mm256_and_si256(_mm256_srl_epi16(low, shift), m3);
                if (bits == 3)
                    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, shift), m1), 2));
                __m512i q16 = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), as_bf16);
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q16, xv[t]);  /* lane l: inputs 2 l, 2 l + 1 */
                long k0 = 128 * b + 32 * t;
                __m512 sv = gsize >= 32 ? _mm512_set1_ps(s32[r][k0 / gsize])
                                        : _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s32[r][k0 / 16]),
                                                               _mm512_set1_ps(s32[r][k0 / 16 + 1]));
                total[r] = _mm512_fmadd_ps(sv, dot, total[r]);
            }
        }
    }
    for (int r = 0; r < nrows; r++) out[r] = _mm512_reduce_add_ps(total[r]);
}

#include "lowbit.h"


/* ---- integer activations (VNNI): int4 and int8 weights in lanes (lanes.h) ------------------------------
 * llama.cpp's idea: quantize the activations of a decode step once, then multiply in integers. int4 weights
 * meet int8 activations (vpdpbusd), int8 weights int16 ones (vpdpwssd, s16 x s16: int8 activations cost int8
 * checkpoints 10-25% more KLD on the demo model, int16 ones nothing measurable); both per row and span of
 * inputs, 16 weight rows a vector. kernels_avx2.c runs the same integers and float steps: the same bits. */
#if defined(__AVX512VNNI__)
#define INTEGER_PRODUCTS  /* decode_step.h calls qlite_gemv_vnni */

int qlite_vnni_abi(void) { return 1; }

/* ---- int4 weights in lanes (lanes.h): 16 rows a vector, vpdpbusd -------------------------------- */
#define LROWS 16  /* weight rows per block: a vector's lanes */
#define LTILE 8  /* activation rows per pass over a block's inputs (8 accumulators, 8 sums in registers) */
#define LGROUP 4  /* blocks a thread takes at a time past 16 rows: each activation block read once for 64 weight rows */

static inline __m512 load16_bf16(const uint16_t *p) {  /* 16 bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* lanes.h's quantize_lanes_row: one activation row's int8, scales and sums per span */
static void quantize_lanes_row(const uint16_t *x, long K, long span, int8_t *xa, float *xd, int32_t *xsum, int natural) {
    const __m128i even_odd = natural ? _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                     : _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    for (long s = 0; s < K / span; s++) {
        const uint16_t *src = x + s * span;
        __m512 amax_v = _mm512_setzero_ps();
        for (long k = 0; k < span; k += 16) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(load16_bf16(src + k)));
        float amax = _mm512_reduce_max_ps(amax_v), inv = amax > 0.f ? 127.f / amax : 0.f;
        xd[s] = amax / 127.f;
        __m512i sum = _mm512_setzero_si512();
        for (long k = 0; k < span; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16_bf16(src + k), _mm512_set1_ps(inv)));
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128((__m128i *)(xa + s * span + k), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q), even_odd));
        }
        xsum[s] = _mm512_reduce_add_epi32(sum);
    }
}

/* acc += the products of x's u8 with b's s8: the intrinsic's copy in and out of each accumulator (GCC 12 did
 * not coalesce them: 2 moves per vpdpbusd) made a tile 1.x slower */
static inline __attribute__((always_inline)) void dpbusd_in_place(__m512i *acc, __m512i x, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(x), "v"(b));
}

/* lanes.h's lanes_tile: total [mt, LROWS] += one block's products with mt activation rows, a vpdpbusd per 4 inputs */
static inline __attribute__((always_inline)) void lanes_tile(
        const uint8_t *block, long bn, long K, long S, long span, long gsize, long k0, long kc,
        const int8_t *xa, const float *xd, const int32_t *xsum, const float *swT, const int32_t *zT, int mt, float *total) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __mmask16 live = (__mmask16)((1u << bn) - 1);
    const int split = mt <= 4;  /* two accumulators a row where registers allow: the chain of vpdpbusd halved */
    __m512 f[LTILE];
    for (int m = 0; m < mt; m++) f[m] = _mm512_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m512i acc[LTILE], acc2[LTILE];
        __m512i zv = _mm512_load_si512(zT + g * LROWS);
        for (int m = 0; m < mt; m++) {
            acc[m] = _mm512_mullo_epi32(zv, _mm512_set1_epi32(-xsum[m * S + j]));
            acc2[m] = _mm512_setzero_si512();
        }
        for (long k = s0; k < s0 + span; k += 8) {
            const uint8_t *wk = block + (k / 8) * bn * 4;  /* 64 bytes: LROWS rows' 8 codes */
            _mm_prefetch((const char *)wk + TILE_AHEAD, _MM_HINT_T2);
            __m512i codes = _mm512_maskz_loadu_epi32(live, wk);
            __m512i lo = _mm512_and_si512(codes, low), hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
            for (int m = 0; m < mt; m++) {
                int32_t even, odd;
                memcpy(&even, xa + m * K + k, 4);
                memcpy(&odd, xa + m * K + k + 4, 4);
                dpbusd_in_place(&acc[m], lo, _mm512_set1_epi32(even));
                dpbusd_in_place(split ? &acc2[m] : &acc[m], hi, _mm512_set1_epi32(odd));
            }
        }
        __m512 ws = _mm512_load_ps(swT + g * LROWS);
        for (int m = 0; m < mt; m++) {
            __m512i sum = split ? _mm512_add_epi32(acc[m], acc2[m]) : acc[m];
            f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(xd[m * S + j]), ws), f[m]);
        }
    }
    for (int m = 0; m < mt; m++)
        _mm512_store_ps(total + m * LROWS, _mm512_add_ps(_mm512_load_ps(total + m * LROWS), f[m]));
}

/* lanes.h's quantize_int16_row: one activation row's int16 and scales per span */
static void quantize_int16_row(const uint16_t *x, long K, long span, int16_t *xq, float *xd) {
    for (long s = 0; s < K / span; s++) {
        const uint16_t *src = x + s * span;
        __m512 amax_v = _mm512_setzero_ps();
        for (long k = 0; k < span; k += 16) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(load16_bf16(src + k)));
        float amax = _mm512_reduce_max_ps(amax_v), inv = amax > 0.f ? 32767.f / amax : 0.f;
        xd[s] = amax / 32767.f;
        for (long k = 0; k < span; k += 16)
            _mm256_storeu_si256((__m256i *)(xq + s * span + k),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load16_bf16(src + k), _mm512_set1_ps(inv)))));
    }
}

/* acc += the pairwise products of w's s16 with the s16 pair at x broadcast (an embedded broadcast: no register
 * and no shuffle for it) */
static inline __attribute__((always_inline)) void dpwssd_pair(__m512i *acc, __m512i w, const int16_t *x) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(w), "m"(*(const int32_t *)x));
}

/* lanes.h's lanes_tile_int8: total [mt, LROWS] += one block's int8 products with mt int16 activation rows, a
 * vpdpwssd per 2 inputs of the block's 16 rows */
static inline __attribute__((always_inline)) void lanes_tile_int8(
        const int8_t *block, long bn, long K, long S, long span, long gsize, long k0, long kc,
        const int16_t *xq, const float *xd, const float *swT, int mt, float *total) {
    const __mmask16 live = (__mmask16)((1u << bn) - 1);
    __m512 f[LTILE];
    for (int m = 0; m < mt; m++) f[m] = _mm512_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m512i acc[LTILE];
        for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_si512();
        for (long k = s0; k < s0 + span; k += 4) {  /* a cache line of a full block's codes at a time */
            _mm_prefetch((const char *)(block + k * bn) + TILE_AHEAD, _MM_HINT_T2);
            for (int i = 0; i < 2; i++) {
                const int8_t *wk = block + (k + 2 * i) * bn;  /* 2 bn bytes: the rows' codes of 2 inputs */
                __m512i w = _mm512_cvtepi8_epi16(bn == LROWS ? _mm256_loadu_si256((const __m256i *)wk)
                                                             : _mm256_maskz_loadu_epi16(live, wk));
                for (int m = 0; m < mt; m++) dpwssd_pair(&acc[m], w, xq + m * K + k + 2 * i);
            }
        }
        __m512 ws = _mm512_load_ps(swT + g * LROWS);
        for (int m = 0; m < mt; m++)
            f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(_mm512_set1_ps(xd[m * S + j]), ws), f[m]);
    }
    for (int m = 0; m < mt; m++)
        _mm512_store_ps(total + m * LROWS, _mm512_add_ps(_mm512_load_ps(total + m * LROWS), f[m]));
}

/* ---- int3k / int2k in lanes (lanes.h): 16 rows' 4-byte words a vector; a shift and a mask make the codes of 4
 * inputs a byte each (int3: the high plane's bit moved to bit 2 and or-ed in), vpdpbusd against 4 int8 activations
 * in k order broadcast from memory: s32 sums throughout (kernels_avx2.c's integers, so the same bits) ---- */
/* acc += the products of q's u8 with the 4 s8 at x, broadcast (an embedded broadcast: no register for it) */
static inline __attribute__((always_inline)) void dpbusd_bcast(__m512i *acc, __m512i q, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(q), "m"(*(const int32_t *)x));
}

static inline __m512i lowbit_words(const uint8_t *p, long bn, __mmask16 live) {  /* LROWS rows' words */
    return bn == LROWS ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(live, p);
}

/* the codes of inputs kk .. kk + 3 (kk a multiple of 4, a constant where unrolled) of a 128-input chunk, a byte each,
 * for the block's rows */
static inline __attribute__((always_inline)) __m512i lowbit_codes4(const uint8_t *chunk, long bn, const int bits,
                                                                   const int kk, __mmask16 live) {
    const int t = kk / 32, w = kk % 32 / 4, j = kk / 16, h = kk % 16 / 4;
    __m512i q = _mm512_and_si512(_mm512_srli_epi32(lowbit_words(chunk + w * bn * 4, bn, live), 2 * t), _mm512_set1_epi8(3));
    if (bits == 3) {
        __m512i high = lowbit_words(chunk + (8 + h) * bn * 4, bn, live);
        high = j >= 2 ? _mm512_srli_epi32(high, j - 2) : _mm512_slli_epi32(high, 2 - j);
        q = _mm512_ternarylogic_epi32(q, high, _mm512_set1_epi8(4), 0xF8);  /* q | (high & 4) */
    }
    return q;
}

/* lanes_tile_lowbit for mt <= LTILE rows: each 128 inputs' 32 steps of 4 unrolled (constant shifts), spans (the
 * groups: 16, 32, 64 or 128 inputs) starting and ending inside them, counted (no division in the loop); at 4 rows
 * or fewer, two accumulators a row (the chain of vpdpbusd halved) */
static inline __attribute__((always_inline)) void lanes_tile_lowbit_part(
        const uint8_t *block, const uint8_t *sblock, __m512 d, long bn, long K, long S, long span, long k0, long kc,
        const int bits, const int8_t *xa, const float *xd, const int32_t *xsum, int mt, float *total) {
    const __mmask16 live = (__mmask16)((1u << bn) - 1);
    const __m512i zmask = _mm512_set1_epi32((1 << bits) - 1);
    const int split = mt <= 4;
    const long edge = span - 1;
    long s = k0 / span;  /* the span at hand, and its group: vnni_lowbit_product takes groups that divide CHUNK */
    __m512 f[LTILE], ws = _mm512_setzero_ps();
    __m512i acc[LTILE], acc2[LTILE];
    for (int m = 0; m < mt; m++) f[m] = _mm512_setzero_ps();
    for (long c = k0; c < k0 + kc; c += 128) {
        const uint8_t *chunk = block + c / 128 * 16 * bits * bn;
        for (int line = 0; line < 4 * bits; line++)  /* a full block's 128 inputs: 16 bits LROWS bytes, 4 bits lines */
            _mm_prefetch((const char *)chunk + TILE_AHEAD + 64 * line, _MM_HINT_T2);
        #pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {
            const long k = c + 4 * i;
            if ((k & edge) == 0) {  /* a span starts: its group's fp16(d c) (lowbit_scale), zero point and sums */
                __m512i sb = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, sblock + s * bn));  /* c << bits | z */
                __m512 code = _mm512_cvtepi32_ps(_mm512_srli_epi32(sb, bits));
                ws = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(d, code), _MM_FROUND_TO_NEAREST_INT));
                __m512i zv = _mm512_and_si512(sb, zmask);
                for (int m = 0; m < mt; m++) {
                    acc[m] = _mm512_mullo_epi32(zv, _mm512_set1_epi32(-xsum[m * S + s]));
                    acc2[m] = _mm512_setzero_si512();
                }
            }
            __m512i q = lowbit_codes4(chunk, bn, bits, 4 * i, live);
            for (int m = 0; m < mt; m++) dpbusd_bcast(split && i % 2 ? &acc2[m] : &acc[m], q, xa + m * K + k);
            if (((k + 4) & edge) == 0) {  /* the span ends */
                for (int m = 0; m < mt; m++) {
                    __m512i sum = split ? _mm512_add_epi32(acc[m], acc2[m]) : acc[m];
                    f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(xd[m * S + s]), ws), f[m]);
                }
                s++;
            }
        }
    }
    for (int m = 0; m < mt; m++)
        _mm512_store_ps(total + m * LROWS, _mm512_add_ps(_mm512_load_ps(total + m * LROWS), f[m]));
}

/* lanes.h's lanes_tile_lowbit: total [mt, LROWS] += one block's products with mt <= LTILE activation rows; compiled
 * once (not inlined): its unrolled copies are one for a full block at 1 row and at LTILE rows, and one for any other
 * (a last partial block, a few rows of a verification, a prefill's last rows), for each width */
static __attribute__((noinline)) void lanes_tile_lowbit(
        const uint8_t *block, const uint8_t *sblock, const uint16_t *row_scales, long bn, long K, long S, long span,
        long k0, long kc, int bits, const int8_t *xa, const float *xd, const int32_t *xsum, int mt, float *total) {
    __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << bn) - 1), row_scales));  /* the rows' d */
    #define LOWBIT_PART(BN, BITS, ROWS) lanes_tile_lowbit_part(block, sblock, d, BN, K, S, span, k0, kc, BITS, xa, xd, \
        xsum, ROWS, total)
    #define BY_BITS(BN, ROWS) do { if (bits == 3) LOWBIT_PART(BN, 3, ROWS); else LOWBIT_PART(BN, 2, ROWS); } while (0)
    if (bn == LROWS && mt == 1) BY_BITS(LROWS, 1);  /* a full block: no mask in the loop */
    else if (bn == LROWS && mt == LTILE) BY_BITS(LROWS, LTILE);
    else BY_BITS(bn, mt);
    #undef BY_BITS
    #undef LOWBIT_PART
}

#include "lanes.h"  /* the entry points */

#else
int qlite_vnni_abi(void) { return 0; }
#endif

/* ---- dequantization to bf16 (rounded to nearest even from the fp32 value) --------------------- */
/* 16 int8 weights times one scale, as bf16 */
static inline __attribute__((always_inline)) void dequantize_16_int8(const int8_t *w, float scale, uint16_t *out) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, _mm512_set1_ps(scale))));
}

/* 32 int4 weights (16 bytes, even k in the low nibbles) of one group, (q - zero) scale, as bf16 in k order */
static inline __attribute__((always_inline)) void dequantize_32_int4(const uint8_t *w, float scale, float zero, uint16_t *out) {
    const __m512i low = _mm512_set1_epi32(0x0f);
    const __m512i idx_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i idx_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));  /* k even */
    __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));  /* k odd */
    __m512 a = _mm512_mul_ps(_mm512_sub_ps(lo, z), s), b = _mm512_mul_ps(_mm512_sub_ps(hi, z), s);
    /* back to k order: a0 b0 a1 b1 ... */
    __m512 v0 = _mm512_permutex2var_ps(a, idx_lo, b), v1 = _mm512_permutex2var_ps(a, idx_hi, b);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
}

#include "dequantize.h"

/* ---- the small ops of a decode step -------------------------------------------------------- */
static inline __m512 exp512(__m512 x) {  /* e^x, relative error ~1e-7; 0 below -87 */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    return _mm512_scalef_ps(exp_reduced(x, n), n);
}

static inline __m512 load_bf16(const uint16_t *p) {  /* 16 bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16(__m512 v) {  /* v rounded to bf16, as fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

#define vmul(a, b) _mm512_mul_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vexp(x) exp512(x)
#define vstore_bf16(p, v) _mm256_storeu_si256((__m256i *)(p), (__m256i)_mm512_cvtneps_pbh(v))
#include "norms.h"

/* the helpers of attention.h */
static inline float dot_f32(const float *q, const float *k, long n) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* scores[s] = dot_f32(q, K + s hd, hd) for s < S, 16 keys at a time: their 16 sums reduced together, lanes paired
 * as _mm512_reduce_add_ps pairs them (i and i + 8, then i and i + 4, i and i + 2, i and i + 1), so the same bits as
 * a key at a time, for 30 shuffles and 15 adds per 16 keys instead of a reduction each */
static inline void dots_f32(const float *q, const float *K, long S, long hd, float *scores) {
    const __m512i key_at = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);  /* key i's lane */
    long s = 0;
    for (; s + 16 <= S; s += 16) {
        __m512 a[16], b[8], c[4], d[2];
        for (int k = 0; k < 16; k++) a[k] = _mm512_setzero_ps();
        for (long i = 0; i < hd; i += 16) {
            __m512 qi = _mm512_loadu_ps(q + i);
            for (int k = 0; k < 16; k++) a[k] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(K + (s + k) * hd + i), a[k]);
        }
        for (int k = 0; k < 8; k++)  /* quarters: key k's lanes i + i+8 (i < 8), then key k + 8's */
            b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[k], a[k + 8], 0x44),
                                 _mm512_shuffle_f32x4(a[k], a[k + 8], 0xee));
        for (int k = 0; k < 4; k++)  /* quarters: keys k, k + 8, k + 4, k + 12, each i + i+4 (i < 4) */
            c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88),
                                 _mm512_shuffle_f32x4(b[k], b[k + 4], 0xdd));
        for (int k = 0; k < 2; k++)  /* a quarter's 2 keys (from c[k], c[k + 2]), each i + i+2 (i < 2) */
            d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xee));
        __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
        _mm512_storeu_ps(scores + s, _mm512_permutexvar_ps(key_at, sums));
    }
    for (; s < S; s++) scores[s] = dot_f32(q, K + s * hd, hd);
}

/* acc += sum_t p[t] V[t, :] a record's 64 values (4 vectors) at a time: 4 independent chains of FMAs instead of
 * one, each vector's sum over t in the same order (the same bits as one at a time). n: 4 vectors, or 2 at the end
 * of a record of hd % 64 == 32, a constant where inlined: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void mix_add_n(const float *p, const float *V, long S, long hd, int n,
                                                             float *acc) {
    __m512 a[4];
    for (int c = 0; c < n; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (long t = 0; t < S; t++) {
        __m512 pt = _mm512_set1_ps(p[t]);
        for (int c = 0; c < n; c++) a[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(V + t * hd + 16 * c), a[c]);
    }
    for (int c = 0; c < n; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

static inline void mix_add_f32(const float *p, const float *V, long S, long hd, float *acc) {
    for (long i = 0; i < hd; i += 64) {
        if (hd - i >= 64) mix_add_n(p, V + i, S, hd, 4, acc + i);
        else mix_add_n(p, V + i, S, hd, 2, acc + i);
    }
}

/* 16 running maxima (max_ps(x, m) is x > m ? x : m, NaN x passed over), then the scan over them: a scan alone is
 * one chain of dependent max operations, ~4 cycles a score */
static inline float largest(const float *x, long n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    long s = 0;
    for (; s + 16 <= n; s += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + s), m);
    float lanes[16], best = -INFINITY;
    _mm512_storeu_ps(lanes, m);
    for (int i = 0; i < 16; i++) best = lanes[i] > best ? lanes[i] : best;
    for (; s < n; s++) best = x[s] > best ? x[s] : best;
    return best;
}

static inline float exp_sum(float *sc, long S, float mx) {
    __m512 sum = _mm512_setzero_ps();
    long s = 0;
    for (; s + 16 <= S; s += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + s), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(sc + s, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (s < S) {
        __mmask16 m = (__mmask16)((1u << (S - s)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + s), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(sc + s, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sum);
}

#include "attention.h"

/* Per row of bf16 logits (n wide, n % 16 == 0): the index of the largest value (the first of equal
 * ones, as torch.argmax) and whether every value is finite; one pass, nothing converted. */
void qlite_argmax_bf16(const uint16_t *x, long rows, long n, int64_t *argmax, uint8_t *finite) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_at = _mm512_set1_epi32(-1);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i exponent = _mm512_set1_epi32(0x7f800000), bad = _mm512_setzero_si512();
        for (long i = 0; i < n; i += 16) {
            __m512 v = load_bf16(xr + i);
            bad = _mm512_or_si512(bad, _mm512_maskz_mov_epi32(
                _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent), exponent));
            __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, more, v);
            best_at = _mm512_mask_mov_epi32(best_at, more, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
        float top = _mm512_reduce_max_ps(best);
        __mmask16 tops = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        int first = _mm512_mask_reduce_min_epi32(tops, best_at);
        argmax[r] = first < 0 ? 0 : first;  /* every value NaN or -inf: not finite anyway */
        finite[r] = !_mm512_test_epi32_mask(bad, bad);
    }
}

#include "turn.h"
#include "decode_step.h"
#endif
