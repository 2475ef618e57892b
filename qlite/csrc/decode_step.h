/* qlite_decode_layers: every decoder layer of one decode step (one new token per row; or, pos_step 1, one
 * sequence's new tokens as rows, speculation's verify pass) in one call, the same
 * in both kernel files (kernels.c, kernels_avx2.c), included after their products and small ops. It calls
 * exactly the functions the module path calls one by one (model.DecoderLayer with the native kernels), in
 * the same order, with the same roundings, so its result is bitwise that path's: what it saves is ~10
 * Python calls and torch allocations per layer (2.3-2.9 ms of a demo model's 11-21 ms step). A file
 * defines INTEGER_PRODUCTS where it has qlite_gemv_vnni. */

typedef struct {  /* one product, as native.Product holds it */
    int kind;  /* 0 bf16 (qlite_gemv_bf16), 1 int8, 2 int4, 3 integer activations (qlite_gemv_vnni) */
    int int4;  /* kind 3: int4 weights (else int8) */
    const void *w;
    const void *scales;  /* fp16, or int4k's uint8 codes under row_scales */
    const uint16_t *row_scales;  /* int4k: fp16 [N]; else NULL */
    const uint8_t *zeros;
    long G, N, K;
    const float *bias;
} qlite_product;

typedef struct {  /* a decoder layer: its RMSNorm weights (bf16 [hidden]) and projections; q|k|v and
                   * gate|up are one product, or 3 and 2 side by side where their formats differ */
    const uint16_t *input_norm, *post_norm;
    qlite_product qkv[3], o, gate_up[2], down;
    int n_qkv, n_gate_up;
} qlite_layer;

static void product(const qlite_product *p, const uint16_t *x, long M, uint16_t *y, int threads) {
    switch (p->kind) {
    case 0: qlite_gemv_bf16(x, M, p->w, p->N, p->K, p->bias, y, 1, threads); break;
    case 1: qlite_gemv_int8(x, M, p->w, p->scales, p->G, p->N, p->K, p->bias, y, 1, threads); break;
    case 2: qlite_gemv_int4(x, M, p->w, p->scales, p->row_scales, p->zeros, p->G, p->N, p->K, p->bias, y, 1, threads); break;
#ifdef INTEGER_PRODUCTS
    case 3: qlite_gemv_vnni(x, M, p->w, p->scales, p->row_scales, p->zeros, p->int4, p->G, p->N, p->K, p->bias, y, 1,
                            threads); break;
#endif
    }
}

static long width(const qlite_product *parts, int n_parts) {  /* a projection's outputs */
    long N = 0;
    for (int i = 0; i < n_parts; i++) N += parts[i].N;
    return N;
}

/* y [M, width] = the parts' outputs side by side (model.SplitLinear); part_out: room for one part's */
static void projection(const qlite_product *parts, int n_parts, const uint16_t *x, long M, uint16_t *y,
                       uint16_t *part_out, int threads) {
    if (n_parts == 1) { product(parts, x, M, y, threads); return; }
    long N = width(parts, n_parts), at = 0;
    for (int i = 0; i < n_parts; i++) {
        product(parts + i, x, M, part_out, threads);
        for (long m = 0; m < M; m++) memcpy(y + m * N + at, part_out + m * parts[i].N, 2 * parts[i].N);
        at += parts[i].N;
    }
}

static void add_into(uint16_t *x, const uint16_t *d, long n) {  /* x = bf16(x + d), as torch adds bf16 */
    for (long i = 0; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(d[i]));
}

/* x: the residual stream, bf16 [B, hidden], in and out. The caches and attention arguments are
 * qlite_decode_attention's (pos_step 1, row_stride 0: B new tokens of one sequence, speculation's verify),
 * layer l's caches at cache_k / cache_v + l * layer_stride bytes, its key offsets at k_offsets + l * n_kv * hd
 * (k_offsets NULL: none). */
void qlite_decode_layers(const qlite_layer *layers, long n_layers, uint16_t *x, long B, long hidden, float eps,
                         const float *cos, const float *sin, uint8_t *cache_k, uint8_t *cache_v, long layer_stride,
                         long row_stride, const int64_t *starts, long n_head, long n_kv, long hd, long capacity,
                         long pos, long pos_step, int bits, const float *k_offsets, int threads) {
    long qkv_n = (n_head + 2 * n_kv) * hd, gu_n = 0, part = 0;  /* gu_n: the widest gate|up; part: split part */
    for (long l = 0; l < n_layers; l++) {
        const qlite_layer *L = layers + l;
        gu_n = width(L->gate_up, L->n_gate_up) > gu_n ? width(L->gate_up, L->n_gate_up) : gu_n;
        for (int i = 0; i < L->n_qkv; i++) part = L->qkv[i].N > part ? L->qkv[i].N : part;
        for (int i = 0; i < L->n_gate_up; i++) part = L->gate_up[i].N > part ? L->gate_up[i].N : part;
    }
    /* h: a normed row, qkv, attn: attention's output, delta: a projection back to hidden, gu: gate|up,
     * act: silu(gate) * up, part_out: one part of a split projection */
    uint16_t *h = malloc(2 * B * (2 * hidden + qkv_n + n_head * hd + gu_n + gu_n / 2 + part));
    uint16_t *delta = h + B * hidden, *qkv = delta + B * hidden, *attn = qkv + B * qkv_n;
    uint16_t *gu = attn + B * n_head * hd, *act = gu + B * gu_n, *part_out = act + B * gu_n / 2;
    for (long l = 0; l < n_layers; l++) {
        const qlite_layer *L = layers + l;
        qlite_rmsnorm(x, B, hidden, L->input_norm, eps, h);
        projection(L->qkv, L->n_qkv, h, B, qkv, part_out, threads);
        qlite_decode_attention(qkv, B, cos, sin, cache_k + l * layer_stride, cache_v + l * layer_stride, row_stride,
                               starts, n_head, n_kv, hd, capacity, pos, pos_step, bits,
                               k_offsets ? k_offsets + l * n_kv * hd : NULL,
                               attn, threads);
        product(&L->o, attn, B, delta, threads);
        add_into(x, delta, B * hidden);
        qlite_rmsnorm(x, B, hidden, L->post_norm, eps, h);
        projection(L->gate_up, L->n_gate_up, h, B, gu, part_out, threads);
        long inter = width(L->gate_up, L->n_gate_up) / 2;
        qlite_silu_mul(gu, B, inter, act);
        product(&L->down, act, B, delta, threads);
        add_into(x, delta, B * hidden);
    }
    free(h);
}
