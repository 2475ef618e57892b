/* qlite_decode_attention, the same in both kernel files (kernels.c, kernels_avx2.c): each defines these
 * vector helpers, then includes this file.
 *   float dot_f32(const float *q, const float *k, long n)        sum q[i] k[i], n % 32 == 0
 *   void dots_f32(const float *q, const float *K, long S, long hd, float *scores)
 *                                                               scores[s] = dot_f32(q, K + s hd, hd), s < S
 *   void mix_add_f32(const float *p, const float *V, long S, long hd, float *acc)
 *                                                               acc += sum_t p[t] V[t, :], hd % 32 == 0
 *   float exp_sum(float *sc, long S, float mx)                   sc[s] = e^(sc[s] - mx) in place; their sum
 *   float largest(const float *x, long n)                       the largest x[i] (NaNs passed over), as a scan
 *                                                               from -inf finds it
 *
 * The cache holds one record per (head, token): bf16 [hd] (bits 16), or, for a quantized cache
 * (qlite/kv_quant.py writes the same bytes), codes in groups of 32 values then the groups' fp16 scales
 * [hd / 32], a value being code x scale: bits 8, int8 codes [hd]; bits 4, two codes per byte [hd / 2],
 * byte j of a group holding values j (low nibble) and j + 16, each stored + 8. Scales: the group's
 * largest |value| / 127 (or 7), rounded to fp16; codes: value / scale rounded to nearest even. A
 * quantized cache stores keys less the head's key offset (k_offset, fp32 [n_kv, hd]; NULL: none), a
 * constant per head that softmax does not see, so the scores are taken on the stored keys as they are. The
 * records are decoded to fp32 with plain C loops, which the compiler vectorizes for the file's instruction
 * set, a block of them at a time into a tile that stays in L1, once for all the query heads that share their
 * kv head (bf16 records too: converting a key once instead of once per query head, and the helpers' FMAs
 * reading the tile from memory, took 8 rows' attention 1.5x faster, BENCHMARKS.md, twelfth session). */

static inline long kv_record_bytes(int bits, long hd) { return bits == 16 ? 2 * hd : bits * hd / 8 + hd / 16; }

int qlite_kv_record_bytes(int bits, long hd) { return (int)kv_record_bytes(bits, hd); }  /* for native.py */

static void kv_encode(const float *x, long hd, int bits, uint8_t *rec) {  /* x: bf16-exact values */
    float qmax = bits == 8 ? 127.f : 7.f;
    uint16_t *scales = (uint16_t *)(rec + bits * hd / 8);
    for (long g = 0; g < hd / 32; g++) {
        const float *xg = x + 32 * g;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
        uint16_t s16 = _cvtss_sh(fminf(amax / qmax, 65504.f), 0);
        float s = _cvtsh_ss(s16);
        int code[32];
        for (int i = 0; i < 32; i++) {
            float c = s > 0.f ? nearbyintf(xg[i] / s) : 0.f;
            code[i] = (int)(c > qmax ? qmax : c < -qmax ? -qmax : c);
        }
        if (bits == 8) for (int i = 0; i < 32; i++) ((int8_t *)rec)[32 * g + i] = (int8_t)code[i];
        else for (int i = 0; i < 16; i++) rec[16 * g + i] = (uint8_t)((code[i] + 8) | ((code[i + 16] + 8) << 4));
        memcpy(scales + g, &s16, 2);
    }
}

/* A record's values, fp32 (plus offset, NULL: none): out[i] = bf16 value, or code x scale (+ offset[i]) */
static inline void decode_record(const uint8_t *rec, int bits, long hd, const float *offset, float *out) {
    if (bits == 16) {
        for (long i = 0; i < hd; i++) out[i] = bf16_to_f32(((const uint16_t *)rec)[i]) + (offset ? offset[i] : 0.f);
        return;
    }
    const uint16_t *scales = (const uint16_t *)(rec + bits * hd / 8);
    for (long g = 0; g < hd / 32; g++) {
        float s = _cvtsh_ss(scales[g]), *o = out + 32 * g;
        if (bits == 8) {
            const int8_t *c = (const int8_t *)rec + 32 * g;
            for (int i = 0; i < 32; i++) o[i] = s * c[i];
        } else {
            const uint8_t *c = rec + 16 * g;
            for (int i = 0; i < 16; i++) { o[i] = s * ((c[i] & 15) - 8); o[i + 16] = s * ((c[i] >> 4) - 8); }
        }
    }
    if (offset) for (long i = 0; i < hd; i++) out[i] += offset[i];
}

#define KV_BLOCK 64  /* records decoded at a time into an fp32 tile (16 KiB at hd 64) */
#define QUERY_TILE 4  /* a prefill's tokens of one sequence that read each block of records once, together */

/* Attention of nq query heads qr (rotated and scaled, fp32 [nq, hd]) sharing one kv head, query q over the first
 * S[q] of the records rec bytes apart (S non-decreasing, Smax its last): each key and value record decoded once
 * (into a tile that stays in L1) for all of them, and every query's dots, exponentials and sums taken in the order
 * they take for that query alone, so its result is the same whatever queries share the tile. Query q's output:
 * bf16 [hd] at out + (q / rep) * out_stride + (q % rep) * hd. buf: room for nq * (Smax + hd) + hd * KV_BLOCK floats. */
static void attend_records(const float *qr, long nq, const long *S, long rep, const uint8_t *K, const uint8_t *V,
                           long rec, int bits, long hd, float *buf, uint16_t *out, long out_stride) {
    long Smax = S[nq - 1];
    float *scores = buf, *acc = buf + nq * Smax, *tile = acc + nq * hd;
    for (long t0 = 0; t0 < Smax; t0 += KV_BLOCK) {
        long n = Smax - t0 < KV_BLOCK ? Smax - t0 : KV_BLOCK;
        for (long t = 0; t < n; t++) decode_record(K + (t0 + t) * rec, bits, hd, NULL, tile + t * hd);
        for (long j = 0; j < nq; j++)
            if (S[j] > t0) dots_f32(qr + j * hd, tile, S[j] - t0 < n ? S[j] - t0 : n, hd, scores + j * Smax + t0);
    }
    float norm[nq];
    for (long j = 0; j < nq; j++) norm[j] = 1.f / exp_sum(scores + j * Smax, S[j], largest(scores + j * Smax, S[j]));
    memset(acc, 0, sizeof(float) * nq * hd);
    for (long t0 = 0; t0 < Smax; t0 += KV_BLOCK) {
        long n = Smax - t0 < KV_BLOCK ? Smax - t0 : KV_BLOCK;
        for (long t = 0; t < n; t++) decode_record(V + (t0 + t) * rec, bits, hd, NULL, tile + t * hd);
        for (long j = 0; j < nq; j++)
            if (S[j] > t0) mix_add_f32(scores + j * Smax + t0, tile, S[j] - t0 < n ? S[j] - t0 : n, hd, acc + j * hd);
    }
    for (long j = 0; j < nq; j++) {
        uint16_t *o = out + (j / rep) * out_stride + (j % rep) * hd;
        for (long i = 0; i < hd; i++) o[i] = f32_to_bf16(acc[j * hd + i] * norm[j]);
    }
}

/* Records -> bf16 values, for attention outside this file (a prefill over a quantized cache): `rows`
 * runs of `count` records, run r at rec + r * row_stride bytes, written to out [rows, count, hd];
 * offsets: fp32 [heads, hd] added to run r's values from head r % heads (NULL: none). */
void qlite_kv_decode(const uint8_t *records, long rows, long count, long row_stride, int bits, long hd,
                     const float *offsets, long heads, uint16_t *out, int threads) {
    long rec = kv_record_bytes(bits, hd);
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++)
    for (long t = 0; t < count; t++) {
        float v[hd];
        decode_record(records + r * row_stride + t * rec, bits, hd, offsets ? offsets + (r % heads) * hd : NULL, v);
        for (long i = 0; i < hd; i++) out[(r * count + t) * hd + i] = f32_to_bf16(v[i]);
    }
}

static inline void rope(const uint16_t *x, const float *cos, const float *sin, long hd, float scale, float *out) {
    long half = hd / 2;  /* NeoX layout: x * cos + [-x2, x1] * sin */
    for (long i = 0; i < half; i++) {
        float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        out[i] = (a * cos[i] - b * sin[i]) * scale;
        out[i + half] = (b * cos[i + half] + a * sin[i + half]) * scale;
    }
}

/* One new token of each of B sequences: rotate q and k (cos/sin of the row's position, fp32 [B, hd]),
 * store k and v at the row's position of its caches (records of `bits` [n_kv, capacity], rows row_stride bytes
 * apart; k_offset as above), attend over the row's positions starts[b]..its position (starts NULL: from 0); out:
 * bf16 [B, n_head * hd]. qkv: bf16 [B, (n_head + 2 n_kv) * hd], the fused projection's output. Row b's
 * position: pos + b pos_step: pos_step 0 for B sequences at one position, 1 with row_stride 0 for B new tokens
 * of one sequence (speculation's verify pass: every row's keys stored before any row attends, row b over
 * the positions up to its own, as B one-token steps in turn would). hd % 32 == 0. A row's result depends
 * only on its own keys: the same numbers at any offset, in any batch. */
void qlite_decode_attention(const uint16_t *qkv, long B, const float *cos, const float *sin, uint8_t *cache_k,
                            uint8_t *cache_v, long row_stride, const int64_t *starts, long n_head, long n_kv,
                            long hd, long capacity, long pos, long pos_step, int bits, const float *k_offset,
                            uint16_t *out, int threads) {
    long rep = n_head / n_kv, width = (n_head + 2 * n_kv) * hd, rec = kv_record_bytes(bits, hd);
    float scale = 1.f / sqrtf((float)hd);
    #pragma omp parallel num_threads(threads)
    {  /* one team for both loops: the second starts when the first is done (the for's barrier) */
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < B; b++)
    for (long h = 0; h < n_kv; h++) {  /* the new keys and values into the caches */
        const uint16_t *k = qkv + b * width + n_head * hd, *v = k + n_kv * hd;
        long at = (pos + b * pos_step) * rec;
        uint8_t *K = cache_k + b * row_stride + h * capacity * rec + at, *V = cache_v + b * row_stride + h * capacity * rec + at;
        float kr[hd], vr[hd];
        rope(k + h * hd, cos + b * hd, sin + b * hd, hd, 1.f, kr);
        for (long i = 0; i < hd; i++) { kr[i] = bf16_to_f32(f32_to_bf16(kr[i])); vr[i] = bf16_to_f32(v[h * hd + i]); }
        if (bits == 16) {
            for (long i = 0; i < hd; i++) {
                ((uint16_t *)K)[i] = f32_to_bf16(kr[i]);
                ((uint16_t *)V)[i] = v[h * hd + i];
            }
        } else {
            if (k_offset) for (long i = 0; i < hd; i++) kr[i] -= k_offset[h * hd + i];
            kv_encode(kr, hd, bits, K);
            kv_encode(vr, hd, bits, V);
        }
    }
    /* rows attend over their own lengths, taken as threads come free; one sequence's new tokens (pos_step 1) in tiles
     * of QUERY_TILE that read each block of their records once */
    long tile = pos_step ? QUERY_TILE : 1, tiles = (B + tile - 1) / tile;
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (long t = 0; t < tiles; t++)
    for (long h = 0; h < n_kv; h++) {
        long b0 = t * tile, nb = B - b0 < tile ? B - b0 : tile, nq = nb * rep;
        long first = starts ? starts[b0] : 0;  /* one sequence's rows share theirs */
        const uint8_t *K = cache_k + b0 * row_stride + h * capacity * rec + first * rec;
        const uint8_t *V = cache_v + b0 * row_stride + h * capacity * rec + first * rec;
        long S[nq];
        for (long q = 0; q < nq; q++) S[q] = pos + (b0 + q / rep) * pos_step + 1 - first;
        float *buf = malloc(sizeof(float) * (nq * (S[nq - 1] + 2 * hd) + hd * KV_BLOCK));
        float *qr = buf + nq * (S[nq - 1] + hd) + hd * KV_BLOCK;
        for (long i = 0; i < nb; i++)
            for (long j = 0; j < rep; j++)
                rope(qkv + (b0 + i) * width + (h * rep + j) * hd, cos + (b0 + i) * hd, sin + (b0 + i) * hd, hd, scale,
                     qr + (i * rep + j) * hd);
        attend_records(qr, nq, S, rep, K, V, rec, bits, hd, buf, out + (b0 * n_head + h * rep) * hd, n_head * hd);
        free(buf);
    }
    }
}
