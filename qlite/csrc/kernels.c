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
 * With AVX-512 VNNI, qlite_gemv_vnni does the same products with the activations in integers (below).
 * For many rows (prefill), int4 weights meet int8 activations in a GEMM (int_gemm.h); the dequantize_*
 * functions write bf16 weights for the other formats' many-row case, where a bf16 matmul wins.
 * Then the small ops of a decode step, each one call instead of several torch ops: RMSNorm, silu(gate) * up,
 * and rotary + KV-cache write + attention for one token.
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


/* ---- integer activations x int4 / int8 weights (VNNI) --------------------------------------------
 * llama.cpp's idea: quantize the activations of a decode step once, then multiply in integers.
 *   int4 weights: x to int8 (absmax / 127, rounded to nearest even) and vpdpbusd (u8 codes 0..15 x s8 -> s32);
 *     the zero point through xsum = each group's sum of xs * xq.
 *   int8 weights: x to int16 (absmax / 32767) and vpdpwssd (s16 x s16): int8 activations cost int8
 *     checkpoints 10-25% more KLD on the demo model, int16 ones nothing measurable.
 * A chunk of 128 inputs sums its products in 16 int32 lanes; each lane's 8 inputs are one block of x with
 * its own scale (finer than llama.cpp's 32, for free: the scales are a vector), so
 * y[m, n] = sum_c sw[g(c)] sum_lanes xs[m, c, lane] dot_lane  -  sum_g sw[g] z[g] xsum[m, g]  (int4 only):
 * the stored weights (q - z) sw exactly, times x's integer image. Groups are whole chunks, or 32 or 64
 * inputs: int4's lanes each lie in one group, int8's vectors of 32 inputs each (native.py checks).
 * int4's 64 bytes hold 128 weights, even k in the low nibbles, so its activation chunk is stored
 * [64 even | 64 odd]; int8's in k order. Weights are unpacked once per chunk for XTILE activation rows. */
#if defined(__AVX512VNNI__)
#define XTILE 4  /* activation rows per pass over a block of ROWS weight rows */
#define INTEGER_PRODUCTS  /* decode_step.h calls qlite_gemv_vnni */

int qlite_vnni_abi(void) { return 1; }

/* The absmax of each 4 (pairs: 2) neighbouring floats of v, in each of them */
static inline __m512 max_of_4(__m512 v) {
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));  /* swap neighbours */
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));  /* swap pairs */
}

static inline __m512 inverse(__m512 a, float top) {  /* top / a, 0 where a is 0 */
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(top), a);
}

/* int4's activations: x bf16 [M, K] -> xq int8 [M, K] (layout above), xs fp32 [M, K / CHUNK, 16] (each
 * dot-product lane's scale: its block is the 8 inputs k = 8 lane .. 8 lane + 7 of the chunk), xsum fp32 [M, G] */
static void quantize_activations_int8(const uint16_t *x, long M, long K, long G, int8_t *xq, float *xs, float *xsum) {
    long C = K / CHUNK, gsize = K / G, per_group = C / G;  /* per_group: chunks per group (0: groups of 32 or 64) */
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    const __m512i every_4th = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    for (long m = 0; m < M; m++)
        for (long c = 0; c < C; c++) {
            float *lane_scale = xs + (m * C + c) * 16;
            int8_t *dst = xq + m * K + c * CHUNK;
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) {
                /* 32 bf16 = 16 (even, odd) pairs: the evens become bytes 16j.. of the chunk's first half, the
                 * odds of its second, both lanes 4j..4j+3 of the dot product (4 inputs each) */
                __m512i pair = _mm512_loadu_si512(x + m * K + c * CHUNK + 32 * j);
                __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
                __m512 amax = max_of_4(_mm512_max_ps(_mm512_abs_ps(even), _mm512_abs_ps(odd)));
                __m512 inv = inverse(amax, 127.f), d = _mm512_mul_ps(amax, _mm512_set1_ps(1.f / 127.f));
                __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(even, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(odd, inv));
                _mm_storeu_si128((__m128i *)(dst + 16 * j), _mm512_cvtsepi32_epi8(qa));  /* |q| <= 127 */
                _mm_storeu_si128((__m128i *)(dst + 64 + 16 * j), _mm512_cvtsepi32_epi8(qb));
                if (per_group) sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(qa, qb)), d, sum);
                else {  /* these 32 inputs (k = 32 j ..) lie in one group of 32 or 64 */
                    long g = m * G + (c * CHUNK + 32 * j) / gsize;
                    if ((c * CHUNK + 32 * j) % gsize == 0) xsum[g] = 0.f;
                    xsum[g] += _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(qa, qb)), d));
                }
                _mm_storeu_ps(lane_scale + 4 * j, _mm512_castps512_ps128(_mm512_permutexvar_ps(every_4th, d)));
            }
            if (!per_group) continue;
            if (c % per_group == 0) xsum[m * G + c / per_group] = 0.f;
            xsum[m * G + c / per_group] += _mm512_reduce_add_ps(sum);
        }
}

/* int8's activations: x bf16 [M, K] -> xq int16 [M, K] in k order, xs as above. The chunk is 4 vectors of 32
 * int16; lane l of vector t holds k = 32 t + 2 l', 32 t + 2 l' + 1 (l' = l mod 8, the second 16 inputs of
 * the 32 for l >= 8), so a lane's block is those 8 inputs, 2 from each vector. */
static void quantize_activations_int16(const uint16_t *x, long M, long K, int16_t *xq, float *xs) {
    long C = K / CHUNK;
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    for (long m = 0; m < M; m++)
        for (long c = 0; c < C; c++) {
            const uint16_t *src = x + m * K + c * CHUNK;
            __m512 v[8], amax[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  /* [0]: inputs 0..15 of each 32, [1]: 16..31 */
            for (int i = 0; i < 8; i++) {
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16 * i))), 16));
                amax[i % 2] = _mm512_max_ps(amax[i % 2], _mm512_abs_ps(v[i]));
            }
            for (int h = 0; h < 2; h++) amax[h] = _mm512_max_ps(amax[h], _mm512_permute_ps(amax[h], 0xB1));  /* pairs */
            __m512 inv[2] = {inverse(amax[0], 32767.f), inverse(amax[1], 32767.f)};
            for (int i = 0; i < 8; i++)
                _mm256_storeu_si256((__m256i *)(xq + m * K + c * CHUNK + 16 * i),
                                    _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv[i % 2]))));
            _mm512_storeu_ps(xs + (m * C + c) * 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(amax[0], evens, amax[1]), _mm512_set1_ps(1.f / 32767.f)));
        }
}

/* one block of nrows weight rows against mrows activation rows; out[r * XTILE + m].
 * sz[r][g] = sw z (int4) for the zero-point term, summed into the same vector before the one reduction. */
static inline __attribute__((always_inline)) void int_block(
        const void *xq, const float *xs, const float *xsum, long K, long G, const void *w, const uint16_t *scales,
        const float (*sw)[MAX_GROUPS], const float (*sz)[MAX_GROUPS], int int4, int small, int nrows, int mrows, float *out) {
    /* small: groups of 32 or 64, several per chunk. int4: lane l's 8 inputs lie in group l / (gsize / 8) of the
     * chunk, so the weight scale is a vector (lane_sw) instead of one number; int8: each of the 4 vectors'
     * 32 inputs lie in one group, so its dot product is scaled on its own */
    long C = K / CHUNK, per_group = small ? 1 : C / G, in_chunk = small ? G / C : 1;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i lane_group = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 in_chunk == 4 ? 2 : 3);  /* l / 4 (groups of 32), l / 8 (of 64) */
    const __mmask16 chunk_groups = (__mmask16)((1u << in_chunk) - 1);
    __m512 lane_sw[ROWS];
    __m512 total[ROWS][XTILE];
    for (int r = 0; r < ROWS; r++) for (int m = 0; m < XTILE; m++) total[r][m] = _mm512_setzero_ps();
    for (long g = 0, c = 0; g < G; g += in_chunk)
    for (long c_end = c + per_group; c < c_end; c++) {  /* no division in the loop */
        if (int4 && small)  /* from the fp16 scales: a vector load of sw, just written by scalar stores, stalls
                             * (int4-g64 / -g32 products 1.1-1.3x faster so) */
            for (int r = 0; r < nrows; r++)
                lane_sw[r] = _mm512_permutexvar_ps(lane_group, _mm512_castps256_ps512(_mm256_cvtph_ps(
                    _mm_maskz_loadu_epi16((__mmask8)chunk_groups, scales + r * G + g))));
        __m512i wv[ROWS][4];  /* int4: 2 vectors of u8 codes (even k, odd k); int8: 4 of s16 codes */
        for (int r = 0; r < nrows; r++) {
            if (int4) {  /* tiled (common.h): one stream */
                const uint8_t *wr = int4_tiled(w, nrows, r, c * CHUNK);
                _mm_prefetch((const char *)wr + TILE_AHEAD, _MM_HINT_T2);
                __m512i b = _mm512_loadu_si512(wr);
                __asm__("" : "+v"(b));  /* one load for both nibbles: loads, not arithmetic, bound this loop */
                wv[r][0] = _mm512_and_si512(b, low);
                wv[r][1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            } else {
                const int8_t *wr = int8_tiled(w, nrows, r, c * CHUNK);
                _mm_prefetch((const char *)wr + TILE_AHEAD, _MM_HINT_T2);
                _mm_prefetch((const char *)wr + TILE_AHEAD + 64, _MM_HINT_T2);
                for (int i = 0; i < 4; i++) wv[r][i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + 32 * i)));
            }
        }
        for (int m = 0; m < mrows; m++) {
            __m512 d = _mm512_loadu_ps(xs + (m * C + c) * 16);
            __m512i xv[4];
            for (int i = 0; i < (int4 ? 2 : 4); i++)
                xv[i] = _mm512_loadu_si512((const uint8_t *)xq + (m * K + c * CHUNK) * (int4 ? 1 : 2) + 64 * i);
            if (int4) __asm__("" : "+v"(xv[0]), "+v"(xv[1]));  /* loaded once for the block's rows, not per row */
            for (int r = 0; r < nrows; r++) {
                __m512i dot = _mm512_setzero_si512();
                if (!int4 && small) {  /* vector i's 32 inputs lie in group g + i (groups of 32) or g + i / 2 (64) */
                    for (int i = 0; i < 4; i++)
                        total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(dot, wv[r][i], xv[i])),
                                                      _mm512_mul_ps(d, _mm512_set1_ps(sw[r][g + i * in_chunk / 4])), total[r][m]);
                    continue;
                }
                if (int4) dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, wv[r][0], xv[0]), wv[r][1], xv[1]);
                else for (int i = 0; i < 4; i++) dot = _mm512_dpwssd_epi32(dot, wv[r][i], xv[i]);
                /* the weight scale as a broadcast memory operand: no register held for it */
                __m512 scale = small ? lane_sw[r] : _mm512_set1_ps(sw[r][g]);
                total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, scale), total[r][m]);
            }
        }
    }
    for (int r = 0; r < nrows; r++)
        for (int m = 0; m < mrows; m++) {
            for (long g = 0; int4 && g < G; g += 16) {
                __mmask16 k = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
                total[r][m] = _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(k, sz[r] + g), _mm512_maskz_loadu_ps(k, xsum + m * G + g), total[r][m]);
            }
            out[r * XTILE + m] = _mm512_reduce_add_ps(total[r][m]);
        }
}

#include "int_driver.h"

/* ---- the prefill product (int_gemm.h): 16 activation rows a vector, vpdpbusd --------------------- */
#define LANES 16
#define MV 3  /* activation vectors per tile: ROWS x MV = 12 integer and 12 float accumulators */

/* 64 int4 weights of one row (32 bytes, even k in the low nibbles) as int8 q - z in k order, z0 for the
 * first 32 and z1 for the rest; sums: each 32's sum of q - z */
static inline void unpack_64_int4(const uint8_t *w, uint8_t z0, uint8_t z1, int8_t *out, int32_t *sums) {
    __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    __m512i q = _mm512_or_si512(_mm512_and_si512(t, _mm512_set1_epi16(0x000f)),
                                _mm512_and_si512(_mm512_slli_epi16(t, 4), _mm512_set1_epi16(0x0f00)));  /* bytes in k order */
    __m512i sad = _mm512_sad_epu8(q, _mm512_setzero_si512());  /* 8 sums of 8 codes */
    sums[0] = (int32_t)_mm512_mask_reduce_add_epi64(0x0f, sad) - 32 * z0;
    sums[1] = (int32_t)_mm512_mask_reduce_add_epi64(0xf0, sad) - 32 * z1;
    __m512i z = _mm512_inserti64x4(_mm512_set1_epi8((char)z0), _mm256_set1_epi8((char)z1), 1);
    _mm512_storeu_si512(out, _mm512_sub_epi8(q, z));
}

static inline __m512 gemm_load_bf16(const uint16_t *p) {  /* 16 bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the largest |x| of n bf16 (n a multiple of 16) */
static inline float absmax_bf16(const uint16_t *p, long n) {
    __m512 amax = _mm512_setzero_ps();
    for (long k = 0; k < n; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(gemm_load_bf16(p + k)));
    return _mm512_reduce_max_ps(amax);
}

#define QUANTIZE_STEP 16
/* 16 bf16 -> 128 + round(x inv), as bytes (1..255) */
static inline void quantize_u8(const uint16_t *p, float inv, uint8_t *out) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(gemm_load_bf16(p), _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
}

/* acc += the products of x's u8 with b's s8: the intrinsic's copy in and out of each accumulator (GCC
 * 12 did not coalesce them: 2 moves per vpdpbusd) made the tile 1.x slower */
static inline __attribute__((always_inline)) void dpbusd_in_place(__m512i *acc, __m512i x, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(x), "v"(b));
}

/* acc [ROWS, ...] (row stride Mp) += the products of ROWS weight rows (wq, kc inputs from k0) with mv vectors of
 * activation rows (xq, xs from the tile's first row) */
static inline __attribute__((always_inline)) void gemm_tile_body(
        const uint8_t *xq, const float *xs, long K, long span, long k0, long kc, const int8_t *wq, const int32_t *wcorr,
        const float *wsc, int mv, float *acc, long Mp) {
    long S = K / span, spans = kc / span;
    __m512 f[ROWS][MV];
    for (int r = 0; r < ROWS; r++) for (int v = 0; v < mv; v++) f[r][v] = _mm512_setzero_ps();
    for (long j = 0; j < spans; j++) {
        __m512i a[ROWS][MV];
        for (int r = 0; r < ROWS; r++) for (int v = 0; v < mv; v++) a[r][v] = _mm512_set1_epi32(wcorr[r * spans + j]);
        const uint8_t *xk = xq + (k0 + j * span) * LANES;
        const int8_t *wk = wq + j * span;
        for (long k = 0; k < span; k += 4) {
            __m512i xv[MV];
            for (int v = 0; v < mv; v++) xv[v] = _mm512_load_si512(xk + v * K * LANES + k * LANES);
            for (int r = 0; r < ROWS; r++) {
                int32_t word;
                memcpy(&word, wk + r * kc + k, 4);
                __m512i b = _mm512_set1_epi32(word);
                for (int v = 0; v < mv; v++) dpbusd_in_place(&a[r][v], xv[v], b);
            }
        }
        for (int v = 0; v < mv; v++) {
            __m512 d = _mm512_load_ps(xs + v * S * LANES + (k0 / span + j) * LANES);
            for (int r = 0; r < ROWS; r++)
                f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][v]), _mm512_mul_ps(d, _mm512_set1_ps(wsc[r * spans + j])), f[r][v]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < mv; v++)
            _mm512_store_ps(acc + r * Mp + v * LANES, _mm512_add_ps(_mm512_load_ps(acc + r * Mp + v * LANES), f[r][v]));
}

static void gemm_tile(const uint8_t *xq, const float *xs, long K, long span, long k0, long kc, const int8_t *wq,
                      const int32_t *wcorr, const float *wsc, int mv, float *acc, long Mp) {
    if (mv == 3) gemm_tile_body(xq, xs, K, span, k0, kc, wq, wcorr, wsc, 3, acc, Mp);
    else if (mv == 2) gemm_tile_body(xq, xs, K, span, k0, kc, wq, wcorr, wsc, 2, acc, Mp);
    else gemm_tile_body(xq, xs, K, span, k0, kc, wq, wcorr, wsc, 1, acc, Mp);
}

#include "int_gemm.h"
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
static inline float dot_bf16(const float *q, const uint16_t *k, long n) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_bf16(k + i), acc);
    return _mm512_reduce_add_ps(acc);
}

static inline float dot_f32(const float *q, const float *k, long n) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    return _mm512_reduce_add_ps(acc);
}

static inline void mix_add_f32(const float *p, const float *V, long S, long hd, float *acc) {
    for (long i = 0; i < hd; i += 16) {
        __m512 a = _mm512_loadu_ps(acc + i);
        for (long t = 0; t < S; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(V + t * hd + i), a);
        _mm512_storeu_ps(acc + i, a);
    }
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

static inline void mix_bf16(const float *p, const uint16_t *V, long S, long hd, float scale, uint16_t *out) {
    for (long i = 0; i < hd; i += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (long t = 0; t < S; t++) acc = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load_bf16(V + t * hd + i), acc);
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc, _mm512_set1_ps(scale))));
    }
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

#include "decode_step.h"
#endif
