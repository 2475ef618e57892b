/* int4 and int8 weights in lanes (and int3k / int2k, below): their products at every row count (decode, verification,
 * a batch, prefill), the same in both kernel files (kernels.c: 16 lanes of AVX-512, kernels_avx2.c: 8 of AVX2), and
 * the entry points of the integer-activation products.
 * A product that keeps one dot product in a vector's lanes pays float work per 8 inputs; from a few rows on,
 * that float work bounds it (BENCHMARKS.md, "the few-row products against this CPU's arithmetic"). Here the
 * lanes are weight rows instead: the codes tiled in blocks of LROWS rows, [K / 8][rows][4 bytes] (a row's 4
 * bytes: its 8 codes of inputs 8 w .. 8 w + 7 as stored, byte b's low nibble input 8 w + 2 b), and 4 inputs of
 * one activation row broadcast: one integer multiply-add (vpdpbusd, or vpmaddubsw on AVX2) advances LROWS dot
 * products by 4 inputs at any row count, and sums stay integer over a span (the group, at most CHUNK inputs).
 * The activations are int8, absmax / 127 per row and span, and the float steps per block of LKC inputs are
 * f = fma(sum, xs ws, f) over its spans from 0, then total + f: the same integers and float steps on both
 * instruction sets, so the same bits; and a row's result is the same at any row count (tested), so a
 * verification pass or a batch keeps each row's decode bits.
 * Each file defines, before including this: LROWS (lanes), LTILE (activation rows per pass over a block's
 * inputs), LGROUP (blocks a thread takes at a time past 16 rows), and
 *   quantize_lanes_row(x, K, span, xa, xd, xsum, natural)   one activation row x bf16 [K] -> xa int8 [K] (each 8
 *     inputs: the 4 even, then the 4 odd, as a lanes word's nibbles; natural: in k order), xd fp32 [S] (absmax / 127
 *     per span), xsum int32 [S] (each span's sum of xa); x * (127 / absmax) rounded to nearest even;
 *   lanes_tile(block, bn, K, S, span, gsize, k0, kc, xa, xd, xsum, swT, zT, mt, total)   total [mt, LROWS] += one
 *     block's (bn live rows) products with mt activation rows (xa, xd, xsum from the first; row stride K and S)
 *     over inputs k0 .. k0 + kc: per span sum (q - z) xa in integers (- z sum xa first), then the float steps
 *     above. swT fp32 / zT int32 [G, LROWS]: the block's weight scales and zero points, a group's for all rows.
 * int8 in lanes: the codes in blocks of LROWS rows, [K / 2][rows][2 bytes] (a row's codes of inputs
 * 2 w, 2 w + 1), 2 inputs of an activation row broadcast, one vpdpwssd (AVX2: vpmaddwd and vpaddd; s16 x s16,
 * pairs to s32) per 2 inputs of LROWS rows. The activations are int16, absmax / 32767 per row and span; per span
 * sum q xq in int32 (at most 128 x 128 x 32767 < 2^31), then the float steps above. The file then defines
 *   quantize_int16_row(x, K, span, xq, xd)   x bf16 [K] -> xq int16 [K] in k order, xd fp32 [S] (absmax / 32767)
 *   lanes_tile_int8(block, bn, K, S, span, gsize, k0, kc, xq, xd, swT, mt, total)   as lanes_tile, no zero points
 * Where the file defines LANES_PAIRS (AVX2), blocks go two at a time where both are full (int4
 * from 3 rows on where it defines INT4_PAIRS 1, int8 always):
 *   lanes_tile_pair(b0, b1, K, S, span, gsize, k0, kc, xa, xd, xsum, sw0, sw1, z0, z1, mt, t0, t1)   lanes_tile
 *     for two blocks, mt <= PAIR_TILE rows, each activation word broadcast once for both (same bits)
 *   lanes_tile_int8_pair(b0, b1, K, S, span, gsize, k0, kc, xq, xd, sw0, sw1, mt, t0, t1)   lanes_tile_int8 for
 *     two blocks, mt <= PAIR_TILE_INT8 rows (same bits)
 * int3k / int2k in lanes (each file's lanes_tile_lowbit): the stored codes (lowbit.h) tiled a 4-byte word at a
 * time, [K / 128][4 bits words][rows][4 bytes] (a low-plane word's shift by 2 t and mask 3 gives inputs i .. i + 3 of
 * the 128 plus 32 t, a byte each; a high-plane word's bit j of each byte is that of inputs i .. i + 3 plus 16 j),
 * and the scale bytes tiled [G][rows]; activations int8 in k order, one integer multiply-add per 4 inputs of LROWS
 * rows, the float steps above with each group's fp16(d c) and zero point made from its bytes in the tile:
 *   lanes_tile_lowbit(block, sblock, row_scales, bn, K, S, span, k0, kc, bits, xa, xd, xsum, mt, total)   (spans:
 *     the groups, which divide CHUNK)
 */
int qlite_int4_lanes(void) { return LROWS; }  /* native.lanes_rows: the rows of a block of either layout */
#define LKC 512  /* inputs per block of float sums */
#define LMB 256  /* activation rows quantized and taken at a time */

/* codes [N, row_bytes] row-major -> the lanes layout, `unit` bytes of a row side by side with the block's others
 * (int4: 4, int8: 2) */
static void tile_lanes(const uint8_t *src, uint8_t *dst, long N, long row_bytes, long unit, int threads) {
    long units = row_bytes / unit;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += LROWS) {
        long bn = N - n < LROWS ? N - n : LROWS;
        for (long r = 0; r < bn; r++)
            for (long i = 0; i < units; i++)
                memcpy(dst + n * row_bytes + (i * bn + r) * unit, src + (n + r) * row_bytes + i * unit, unit);
    }
}

/* ---- a block's tables: swT fp32 / zT int32 [G, LROWS], its scales and zero points a group's for all rows, made
 * 8 rows and 8 groups at a time by a transpose (AVX2 intrinsics: both files) ---- */

/* the 8 x 8 floats of v, transposed */
static inline void transpose8(__m256 *v) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* groups g .. g + 7 of rows r0 .. r0 + 7 of a full block's tables */
static inline void tables_8(const uint16_t *sn, const uint8_t *zn, long G, long g, int r0, float *swT, int32_t *zT) {
    __m256 s[8], z[8];
    for (int r = 0; r < 8; r++) s[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sn + (r0 + r) * G + g)));
    transpose8(s);
    for (int i = 0; i < 8; i++) _mm256_store_ps(swT + (g + i) * LROWS + r0, s[i]);
    if (!zn)
        return;
    for (int r = 0; r < 8; r++)
        z[r] = _mm256_castsi256_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zn + (r0 + r) * G + g))));
    transpose8(z);
    for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)(zT + (g + i) * LROWS + r0), _mm256_castps_si256(z[i]));
}

/* rows r0 .. r0 + 7 of a full block's tables of G < 8 groups (K = 896 at group 128: 7; int8 by rows: 1): each row's
 * G values read as 8 from inside the block's LROWS G (the row's start, or LROWS G - 8 for the last rows) and moved
 * to lanes 0 .. G - 1 */
static inline void tables_few(const uint16_t *sn, const uint8_t *zn, long G, int r0, float *swT, int32_t *zT) {
    __m256 s[8], z[8];
    for (int r = 0; r < 8; r++) {
        long at = (r0 + r) * G, start = at < LROWS * G - 8 ? at : LROWS * G - 8;
        __m256i lanes = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(at - start)));
        s[r] = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sn + start))), lanes);
        if (zn)
            z[r] = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zn + start))), lanes));
    }
    transpose8(s);
    for (long i = 0; i < G; i++) _mm256_store_ps(swT + i * LROWS + r0, s[i]);
    if (!zn)
        return;
    transpose8(z);
    for (long i = 0; i < G; i++) _mm256_store_si256((__m256i *)(zT + i * LROWS + r0), _mm256_castps_si256(z[i]));
}

/* the tables of the block of rows n.. (bn of them) from its scales (fp16 [bn, G]: sn) and zero points (uint8 [N, G],
 * NULL for int8: no zT); a full block in vectors (past 8 groups a last G % 8 as the last 8 again: the overlap
 * rewritten with the same values), a partial one element by element */
static void lanes_tables(const void *scales, const uint16_t *row_scales, const uint8_t *zeros, long n, long bn, long G,
                         uint16_t *room, float *swT, int32_t *zT) {
    const uint16_t *sn = block_fp16_scales(scales, row_scales, n, G, (int)bn, room);  /* int4k: coded scales made fp16 */
    const uint8_t *zn = zeros ? zeros + n * G : NULL;
    if (bn == LROWS) {
        for (int r0 = 0; r0 < LROWS; r0 += 8) {
            if (G < 8) { tables_few(sn, zn, G, r0, swT, zT); continue; }
            for (long g = 0; g + 8 <= G; g += 8) tables_8(sn, zn, G, g, r0, swT, zT);
            if (G % 8) tables_8(sn, zn, G, G - 8, r0, swT, zT);
        }
        return;
    }
    for (long r = 0; r < LROWS; r++)
        for (long g = 0; g < G; g++) {
            swT[g * LROWS + r] = r < bn ? _cvtsh_ss(sn[r * G + g]) : 0.f;
            if (zn)
                zT[g * LROWS + r] = r < bn ? zn[r * G + g] : 0;
        }
}

/* int4: w codes [N, K/2] in lanes, zeros uint8 [N, G], scales fp16 [N, G] (int4k: uint8 codes under row_scales);
 * int8: w codes [N, K] in lanes, scales fp16 [N, G], zeros and row_scales NULL; y [M, N]. Threads
 * take blocks of LROWS weight rows (LGROUP of them past 16 rows). */
static void lanes_product(const uint16_t *x, long M, const void *w, const void *scales, const uint16_t *row_scales,
                          const uint8_t *zeros, int int4, int lowbit, long G, long N, long K, const float *bias, void *y,
                          int out_bf16, int threads) {
    long gsize = K / G, span = gsize < CHUNK ? gsize : CHUNK, S = K / span, rows_max = M < LMB ? M : LMB;
#ifdef LANES_PAIRS
    /* int4's pair tile from 3 rows (at 1-2, weights from memory, it measured 0.91x; INT4_PAIRS 0: never), int8's at any
     * row count (1.01-1.10x at 1 row, 1.32-1.51x at 2) */
    int pairs = lowbit ? 0 : int4 ? INT4_PAIRS && M > 2 : 1;
#else
    int pairs = 0;
#endif
    long group = M > 16 ? LGROUP : pairs ? 2 : 1, step = group * LROWS, code_bytes = lowbit ? K / 8 * lowbit : int4 ? K / 2 : K;
    /* iterations a thread takes at a time: 8 runs a thread on average; 2 for a batch's few rows, whose weights stream
     * better in longer runs (1.04-1.09x at 8 rows on AVX-512, BENCHMARKS.md, twelfth session) */
    long share = (N + step - 1) / step / ((M > 2 && M <= 16 ? 2 : 8) * threads) + 1;
    int8_t *xa = malloc(rows_max * K * (int4 ? 1 : 2));  /* int16 for int8 weights */
    float *xd = malloc(sizeof(float) * rows_max * S);
    int32_t *xsum = malloc(sizeof(int32_t) * rows_max * S);
    #pragma omp parallel num_threads(threads)
    {
        float *swT = aligned_alloc(64, sizeof(float) * group * G * LROWS);
        float *total = aligned_alloc(64, sizeof(float) * group * rows_max * LROWS);
        int32_t *zT = aligned_alloc(64, sizeof(int32_t) * group * G * LROWS);
        uint16_t *room = malloc(sizeof(uint16_t) * G * LROWS);
        for (long m0 = 0; m0 < M; m0 += LMB) {
            long rows = M - m0 < LMB ? M - m0 : LMB;
            #pragma omp for schedule(static)
            for (long m = 0; m < rows; m++) {
                if (!int4) { quantize_int16_row(x + (m0 + m) * K, K, span, (int16_t *)xa + m * K, xd + m * S); continue; }
                quantize_lanes_row(x + (m0 + m) * K, K, span, xa + m * K, xd + m * S, xsum + m * S, lowbit != 0);
            }
            /* runs of blocks taken as threads come free (share above): where another process takes a
             * core for a while, the other threads take its share instead of waiting for it at the end */
            #pragma omp for schedule(dynamic, share)
            for (long n = 0; n < N; n += step) {
                long blocks = ((N - n < step ? N - n : step) + LROWS - 1) / LROWS;
                for (long b = 0; b < blocks; b++) {
                    long nb = n + b * LROWS, bn = N - nb < LROWS ? N - nb : LROWS;
                    if (!lowbit)  /* int3k / int2k: each group's scales made in the tile */
                        lanes_tables(scales, row_scales, zeros, nb, bn, G, room, swT + b * G * LROWS, zT + b * G * LROWS);
                }
                memset(total, 0, sizeof(float) * blocks * rows * LROWS);
                for (long k0 = 0; k0 < K; k0 += LKC)
                    for (long b = 0; b < blocks; b++) {
                        long nb = n + b * LROWS, bn = N - nb < LROWS ? N - nb : LROWS, kc = K - k0 < LKC ? K - k0 : LKC;
                        const uint8_t *block = (const uint8_t *)w + nb * code_bytes;
#ifdef LANES_PAIRS
                        if (pairs && b + 1 < blocks && N - nb >= 2 * LROWS) {  /* two full blocks: the pair tiles */
                            long width = int4 ? PAIR_TILE : PAIR_TILE_INT8;  /* rows a pass: 3, 4 */
                            for (long mt0 = 0; mt0 < rows; mt0 += width) {
                                float *t0 = total + (b * rows + mt0) * LROWS, *t1 = total + ((b + 1) * rows + mt0) * LROWS;
                                const float *sw0 = swT + b * G * LROWS, *sw1 = swT + (b + 1) * G * LROWS;
                                #define PAIR(MT) do { if (int4) lanes_tile_pair(block, block + LROWS * code_bytes, K, S, span, gsize, k0, kc, \
                                    xa + mt0 * K, xd + mt0 * S, xsum + mt0 * S, sw0, sw1, zT + b * G * LROWS, zT + (b + 1) * G * LROWS, \
                                    MT < PAIR_TILE ? MT : PAIR_TILE, t0, t1); \
                                    else lanes_tile_int8_pair((const int8_t *)block, (const int8_t *)block + LROWS * code_bytes, K, S, span, \
                                    gsize, k0, kc, (const int16_t *)xa + mt0 * K, xd + mt0 * S, sw0, sw1, MT, t0, t1); } while (0)
                                switch (rows - mt0 < width ? rows - mt0 : width) {  /* constant row counts: each specialised */
                                case 1: PAIR(1); break;
                                case 2: PAIR(2); break;
                                case 3: PAIR(3); break;
                                default: PAIR(PAIR_TILE_INT8);  /* int8 only: int4 passes are at most 3 rows */
                                }
                                #undef PAIR
                            }
                            b++;
                            continue;
                        }
#endif
                        for (long mt0 = 0; mt0 < rows; mt0 += LTILE) {
                            const int8_t *xm = xa + mt0 * K;
                            const float *dm = xd + mt0 * S, *sw = swT + b * G * LROWS;
                            const int32_t *sm = xsum + mt0 * S, *zt = zT + b * G * LROWS;
                            float *tm = total + (b * rows + mt0) * LROWS;
                            if (lowbit) {  /* its own row counts (each file's lanes_tile_lowbit) */
                                lanes_tile_lowbit(block, (const uint8_t *)scales + nb * G, row_scales + nb, bn, K, S, span, k0,
                                                  kc, lowbit, xm, dm, sm, (int)(rows - mt0 < LTILE ? rows - mt0 : LTILE), tm);
                                continue;
                            }
                            #define LANES_TILE(MT) do { if (int4) lanes_tile(block, bn, K, S, span, gsize, k0, kc, xm, dm, sm, sw, zt, MT, tm); \
                                else lanes_tile_int8((const int8_t *)block, bn, K, S, span, gsize, k0, kc, (const int16_t *)xa + mt0 * K, dm, sw, MT, tm); } while (0)
                            switch (rows - mt0 < LTILE ? rows - mt0 : LTILE) {  /* constant row counts: each specialised */
                            case 1: LANES_TILE(1); break;
                            case 2: LANES_TILE(2); break;
                            case 3: LANES_TILE(3); break;
#if LTILE > 4
                            case 4: LANES_TILE(4); break;
                            case 5: LANES_TILE(5); break;
                            case 6: LANES_TILE(6); break;
                            case 7: LANES_TILE(7); break;
#endif
                            default: LANES_TILE(LTILE);
                            }
                            #undef LANES_TILE
                        }
                    }
                for (long b = 0; b < blocks; b++) {
                    long nb = n + b * LROWS, bn = N - nb < LROWS ? N - nb : LROWS;
                    for (long m = 0; m < rows; m++)
                        for (long r = 0; r < bn; r++)
                            store(y, out_bf16, (m0 + m) * N + nb + r,
                                  total[(b * rows + m) * LROWS + r] + (bias ? bias[nb + r] : 0.f));
                }
            }
        }
        free(swT);
        free(total);
        free(zT);
        free(room);
    }
    free(xa);
    free(xd);
    free(xsum);
}

/* codes [N, K] (int8) or [N, K/2] (int4) row-major, as stored -> dst laid out as the products read them, in lanes;
 * native.tile_codes */
void qlite_tile_codes(const uint8_t *src, uint8_t *dst, long N, long K, int int4, int threads) {
    if (int4) tile_lanes(src, dst, N, K / 2, 4, threads);
    else tile_lanes(src, dst, N, K, 2, threads);
}

/* x bf16 [M, K] times w: int4 (zeros not NULL) or int8 (zeros and row_scales NULL); codes as qlite_tile_codes lays
 * them out */
void qlite_gemv_vnni(const uint16_t *x, long M, const void *w, const void *scales, const uint16_t *row_scales,
                     const uint8_t *zeros, int int4, long G, long N, long K, const float *bias, void *y, int out_bf16,
                     int threads) {
    lanes_product(x, M, w, scales, row_scales, zeros, int4, 0, G, N, K, bias, y, out_bf16, threads);
}

/* src [N, row_bytes] row-major -> dst in lanes, `unit` bytes of a row side by side with its block's others (int3k /
 * int2k: codes 4, scale bytes 1); native.tile_lowbit */
void qlite_tile_rows(const uint8_t *src, uint8_t *dst, long N, long row_bytes, long unit, int threads) {
    tile_lanes(src, dst, N, row_bytes, unit, threads);
}

/* x bf16 [M, K] times int3k / int2k weights (bits 3 or 2): codes and scale bytes as qlite_tile_rows lays them out,
 * row_scales fp16 [N] */
void qlite_gemv_vnni_lowbit(const uint16_t *x, long M, const uint8_t *w, const uint8_t *scales, const uint16_t *row_scales,
                            int bits, long G, long N, long K, const float *bias, void *y, int out_bf16, int threads) {
    lanes_product(x, M, w, scales, row_scales, NULL, 1, bits, G, N, K, bias, y, out_bf16, threads);
}
