/* qlite_decode_attention, the same in both kernel files (kernels.c, kernels_avx2.c): each defines these
 * three vector helpers, then includes this file.
 *   float dot_bf16(const float *q, const uint16_t *k, long n)    sum q[i] k[i], n % 32 == 0
 *   float exp_sum(float *sc, long S, float mx)                   sc[s] = e^(sc[s] - mx) in place; their sum
 *   void mix_bf16(const float *p, const uint16_t *V, long S, long hd, float scale, uint16_t *out)
 *                                                               out = bf16(scale sum_t p[t] V[t, :]), hd % 32 == 0 */

static inline void rope(const uint16_t *x, const float *cos, const float *sin, long hd, float scale, float *out) {
    long half = hd / 2;  /* NeoX layout: x * cos + [-x2, x1] * sin */
    for (long i = 0; i < half; i++) {
        float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        out[i] = (a * cos[i] - b * sin[i]) * scale;
        out[i + half] = (b * cos[i + half] + a * sin[i + half]) * scale;
    }
}

/* One new token of each of B sequences: rotate q and k (cos/sin of the row's position, fp32 [B, hd]),
 * store k and v at position pos of the row's caches (bf16 [n_kv, capacity, hd], rows row_stride
 * apart), attend over the row's positions starts[b]..pos (starts NULL: 0..pos); out: bf16
 * [B, n_head * hd]. qkv: bf16 [B, (n_head + 2 n_kv) * hd], the fused projection's output. hd % 32 == 0.
 * A row's result depends only on its own keys: the same numbers at any offset, in any batch. */
void qlite_decode_attention(const uint16_t *qkv, long B, const float *cos, const float *sin, uint16_t *cache_k,
                            uint16_t *cache_v, long row_stride, const int64_t *starts, long n_head, long n_kv,
                            long hd, long capacity, long pos, uint16_t *out, int threads) {
    long rep = n_head / n_kv, width = (n_head + 2 * n_kv) * hd;
    float scale = 1.f / sqrtf((float)hd);
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (long b = 0; b < B; b++)
    for (long h = 0; h < n_kv; h++) {
        long first = starts ? starts[b] : 0, S = pos + 1 - first;
        const uint16_t *q = qkv + b * width, *k = q + n_head * hd, *v = k + n_kv * hd;
        const float *cb = cos + b * hd, *sb = sin + b * hd;
        uint16_t *K = cache_k + b * row_stride + h * capacity * hd, *V = cache_v + b * row_stride + h * capacity * hd;
        float *buf = malloc(sizeof(float) * (rep * S + hd));
        float *kr = buf + rep * S, *scores = buf;
        rope(k + h * hd, cb, sb, hd, 1.f, kr);
        for (long i = 0; i < hd; i++) { K[pos * hd + i] = f32_to_bf16(kr[i]); V[pos * hd + i] = v[h * hd + i]; }
        K += first * hd, V += first * hd;
        for (long j = 0; j < rep; j++) {
            long qh = h * rep + j;
            float qr[hd];
            rope(q + qh * hd, cb, sb, hd, scale, qr);
            float *sc = scores + j * S, mx = -INFINITY;
            for (long s = 0; s < S; s++) {
                sc[s] = dot_bf16(qr, K + s * hd, hd);
                mx = sc[s] > mx ? sc[s] : mx;
            }
            mix_bf16(sc, V, S, hd, 1.f / exp_sum(sc, S, mx), out + (b * n_head + qh) * hd);
        }
        free(buf);
    }
}
