/* qlite's CPU kernels for x86 with AVX2, FMA and F16C but no AVX-512 BF16 (loaded by native.py on such
 * CPUs, or anywhere with QLITE_NATIVE_ISA=avx2). kernels.c's functions, arguments and layouts, 8 floats
 * a vector:
 *   bf16, int8 and int4 weights with bf16 activations: each product exact in fp32, fp32 sums;
 *   int4 / int8 weights with integer activations (qlite_gemv_vnni), both in lanes (lanes.h): int4 with the
 *     activations quantized exactly as kernels.c quantizes them, then vpmaddubsw + vpmaddwd (u8 x s8) in
 *     place of VNNI's vpdpbusd: the same integers, so kernels.c's results bit for bit; int8 with int16
 *     activations a scale per span (kernels.c: per 8 inputs), vpmaddwd (s16 x s16);
 *   dequantization to bf16 (rounded to nearest even) for prefill;
 *   the small ops of a decode step (RMSNorm, SiLU * up, rotary + KV-cache write + attention, argmax).
 * Built by native.py: cc -O3 -march=x86-64-v3 -fopenmp -shared; without AVX2, abi() says 0. With -mavxvnni (a CPU
 * with AVX-VNNI: Intel's client cores from Alder Lake) the integer products take vpdpbusd / vpdpwssd on 8 lanes
 * in place of vpmaddubsw + vpmaddwd / vpmaddwd + vpaddd: the same integers, the same bits. */
#include "common.h"

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
int qlite_gemv_abi(void) { return 0; }
#else
#include <immintrin.h>

int qlite_gemv_abi(void) { return 1; }
int qlite_vnni_abi(void) { return 1; }
#define INTEGER_PRODUCTS  /* decode_step.h calls qlite_gemv_vnni */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load_bf16(const uint16_t *p) {  /* 8 bf16 -> fp32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void store_bf16(uint16_t *p, __m256 v) {  /* 8 fp32 -> bf16, round to nearest even; NaN stays NaN */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

static inline __m256 load_int8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* ---- bf16 and int8 weights (rows.h), then int4 ------------------------------------------------ */
/* the vector vocabulary of rows.h's bf16 and int8 bodies: 8 fp32 lanes; bf16 widened to fp32, then fma */
typedef __m256 vec;
typedef __m256 bvec;
#define VW 8
#define BW 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vset1(x) _mm256_set1_ps(x)
#define vsum(v) hsum(v)
#define vload_i8(p) load_int8(p)
#define bload(p) load_bf16(p)
#define bdot(acc, w, x) _mm256_fmadd_ps(load_bf16(w), x, acc)
#define BF16_PREFETCH(wr, K) _mm_prefetch((const char *)((wr) + AHEAD * (K)), _MM_HINT_T0)
#define INT8_PREFETCH(wr, K) _mm_prefetch((const char *)((wr) + AHEAD * (K)), _MM_HINT_T0)
#include "rows.h"


/* ---- int4 weights, bf16 activations --------------------------------------------------------- */
/* xe/xo: the even and odd activations of one row (fp32, K/2 each); xsum: each group's sum of x.
 * A group's product is sum q x - z sum x (q, z: the codes and zero point), times its scale. */
static inline __attribute__((always_inline)) void int4_rows(
        const float *xe, const float *xo, const float *xsum, const uint8_t *w, const uint16_t *scales,
        const uint8_t *zeros, long K, long G, int nrows, float *out) {
    long gbytes = K / G / 2;
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m256 total[ROWS];
    float corr[ROWS];  /* sum_g s z xsum */
    for (int r = 0; r < nrows; r++) {
        total[r] = _mm256_setzero_ps();
        corr[r] = 0.f;
        for (long g = 0; g < G; g++) corr[r] += _cvtsh_ss(scales[r * G + g]) * (float)zeros[r * G + g] * xsum[g];
    }
    for (long g = 0; g < G; g++) {
        __m256 acc[ROWS];
        for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
        for (long b = g * gbytes; b < (g + 1) * gbytes; b += 8) {  /* 8 bytes = 16 weights */
            __m256 xev = _mm256_loadu_ps(xe + b), xov = _mm256_loadu_ps(xo + b);
            for (int r = 0; r < nrows; r++) {
                const uint8_t *wr = w + r * K / 2 + b;
                _mm_prefetch((const char *)(wr + AHEAD * K / 2), _MM_HINT_T0);
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)wr));
                __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, low)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
                acc[r] = _mm256_fmadd_ps(hi, xov, _mm256_fmadd_ps(lo, xev, acc[r]));
            }
        }
        for (int r = 0; r < nrows; r++) total[r] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(scales[r * G + g])), acc[r], total[r]);
    }
    for (int r = 0; r < nrows; r++) out[r] = hsum(total[r]) - corr[r];
}

typedef float int4_act;  /* int4_rows takes its activations as fp32 */
static inline float to_int4_act(uint16_t v) { return bf16_to_f32(v); }

#include "drivers.h"


/* ---- int3k / int2k weights (lowbit.h): kernels.c's shifts and masks give 32 inputs' codes, each 8 of them
 * widened to fp32 and multiplied with fp32 activations (each product exact), then the group scales ---- */
typedef float lowbit_act;
static inline float to_lowbit_act(uint16_t v) { return bf16_to_f32(v); }

static inline __m256 widen8(__m128i bytes) {  /* the low 8 bytes -> 8 fp32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __attribute__((always_inline)) void lowbit_rows(
        const float *x, float (*s32)[LOWBIT_MAX_GROUPS], const uint8_t *w, long row_bytes, const int bits, long K, long G,
        const int nrows, float *out) {
    long gsize = K / G, block_bytes = 16 * bits;
    const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    __m256 total[ROWS];
    for (int r = 0; r < nrows; r++) total[r] = _mm256_setzero_ps();
    for (long b = 0; b < K / 128; b++) {
        const float *xb = x + 128 * b;
        for (int r = 0; r < nrows; r++) {
            const uint8_t *wr = w + r * row_bytes + b * block_bytes;
            _mm_prefetch((const char *)(wr + AHEAD * row_bytes), _MM_HINT_T0);
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
                __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                const float *xt = xb + 32 * t;
                __m256 first = _mm256_fmadd_ps(widen8(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(xt + 8),
                                               _mm256_mul_ps(widen8(q0), _mm256_loadu_ps(xt)));  /* inputs 0..15 */
                __m256 second = _mm256_fmadd_ps(widen8(_mm_srli_si128(q1, 8)), _mm256_loadu_ps(xt + 24),
                                                _mm256_mul_ps(widen8(q1), _mm256_loadu_ps(xt + 16)));  /* 16..31 */
                long k0 = 128 * b + 32 * t;
                total[r] = _mm256_fmadd_ps(_mm256_set1_ps(s32[r][k0 / gsize]), first, total[r]);
                total[r] = _mm256_fmadd_ps(_mm256_set1_ps(s32[r][(k0 + 16) / gsize]), second, total[r]);
            }
        }
    }
    for (int r = 0; r < nrows; r++) out[r] = hsum(total[r]);
}

#include "lowbit.h"


/* ---- integer activations: int4 and int8 weights in lanes (lanes.h) --------------------------------------
 * int4: kernels.c's numerics, the same integers from the same activations, so the same results bit for bit
 * (lanes.h's float steps, lane by lane); int8: lanes.h's own (int16 activations per span). */

/* the largest |x| of n bf16 (n a multiple of 8) */
static inline float absmax_bf16(const uint16_t *p, long n) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (long k = 0; k < n; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load_bf16(p + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* int4 in lanes: 8 weight rows a vector. AVX2 has no vpdpbusd: vpmaddubsw (u8 codes x s8 inputs, pairs to s16)
 * for the even and the odd inputs of a word, 4 words (32 inputs) summed in s16 (at most 16 * 15 * 127 < 2^15:
 * exact), then vpmaddwd with ones to s32 lanes: the same integers as vpdpbusd's. */
#define LROWS 8
#define LTILE 8  /* activation rows per pass over a block's inputs: int8 8 s32 sums in registers, int4 4 at a time (4 s16
                  * and 4 s32 sums): measured 1.4-1.6x and 0.93-0.96x as fast as 4 at a time for int8, 8 for int4 */
#define INT4_TILE 4
#define LGROUP 8  /* blocks a thread takes at a time past 16 rows: each activation block read once for 64 weight rows */

/* lanes.h's quantize_lanes_row: one activation row's int8, scales and sums per span */
static void quantize_lanes_row(const uint16_t *x, long K, long span, int8_t *xa, float *xd, int32_t *xsum, int natural) {
    const __m256i even_odd = natural ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7) : _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (long s = 0; s < K / span; s++) {
        const uint16_t *src = x + s * span;
        float amax = absmax_bf16(src, span), inv = amax > 0.f ? 127.f / amax : 0.f;
        xd[s] = amax / 127.f;
        __m256i sum = _mm256_setzero_si256();
        for (long k = 0; k < span; k += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16(src + k), _mm256_set1_ps(inv)));
            sum = _mm256_add_epi32(sum, q);
            q = _mm256_permutevar8x32_epi32(q, even_odd);
            __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(xa + s * span + k), _mm_packs_epi16(w16, w16));
        }
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        xsum[s] = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
    }
}

/* GCC (12, -O3) otherwise issues all 32 vpmaddubsw of a 32-input step first, spills ~20 of them and sums each
 * row's after (the products are independent): an empty asm that holds the row's sum in a register keeps each
 * product added as it comes. Same bits. Zen 3: the inner tile alone 1.37x (one thread, codes in L1, medians of
 * 12 runs), the product at 8-16 rows 1.03-1.15x on one thread, level on two (BENCHMARKS.md, ninth session). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))

/* lanes_tile for mt <= INT4_TILE rows */
static inline __attribute__((always_inline)) void lanes_tile_part(
        const uint8_t *block, long bn, long K, long S, long span, long gsize, long k0, long kc,
        const int8_t *xa, const float *xd, const int32_t *xsum, const float *swT, const int32_t *zT, int mt, float *total) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)bn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 f[INT4_TILE];
    for (int m = 0; m < mt; m++) f[m] = _mm256_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m256i acc[INT4_TILE];
        __m256i zv = _mm256_load_si256((const __m256i *)(zT + g * LROWS));
        for (int m = 0; m < mt; m++) acc[m] = _mm256_mullo_epi32(zv, _mm256_set1_epi32(-xsum[m * S + j]));
#ifdef __AVXVNNI__  /* kernels.c's tile on 8 lanes: a vpdpbusd per 4 inputs, two sums a row (halved chains) */
        __m256i acc2[INT4_TILE];
        for (int m = 0; m < mt; m++) acc2[m] = _mm256_setzero_si256();
        const uint8_t *wk = block + s0 / 8 * bn * 4;  /* LROWS rows' 8 codes a word, 2 words a pass */
        const int8_t *xk = xa + s0;
        for (long k = 0; k < span; k += 16, wk += 8 * bn, xk += 16) {
            _mm_prefetch((const char *)wk + TILE_AHEAD, _MM_HINT_T2);
            for (int h = 0; h < 2; h++) {
                __m256i codes = bn == LROWS ? _mm256_loadu_si256((const __m256i *)(wk + 4 * h * bn))
                                            : _mm256_maskload_epi32((const int *)(wk + 4 * h * bn), live);
                __m256i lo = _mm256_and_si256(codes, low), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
                for (int m = 0; m < mt; m++) {
                    int32_t even, odd;
                    memcpy(&even, xk + m * K + 8 * h, 4);
                    memcpy(&odd, xk + m * K + 8 * h + 4, 4);
                    acc[m] = _mm256_dpbusd_avx_epi32(acc[m], lo, _mm256_set1_epi32(even));
                    acc2[m] = _mm256_dpbusd_avx_epi32(acc2[m], hi, _mm256_set1_epi32(odd));
                    KEEP_IN_REGISTER(acc[m]);
                    KEEP_IN_REGISTER(acc2[m]);
                }
            }
        }
        for (int m = 0; m < mt; m++) acc[m] = _mm256_add_epi32(acc[m], acc2[m]);
#else
        for (long k = s0; k < s0 + span; k += 32) {
            __m256i p[INT4_TILE];
            for (int m = 0; m < mt; m++) p[m] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const uint8_t *wk = block + (k / 8 + i) * bn * 4;  /* 32 bytes: LROWS rows' 8 codes */
                if (i % 2 == 0) _mm_prefetch((const char *)wk + TILE_AHEAD, _MM_HINT_T2);
                __m256i codes = bn == LROWS ? _mm256_loadu_si256((const __m256i *)wk) : _mm256_maskload_epi32((const int *)wk, live);
                __m256i lo = _mm256_and_si256(codes, low), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
                for (int m = 0; m < mt; m++) {
                    int32_t even, odd;
                    memcpy(&even, xa + m * K + k + 8 * i, 4);
                    memcpy(&odd, xa + m * K + k + 8 * i + 4, 4);
                    p[m] = _mm256_add_epi16(p[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)));
                    p[m] = _mm256_add_epi16(p[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd)));
                    KEEP_IN_REGISTER(p[m]);
                }
            }
            for (int m = 0; m < mt; m++) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p[m], ones));
        }
#endif
        __m256 ws = _mm256_load_ps(swT + g * LROWS);
        for (int m = 0; m < mt; m++)
            f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(_mm256_set1_ps(xd[m * S + j]), ws), f[m]);
    }
    for (int m = 0; m < mt; m++)
        _mm256_store_ps(total + m * LROWS, _mm256_add_ps(_mm256_load_ps(total + m * LROWS), f[m]));
}

/* the two pair tiles' float steps (lanes.h): f += (float)sum * (xs ws) per block, span by span, for mt rows of
 * per-span scales xd (stride S); then each block's total += f */
static inline __attribute__((always_inline)) void pair_float_step(
        const __m256i *a0, const __m256i *a1, const float *sw0, const float *sw1, const float *xd, long S, int mt,
        __m256 *f0, __m256 *f1) {
    __m256 ws0 = _mm256_load_ps(sw0), ws1 = _mm256_load_ps(sw1);
    for (int m = 0; m < mt; m++) {
        __m256 xs = _mm256_set1_ps(xd[m * S]);
        f0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[m]), _mm256_mul_ps(xs, ws0), f0[m]);
        f1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[m]), _mm256_mul_ps(xs, ws1), f1[m]);
    }
}

static inline __attribute__((always_inline)) void pair_totals(const __m256 *f0, const __m256 *f1, int mt, float *t0, float *t1) {
    for (int m = 0; m < mt; m++) {
        _mm256_store_ps(t0 + m * LROWS, _mm256_add_ps(_mm256_load_ps(t0 + m * LROWS), f0[m]));
        _mm256_store_ps(t1 + m * LROWS, _mm256_add_ps(_mm256_load_ps(t1 + m * LROWS), f1[m]));
    }
}

/* lanes.h's lanes_tile_pair (LANES_PAIRS): two full blocks of weight rows (b0, b1; tables sw0, z0 and sw1, z1,
 * totals t0 and t1) for mt <= PAIR_TILE activation rows, each activation word broadcast once for both blocks'
 * vpmaddubsw: half the broadcasts of two lanes_tile calls, the same integer sums and float steps per block
 * (same bits). 3 rows a pass: 4 spilled (a C harness, Zen 3, two threads: 3 rows 1.15-1.37x two lanes_tile
 * calls at 4-16 rows, 4 rows 1.11x / 0.90x at 8 / 16). The product from memory (kernel_bench --against):
 * int4-g128 0.98-1.10x at 3-8 rows, g32 / g64 / int4k 1.10-1.29x at 8-16, 1.14-1.31x at 128. */
#define PAIR_TILE 3
#define LANES_PAIRS
#ifdef __AVXVNNI__
#define INT4_PAIRS 0  /* int4 in lanes_tile only (the pair tile is vpmaddubsw's, not written for vpdpbusd) */
#else
#define INT4_PAIRS 1
#endif
static inline __attribute__((always_inline)) void lanes_tile_pair(
        const uint8_t *b0, const uint8_t *b1, long K, long S, long span, long gsize, long k0, long kc,
        const int8_t *xa, const float *xd, const int32_t *xsum, const float *sw0, const float *sw1,
        const int32_t *z0, const int32_t *z1, int mt, float *t0, float *t1) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 f0[PAIR_TILE], f1[PAIR_TILE];
    for (int m = 0; m < mt; m++) f0[m] = f1[m] = _mm256_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m256i a0[PAIR_TILE], a1[PAIR_TILE];
        __m256i zv0 = _mm256_load_si256((const __m256i *)(z0 + g * LROWS)), zv1 = _mm256_load_si256((const __m256i *)(z1 + g * LROWS));
        for (int m = 0; m < mt; m++) {
            __m256i xs = _mm256_set1_epi32(-xsum[m * S + j]);
            a0[m] = _mm256_mullo_epi32(zv0, xs);
            a1[m] = _mm256_mullo_epi32(zv1, xs);
        }
        for (long k = s0; k < s0 + span; k += 32) {
            __m256i p0[PAIR_TILE], p1[PAIR_TILE];
            for (int m = 0; m < mt; m++) p0[m] = p1[m] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const uint8_t *w0 = b0 + (k / 8 + i) * LROWS * 4, *w1 = b1 + (k / 8 + i) * LROWS * 4;
                if (i % 2 == 0) { _mm_prefetch((const char *)w0 + TILE_AHEAD, _MM_HINT_T2); _mm_prefetch((const char *)w1 + TILE_AHEAD, _MM_HINT_T2); }
                __m256i c0 = _mm256_loadu_si256((const __m256i *)w0), c1 = _mm256_loadu_si256((const __m256i *)w1);
                __m256i lo0 = _mm256_and_si256(c0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), low);
                __m256i lo1 = _mm256_and_si256(c1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), low);
                for (int m = 0; m < mt; m++) {
                    int32_t even, odd;
                    memcpy(&even, xa + m * K + k + 8 * i, 4);
                    memcpy(&odd, xa + m * K + k + 8 * i + 4, 4);
                    __m256i e = _mm256_set1_epi32(even), o = _mm256_set1_epi32(odd);
                    p0[m] = _mm256_add_epi16(p0[m], _mm256_maddubs_epi16(lo0, e));
                    p0[m] = _mm256_add_epi16(p0[m], _mm256_maddubs_epi16(hi0, o));
                    KEEP_IN_REGISTER(p0[m]);
                    p1[m] = _mm256_add_epi16(p1[m], _mm256_maddubs_epi16(lo1, e));
                    p1[m] = _mm256_add_epi16(p1[m], _mm256_maddubs_epi16(hi1, o));
                    KEEP_IN_REGISTER(p1[m]);
                }
            }
            for (int m = 0; m < mt; m++) {
                a0[m] = _mm256_add_epi32(a0[m], _mm256_madd_epi16(p0[m], ones));
                a1[m] = _mm256_add_epi32(a1[m], _mm256_madd_epi16(p1[m], ones));
            }
        }
        pair_float_step(a0, a1, sw0 + g * LROWS, sw1 + g * LROWS, xd + j, S, mt, f0, f1);
    }
    pair_totals(f0, f1, mt, t0, t1);
}

/* lanes.h's lanes_tile: total [mt, LROWS] += one block's products with mt activation rows, INT4_TILE at a time */
static inline __attribute__((always_inline)) void lanes_tile(
        const uint8_t *block, long bn, long K, long S, long span, long gsize, long k0, long kc,
        const int8_t *xa, const float *xd, const int32_t *xsum, const float *swT, const int32_t *zT, int mt, float *total) {
    for (int m0 = 0; m0 < mt; m0 += INT4_TILE) {
        int rows = mt - m0 < INT4_TILE ? mt - m0 : INT4_TILE;
        if (bn == LROWS)  /* a full block: its own copy, no mask in the loop */
            lanes_tile_part(block, LROWS, K, S, span, gsize, k0, kc, xa + m0 * K, xd + m0 * S, xsum + m0 * S, swT, zT,
                            rows, total + m0 * LROWS);
        else
            lanes_tile_part(block, bn, K, S, span, gsize, k0, kc, xa + m0 * K, xd + m0 * S, xsum + m0 * S, swT, zT,
                            rows, total + m0 * LROWS);
    }
}

/* int8 in lanes (lanes.h): 8 weight rows a vector as s16, 2 inputs of an activation row (int16) broadcast, a
 * vpmaddwd per 2 inputs (kernels.c: 16 rows, vpdpwssd; the same integers; AVX-VNNI: vpdpwssd) */

/* acc + the pairwise s16 products of w and x, summed in s32 lanes (wrapping): vpdpwssd where the CPU has AVX-VNNI,
 * else vpmaddwd and vpaddd (the same integers) */
static inline __attribute__((always_inline)) __m256i madd_pairs(__m256i acc, __m256i w, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

/* lanes.h's quantize_int16_row: one activation row's int16 and scales per span */
static void quantize_int16_row(const uint16_t *x, long K, long span, int16_t *xq, float *xd) {
    for (long s = 0; s < K / span; s++) {
        const uint16_t *src = x + s * span;
        float amax = absmax_bf16(src, span), inv = amax > 0.f ? 32767.f / amax : 0.f;
        xd[s] = amax / 32767.f;
        for (long k = 0; k < span; k += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16(src + k), _mm256_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(xq + s * span + k),
                             _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
        }
    }
}

/* lanes.h's lanes_tile_int8: total [mt, LROWS] += one block's int8 products with mt int16 activation rows */
static inline __attribute__((always_inline)) void lanes_tile_int8(
        const int8_t *block, long bn, long K, long S, long span, long gsize, long k0, long kc,
        const int16_t *xq, const float *xd, const float *swT, int mt, float *total) {
    __m256 f[LTILE];
    for (int m = 0; m < mt; m++) f[m] = _mm256_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m256i acc[LTILE];
        for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_si256();
        for (long k = s0; k < s0 + span; k += 8) {  /* a cache line of codes at a time */
            _mm_prefetch((const char *)(block + k * bn) + TILE_AHEAD, _MM_HINT_T2);
            for (int i = 0; i < 4; i++) {
                const int8_t *wk = block + (k + 2 * i) * bn;  /* 16 bytes: LROWS rows' 2 codes */
                __m128i codes;
                if (bn == LROWS) codes = _mm_loadu_si128((const __m128i *)wk);
                else { int8_t room[16] = {0}; memcpy(room, wk, 2 * bn); codes = _mm_loadu_si128((const __m128i *)room); }
                __m256i w = _mm256_cvtepi8_epi16(codes);
                for (int m = 0; m < mt; m++) {
                    int32_t pair;
                    memcpy(&pair, xq + m * K + k + 2 * i, 4);
                    acc[m] = madd_pairs(acc[m], w, _mm256_set1_epi32(pair));
                }
            }
        }
        __m256 ws = _mm256_load_ps(swT + g * LROWS);
        for (int m = 0; m < mt; m++)
            f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(_mm256_set1_ps(xd[m * S + j]), ws), f[m]);
    }
    for (int m = 0; m < mt; m++)
        _mm256_store_ps(total + m * LROWS, _mm256_add_ps(_mm256_load_ps(total + m * LROWS), f[m]));
}

/* lanes.h's lanes_tile_int8_pair (LANES_PAIRS): lanes_tile_int8 for two full blocks (b0, b1; tables sw0, sw1;
 * totals t0, t1) and mt <= PAIR_TILE_INT8 activation rows, each activation pair broadcast once for both blocks'
 * vpmaddwd and each row's sums held in registers: the same integer sums and float steps per block (same bits).
 * A C harness (one thread, a block's codes in L1): 1.45x lanes_tile_int8 at 8 rows (70-74 against 48-51 G
 * multiply-adds/s); the register hold alone, on 8 rows of one block, 0.55x (BENCHMARKS.md, tenth session). */
#define PAIR_TILE_INT8 4
static inline __attribute__((always_inline)) void lanes_tile_int8_pair(
        const int8_t *b0, const int8_t *b1, long K, long S, long span, long gsize, long k0, long kc,
        const int16_t *xq, const float *xd, const float *sw0, const float *sw1, int mt, float *t0, float *t1) {
    __m256 f0[PAIR_TILE_INT8], f1[PAIR_TILE_INT8];
    for (int m = 0; m < mt; m++) f0[m] = f1[m] = _mm256_setzero_ps();
    for (long s0 = k0; s0 < k0 + kc; s0 += span) {
        long j = s0 / span, g = s0 / gsize;
        __m256i a0[PAIR_TILE_INT8], a1[PAIR_TILE_INT8];
        for (int m = 0; m < mt; m++) a0[m] = a1[m] = _mm256_setzero_si256();
        for (long k = s0; k < s0 + span; k += 8) {  /* a cache line of each block's codes at a time */
            _mm_prefetch((const char *)(b0 + k * LROWS) + TILE_AHEAD, _MM_HINT_T2);
            _mm_prefetch((const char *)(b1 + k * LROWS) + TILE_AHEAD, _MM_HINT_T2);
            for (int i = 0; i < 4; i++) {
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b0 + (k + 2 * i) * LROWS)));
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b1 + (k + 2 * i) * LROWS)));
                for (int m = 0; m < mt; m++) {
                    int32_t pair;
                    memcpy(&pair, xq + m * K + k + 2 * i, 4);
                    __m256i x = _mm256_set1_epi32(pair);
                    a0[m] = madd_pairs(a0[m], w0, x);
                    KEEP_IN_REGISTER(a0[m]);
                    a1[m] = madd_pairs(a1[m], w1, x);
                    KEEP_IN_REGISTER(a1[m]);
                }
            }
        }
        pair_float_step(a0, a1, sw0 + g * LROWS, sw1 + g * LROWS, xd + j, S, mt, f0, f1);
    }
    pair_totals(f0, f1, mt, t0, t1);
}

/* ---- int3k / int2k in lanes (lanes.h): LROWS rows' 4-byte words side by side, a shift and a mask make the
 * codes of 4 inputs a byte each (int3: the high plane's bit moved to bit 2 and or-ed in), vpmaddubsw against 4 int8
 * activations in k order, s16 sums widened to s32 every 32 inputs (at most 8 x 2 x 7 x 127: no saturation) ---- */
static inline __m256i lowbit_words(const uint8_t *p, long bn, __m256i live) {  /* LROWS rows' words */
    return bn == LROWS ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, live);
}

/* the codes of inputs kk .. kk + 3 (kk a multiple of 4, a constant where unrolled) of a 128-input chunk, a byte each,
 * for the block's rows */
static inline __attribute__((always_inline)) __m256i lowbit_codes4(const uint8_t *chunk, long bn, const int bits,
                                                                   const int kk, __m256i live) {
    const int t = kk / 32, w = kk % 32 / 4, j = kk / 16, h = kk % 16 / 4;
    __m256i q = _mm256_and_si256(_mm256_srli_epi32(lowbit_words(chunk + w * bn * 4, bn, live), 2 * t), _mm256_set1_epi8(3));
    if (bits == 3) {
        __m256i high = lowbit_words(chunk + (8 + h) * bn * 4, bn, live);
        high = j >= 2 ? _mm256_srli_epi32(high, j - 2) : _mm256_slli_epi32(high, 2 - j);
        q = _mm256_or_si256(q, _mm256_and_si256(high, _mm256_set1_epi8(4)));
    }
    return q;
}

/* lanes_tile_lowbit for mt <= INT4_TILE rows: each 128 inputs' 32 steps of 4 unrolled (constant shifts), spans
 * (the groups: 16, 32, 64 or 128 inputs) starting and ending inside them, counted (no division in the loop) */
static inline __attribute__((always_inline)) void lanes_tile_lowbit_part(
        const uint8_t *block, const uint8_t *sblock, __m256 d, long bn, long K, long S, long span, long k0, long kc,
        const int bits, const int8_t *xa, const float *xd, const int32_t *xsum, int mt, float *total) {
    const __m256i ones = _mm256_set1_epi16(1), zmask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)bn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const long edge = span - 1;
    long s = k0 / span;  /* the span at hand, and its group: vnni_lowbit_product takes groups that divide CHUNK */
    __m256 f[INT4_TILE], ws = _mm256_setzero_ps();
    __m256i acc[INT4_TILE], p[INT4_TILE];
    for (int m = 0; m < mt; m++) f[m] = _mm256_setzero_ps();
    for (long c = k0; c < k0 + kc; c += 128) {
        const uint8_t *chunk = block + c / 128 * 16 * bits * bn;
        for (int line = 0; line < 2 * bits; line++)  /* a full block's 128 inputs: 16 bits LROWS bytes, 2 bits lines */
            _mm_prefetch((const char *)chunk + TILE_AHEAD + 64 * line, _MM_HINT_T2);
        #pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {
            const long k = c + 4 * i;
            if ((k & edge) == 0) {  /* a span starts: its group's fp16(d c) (lowbit_scale), zero point and sums */
                uint8_t sbytes[LROWS] = {0};  /* the group's scale bytes c << bits | z, a row's each */
                if (bn < LROWS)
                    memcpy(sbytes, sblock + s * bn, bn);
                __m256i sb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bn < LROWS ? sbytes : sblock + s * bn)));
                __m256 code = _mm256_cvtepi32_ps(_mm256_srli_epi32(sb, bits));
                ws = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(d, code), _MM_FROUND_TO_NEAREST_INT));
                __m256i zv = _mm256_and_si256(sb, zmask);
                for (int m = 0; m < mt; m++) acc[m] = _mm256_mullo_epi32(zv, _mm256_set1_epi32(-xsum[m * S + s]));
            }
            if (i % 8 == 0 || (k & edge) == 0)
                for (int m = 0; m < mt; m++) p[m] = _mm256_setzero_si256();
            __m256i q = lowbit_codes4(chunk, bn, bits, 4 * i, live);
            for (int m = 0; m < mt; m++) {
                int32_t x4;
                memcpy(&x4, xa + m * K + k, 4);
                p[m] = _mm256_add_epi16(p[m], _mm256_maddubs_epi16(q, _mm256_set1_epi32(x4)));
                KEEP_IN_REGISTER(p[m]);
            }
            if (i % 8 == 7 || ((k + 4) & edge) == 0)  /* s16 sums of at most 32 inputs widened */
                for (int m = 0; m < mt; m++) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p[m], ones));
            if (((k + 4) & edge) == 0) {  /* the span ends */
                for (int m = 0; m < mt; m++)
                    f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(_mm256_set1_ps(xd[m * S + s]), ws), f[m]);
                s++;
            }
        }
    }
    for (int m = 0; m < mt; m++)
        _mm256_store_ps(total + m * LROWS, _mm256_add_ps(_mm256_load_ps(total + m * LROWS), f[m]));
}

/* lanes.h's lanes_tile_lowbit: total [mt, LROWS] += one block's products with mt activation rows, INT4_TILE at a time;
 * compiled once (not inlined): its unrolled copies are one for a full block at 1 row and at INT4_TILE rows, and one
 * for any other (a last partial block, a prefill's last rows), for each width */
static __attribute__((noinline)) void lanes_tile_lowbit(
        const uint8_t *block, const uint8_t *sblock, const uint16_t *row_scales, long bn, long K, long S, long span,
        long k0, long kc, int bits, const int8_t *xa, const float *xd, const int32_t *xsum, int mt,
        float *total) {
    uint16_t rs[LROWS] = {0};  /* the rows' d */
    memcpy(rs, row_scales, sizeof(uint16_t) * bn);
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rs));
    for (int m0 = 0; m0 < mt; m0 += INT4_TILE) {
        int rows = mt - m0 < INT4_TILE ? mt - m0 : INT4_TILE;
        #define LOWBIT_PART(BN, BITS, ROWS) lanes_tile_lowbit_part(block, sblock, d, BN, K, S, span, k0, kc, BITS, \
            xa + m0 * K, xd + m0 * S, xsum + m0 * S, ROWS, total + m0 * LROWS)
        #define BY_BITS(BN, ROWS) do { if (bits == 3) LOWBIT_PART(BN, 3, ROWS); else LOWBIT_PART(BN, 2, ROWS); } while (0)
        if (bn == LROWS && rows == 1) BY_BITS(LROWS, 1);  /* a full block: no mask in the loop */
        else if (bn == LROWS && rows == INT4_TILE) BY_BITS(LROWS, INT4_TILE);
        else BY_BITS(bn, rows);
        #undef BY_BITS
        #undef LOWBIT_PART
    }
}

#include "lanes.h"

/* ---- dequantization to bf16 (rounded to nearest even from the fp32 value) --------------------- */
/* 16 int8 weights times one scale, as bf16 */
static inline __attribute__((always_inline)) void dequantize_16_int8(const int8_t *w, float scale, uint16_t *out) {
    store_bf16(out, _mm256_mul_ps(load_int8(w), _mm256_set1_ps(scale)));
    store_bf16(out + 8, _mm256_mul_ps(load_int8(w + 8), _mm256_set1_ps(scale)));
}

/* 32 int4 weights (16 bytes, even k in the low nibbles) of one group, (q - zero) scale, as bf16 in k order */
static inline __attribute__((always_inline)) void dequantize_32_int4(const uint8_t *w, float scale, float zero, uint16_t *out) {
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
    __m128i b = _mm_loadu_si128((const __m128i *)w);
    __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    __m128i codes[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  /* k order */
    for (int i = 0; i < 4; i++) {
        __m128i eight = i % 2 ? _mm_srli_si128(codes[i / 2], 8) : codes[i / 2];
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
        store_bf16(out + 8 * i, _mm256_mul_ps(_mm256_sub_ps(q, z), s));
    }
}

#include "dequantize.h"
/* ---- the small ops of a decode step (kernels.c's, 8 floats a vector) ---------------------------- */
static inline __m256 exp256(__m256 x) {  /* e^x, relative error ~1e-7; 0 below -87, finite (not inf) above 88 */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p = exp_reduced(x, n);
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  /* n in -126..127 */
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

static inline __m256 round_bf16(__m256 v) {  /* v rounded to bf16 (nearest even), as fp32; v finite */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000)));
}

#define vmul(a, b) _mm256_mul_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vexp(x) exp256(x)
#define vstore_bf16(p, v) store_bf16(p, v)
#include "norms.h"

/* the helpers of attention.h */
static inline float dot_f32(const float *q, const float *k, long n) {
    __m256 acc = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    return hsum(acc);
}

/* scores[s] = dot_f32(q, K + s hd, hd) for s < S, 8 keys at a time: their 8 sums reduced together, lanes paired
 * as hsum pairs them (i and i + 4, then i and i + 2, i and i + 1), so the same bits as a key at a time */
static inline void dots_f32(const float *q, const float *K, long S, long hd, float *scores) {
    const __m256i key_at = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);  /* key i's lane */
    long s = 0;
    for (; s + 8 <= S; s += 8) {
        __m256 a[8], b[4], c[2];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        for (long i = 0; i < hd; i += 8) {
            __m256 qi = _mm256_loadu_ps(q + i);
            for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(K + (s + k) * hd + i), a[k]);
        }
        for (int k = 0; k < 4; k++)  /* halves: keys k, k + 4, each i + i+4 (i < 4) */
            b[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[k], a[k + 4], 0x20), _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
        for (int k = 0; k < 2; k++)  /* a half's 2 keys (from b[k], b[k + 2]), each i + i+2 (i < 2) */
            c[k] = _mm256_add_ps(_mm256_shuffle_ps(b[k], b[k + 2], 0x44), _mm256_shuffle_ps(b[k], b[k + 2], 0xee));
        __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
        _mm256_storeu_ps(scores + s, _mm256_permutevar8x32_ps(sums, key_at));
    }
    for (; s < S; s++) scores[s] = dot_f32(q, K + s * hd, hd);
}

/* 32 values (4 vectors) at a time: 4 independent chains of FMAs instead of one, each vector's sum over t in the
 * same order (the same bits as one at a time) */
static inline void mix_add_f32(const float *p, const float *V, long S, long hd, float *acc) {
    for (long i = 0; i < hd; i += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8);
        __m256 a2 = _mm256_loadu_ps(acc + i + 16), a3 = _mm256_loadu_ps(acc + i + 24);
        for (long t = 0; t < S; t++) {
            __m256 pt = _mm256_set1_ps(p[t]);
            const float *v = V + t * hd + i;
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + i, a0);
        _mm256_storeu_ps(acc + i + 8, a1);
        _mm256_storeu_ps(acc + i + 16, a2);
        _mm256_storeu_ps(acc + i + 24, a3);
    }
}

/* 8 running maxima (max_ps(x, m) is x > m ? x : m, NaN x passed over), then the scan over them: a scan alone is
 * one chain of dependent max operations, ~4 cycles a score */
static inline float largest(const float *x, long n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    long s = 0;
    for (; s + 8 <= n; s += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + s), m);
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    for (; s < n; s++) best = x[s] > best ? x[s] : best;
    return best;
}

static inline float exp_sum(float *sc, long S, float mx) {
    float sum = 0.f;
    long s = 0;
    for (; s + 8 <= S; s += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + s), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(sc + s, e);
        sum += hsum(e);
    }
    for (; s < S; s++) { sc[s] = expf(sc[s] - mx); sum += sc[s]; }
    return sum;
}

#include "attention.h"

/* Per row of bf16 logits (n wide, n % 8 == 0): the index of the largest value (the first of equal
 * ones, as torch.argmax) and whether every value is finite; one pass, nothing converted. */
void qlite_argmax_bf16(const uint16_t *x, long rows, long n, int64_t *argmax, uint8_t *finite) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY);
        __m256i best_at = _mm256_set1_epi32(-1), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i exponent = _mm256_set1_epi32(0x7f800000), bad = _mm256_setzero_si256();
        for (long i = 0; i < n; i += 8) {
            __m256 v = load_bf16(xr + i);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
            __m256 more = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            best = _mm256_blendv_ps(best, v, more);
            best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(more));
            at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
        }
        float lanes[8];
        int32_t lane_at[8];
        _mm256_storeu_ps(lanes, best);
        _mm256_storeu_si256((__m256i *)lane_at, best_at);
        int first = -1;
        float top = -INFINITY;
        for (int l = 0; l < 8; l++)  /* the largest, the first index among equals */
            if (lane_at[l] >= 0 && (first < 0 || lanes[l] > top || (lanes[l] == top && lane_at[l] < first)))
                top = lanes[l], first = lane_at[l];
        argmax[r] = first < 0 ? 0 : first;  /* every value NaN or -inf: not finite anyway */
        finite[r] = _mm256_testz_si256(bad, bad);
    }
}

#include "turn.h"
#include "decode_step.h"
#endif
