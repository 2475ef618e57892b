/* The bf16 and int8 products' bodies (a block of nrows weight rows against one activation row, out[r]) and
 * exp's polynomial, the same in both kernel files over the vector vocabulary each defines before including
 * this: vec (VW fp32 lanes), bvec (BW bf16 values), vzero, vload, vfma, vfnma, vadd, vset1, vsum, vload_i8
 * (VW int8 -> fp32), bload, bdot(acc, w, x) (acc + the products of BW bf16 weights at w with x),
 * BF16_PREFETCH, INT8_PREFETCH. */

/* x bf16 [K], w bf16 [nrows, K] */
static inline __attribute__((always_inline)) void bf16_rows(const uint16_t *x, const uint16_t *w, long K, int nrows, float *out) {
    vec acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = vzero();
    for (long k = 0; k < K; k += 2 * BW) {
        bvec x0 = bload(x + k), x1 = bload(x + k + BW);
        for (int r = 0; r < nrows; r++) {
            const uint16_t *wr = w + r * K + k;
            BF16_PREFETCH(wr, K);
            acc[r][0] = bdot(acc[r][0], wr, x0);
            acc[r][1] = bdot(acc[r][1], wr + BW, x1);
        }
    }
    for (int r = 0; r < nrows; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));
}

/* x fp32 [K], w int8 [nrows, K], scales fp16 [nrows, G]: each group's sum times its scale */
static inline __attribute__((always_inline)) void int8_rows(const float *x, const int8_t *w, const uint16_t *scales, long K, long G, int nrows, float *out) {
    long gsize = K / G;
    vec total[ROWS];
    for (int r = 0; r < ROWS; r++) total[r] = vzero();
    for (long g = 0; g < G; g++) {
        vec acc[ROWS][2];
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = vzero();
        for (long k = g * gsize; k < (g + 1) * gsize; k += 2 * VW) {
            vec x0 = vload(x + k), x1 = vload(x + k + VW);
            for (int r = 0; r < nrows; r++) {
                const int8_t *wr = w + r * K + k;
                INT8_PREFETCH(wr, K);
                acc[r][0] = vfma(vload_i8(wr), x0, acc[r][0]);
                acc[r][1] = vfma(vload_i8(wr + VW), x1, acc[r][1]);
            }
        }
        for (int r = 0; r < nrows; r++)
            total[r] = vfma(vset1(_cvtsh_ss(scales[r * G + g])), vadd(acc[r][0], acc[r][1]), total[r]);
    }
    for (int r = 0; r < nrows; r++) out[r] = vsum(total[r]);
}

/* e^(x - n ln2) for x - n ln2 in [-ln2/2, ln2/2] (n = round(x / ln2)): the reduction in two parts, then
 * the degree-6 Taylor polynomial; each file's exp scales it by 2^n */
static inline vec exp_reduced(vec x, vec n) {
    vec r = vfnma(n, vset1(0.693145752f), x);
    r = vfnma(n, vset1(1.42860677e-6f), r);
    vec p = vset1(1.f / 720);
    p = vfma(p, r, vset1(1.f / 120));
    p = vfma(p, r, vset1(1.f / 24));
    p = vfma(p, r, vset1(1.f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.f));
    return vfma(p, r, vset1(1.f));
}
