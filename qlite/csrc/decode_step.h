/* qlite_decode_layers: every decoder layer of one decode step (one new token per row; or, pos_step 1, one
 * sequence's new tokens as rows, speculation's verify pass) in one call, the same in both kernel files
 * (kernels.c, kernels_avx2.c), included after their products and small ops; and qlite_sparse_mlp, a mixture of
 * experts' sparse MLP, which it and the module path (NativeOps) both call. It calls exactly the functions the
 * module path calls one by one (decoder.layers.DecoderLayer with the native kernels), in the same order, with
 * the same roundings, so its result is bitwise that path's: what it saves is ~10 Python calls and torch
 * allocations per layer. A file defines INTEGER_PRODUCTS where it has qlite_gemv_vnni (and qlite_gemv_vnni_lowbit). */

typedef struct {  /* one product, as native.Product holds it */
    int kind;  /* 0 bf16 (qlite_gemv_bf16), 1 int8, 2 int4, 3 integer activations (qlite_gemv_vnni), 4 int3k / int2k,
                * 5 int3k / int2k with integer activations (qlite_gemv_vnni_lowbit) */
    int int4;  /* kind 3: int4 weights (else int8) */
    const void *w;
    const void *scales;  /* fp16, or int4k's uint8 codes under row_scales (int3k / int2k: codes and zero points) */
    const uint16_t *row_scales;  /* int4k, int3k, int2k: fp16 [N]; else NULL */
    const uint8_t *zeros;
    long G, N, K;
    const float *bias;
    int bits;  /* kinds 4 and 5: 3 or 2 */
    const float *signs;  /* a rotated format's (turn.h): x turned first; else NULL */
} qlite_product;

typedef struct {  /* one SwiGLU's products (an expert's): gate|up as one product or two side by side, down */
    qlite_product gate_up[2], down;
    int n_gate_up;
} qlite_expert;

typedef int (*qlite_make_expert)(long layer, long expert);  /* 0 once experts[expert] holds its products */

typedef struct {  /* a mixture of experts' sparse MLP (decoder/mlp.py SparseMLP) */
    qlite_product router;  /* bf16 [n_experts, hidden] */
    qlite_expert *experts;  /* [n_experts]; one whose down.w is NULL is made by make(layer, e) when first chosen */
    long n_experts, layer;
    int per_token, norm_topk;  /* the k each token takes; whether their weights are renormalized to sum 1 */
    const qlite_expert *shared;  /* Qwen2-MoE's shared expert, or NULL */
    qlite_product shared_gate;  /* bf16 [1, hidden] (with shared) */
    qlite_make_expert make;
} qlite_moe;

typedef struct {  /* a decoder layer: its RMSNorm weights (bf16 [hidden]) and projections; q|k|v and
                   * gate|up are one product, or 3 and 2 side by side where their formats differ; q_norm and
                   * k_norm (bf16 [head_dim], or NULL): Qwen3's per-head norms; moe (or NULL): a sparse MLP in
                   * place of gate_up / down */
    const uint16_t *input_norm, *post_norm;
    qlite_product qkv[3], o, gate_up[2], down;
    int n_qkv, n_gate_up;
    const uint16_t *q_norm, *k_norm;
    const qlite_moe *moe;
} qlite_layer;

static void product(const qlite_product *p, const uint16_t *x, long M, uint16_t *y, int threads) {
    uint16_t *turned = NULL;
    if (p->signs) {
        turned = malloc(2 * M * p->K);
        qlite_turn_inputs(x, M, p->K, p->signs, turned, threads);
        x = turned;
    }
    switch (p->kind) {
    case 0: qlite_gemv_bf16(x, M, p->w, p->N, p->K, p->bias, y, 1, threads); break;
    case 1: qlite_gemv_int8(x, M, p->w, p->scales, p->G, p->N, p->K, p->bias, y, 1, threads); break;
    case 2: qlite_gemv_int4(x, M, p->w, p->scales, p->row_scales, p->zeros, p->G, p->N, p->K, p->bias, y, 1, threads); break;
    case 4: qlite_gemv_lowbit(x, M, p->w, p->scales, p->row_scales, p->bits, p->G, p->N, p->K, p->bias, y, 1, threads); break;
#ifdef INTEGER_PRODUCTS
    case 3: qlite_gemv_vnni(x, M, p->w, p->scales, p->row_scales, p->zeros, p->int4, p->G, p->N, p->K, p->bias, y, 1,
                            threads); break;
    case 5: qlite_gemv_vnni_lowbit(x, M, p->w, p->scales, p->row_scales, p->bits, p->G, p->N, p->K, p->bias, y, 1,
                                   threads); break;
#endif
    }
    free(turned);
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

/* Each row's k experts from the router's bf16 logits [M, E]: softmax in float, the k largest (ties: the lower
 * index), renormalized to sum 1 with norm_topk, the weights rounded to bf16. chosen [M, k], weights [M, k]. */
static void route_rows(const uint16_t *logits, long M, long E, int k, int norm_topk, int64_t *chosen, uint16_t *weights) {
    float *p = malloc(4 * E);
    for (long m = 0; m < M; m++) {
        const uint16_t *l = logits + m * E;
        float top = -INFINITY, sum = 0.f, kept = 0.f;
        for (long e = 0; e < E; e++) top = fmaxf(top, bf16_to_f32(l[e]));
        for (long e = 0; e < E; e++) sum += p[e] = expf(bf16_to_f32(l[e]) - top);
        float w[k];
        for (int j = 0; j < k; j++) {
            long best = 0;
            for (long e = 1; e < E; e++) if (p[e] > p[best]) best = e;
            chosen[m * k + j] = best;
            kept += w[j] = p[best] / sum;
            p[best] = -1.f;  /* taken */
        }
        for (int j = 0; j < k; j++) weights[m * k + j] = f32_to_bf16(norm_topk ? w[j] / kept : w[j]);
    }
    free(p);
}

/* One expert over its n rows of h (tokens: which), into y [n, hidden]; room: for its rows, gate|up, silu * up
 * and a split part (rows, gu_n: the most any expert takes) */
static void run_expert(const qlite_expert *X, const uint16_t *h, const int64_t *tokens, long n, long hidden, long gu_n,
                       long rows, uint16_t *room, uint16_t *y, int threads) {
    uint16_t *xs = room, *gu = xs + rows * hidden, *act = gu + rows * gu_n, *part_out = act + rows * gu_n / 2;
    for (long j = 0; j < n; j++) memcpy(xs + j * hidden, h + tokens[j] * hidden, 2 * hidden);
    projection(X->gate_up, X->n_gate_up, xs, n, gu, part_out, threads);
    qlite_silu_mul(gu, n, width(X->gate_up, X->n_gate_up) / 2, act);
    product(&X->down, act, n, y, threads);
}

/* qlite_sparse_mlp: out [M, hidden] = a sparse MLP of the normed rows h [M, hidden], what decoder/mlp.py's
 * SparseMLP computes, in one call (NativeOps' layer call and the fused decode step both run it, so they agree
 * bit for bit): the router's product, route_rows, then each chosen expert, ascending, once over the rows that
 * chose it (its gate|up, silu(gate) * up, down), each row's output times its router weight (bf16, as torch's
 * bf16 multiply) added into that row in expert order (bf16 sums); with a shared expert, + bf16(sigmoid(gate))
 * x its output. A row's result does not depend on the rows beside it where the products do not. 0, or -1
 * when an expert could not be made. */
int qlite_sparse_mlp(const qlite_moe *m, const uint16_t *h, long M, long hidden, uint16_t *out, int threads) {
    long E = m->n_experts, k = m->per_token, pairs = M * k, rows = 0, gu_n = 0, part = 0;
    uint16_t *logits = malloc(2 * M * E), *weights = malloc(2 * pairs);
    int64_t *chosen = malloc(8 * pairs), *at = calloc(E + 1, 8), *token = malloc(8 * pairs), *slot = malloc(8 * pairs);
    product(&m->router, h, M, logits, threads);
    route_rows(logits, M, E, k, m->norm_topk, chosen, weights);
    for (long i = 0; i < pairs; i++) at[chosen[i] + 1]++;
    for (long e = 0; e < E; e++) at[e + 1] += at[e];
    int rc = 0;
    for (long e = 0; e < E; e++) {  /* every chosen expert made; the most rows one takes, the widest gate|up */
        long n = at[e + 1] - at[e];
        if (!n) continue;
        if (!m->experts[e].down.w && (m->make(m->layer, e) || !m->experts[e].down.w)) { rc = -1; goto done; }
        const qlite_expert *X = m->experts + e;
        long w = width(X->gate_up, X->n_gate_up);
        rows = n > rows ? n : rows;
        gu_n = w > gu_n ? w : gu_n;
        for (int i = 0; i < X->n_gate_up; i++) part = X->gate_up[i].N > part ? X->gate_up[i].N : part;
    }
    if (m->shared) {
        long w = width(m->shared->gate_up, m->shared->n_gate_up);
        rows = M, gu_n = w > gu_n ? w : gu_n;
        for (int i = 0; i < m->shared->n_gate_up; i++) part = m->shared->gate_up[i].N > part ? m->shared->gate_up[i].N : part;
    }
    {
        long fill[E];  /* pairs grouped by expert; within one, rows ascending */
        for (long e = 0; e < E; e++) fill[e] = at[e];
        for (long i = 0; i < pairs; i++) { long j = fill[chosen[i]]++; token[j] = i / k; slot[j] = i; }
    }
    /* ys: every chosen expert's outputs, in pair order; an expert's room: its rows of h, gate|up, silu(gate) * up */
    long room = rows * (hidden + gu_n + gu_n / 2 + part + 1);
    uint16_t *ys = malloc(2 * (pairs > M ? pairs : M) * hidden);
    long used = 0;
    for (long e = 0; e < E; e++) used += at[e + 1] > at[e];
    if (threads > 1 && used >= threads) {  /* the experts side by side, a thread each (one product's rows are few) */
        #pragma omp parallel num_threads(threads)
        {
            uint16_t *own = malloc(2 * room);
            #pragma omp for schedule(dynamic, 1)
            for (long e = 0; e < E; e++)
                if (at[e + 1] > at[e]) run_expert(m->experts + e, h, token + at[e], at[e + 1] - at[e], hidden, gu_n, rows,
                                                  own, ys + at[e] * hidden, 1);
            free(own);
        }
    } else {
        uint16_t *own = malloc(2 * room);
        for (long e = 0; e < E; e++)
            if (at[e + 1] > at[e]) run_expert(m->experts + e, h, token + at[e], at[e + 1] - at[e], hidden, gu_n, rows, own,
                                              ys + at[e] * hidden, threads);
        free(own);
    }
    memset(out, 0, 2 * M * hidden);
    for (long j = 0; j < pairs; j++) {  /* experts ascending, as the reference adds them */
        float w = bf16_to_f32(weights[slot[j]]);
        uint16_t *o = out + token[j] * hidden;
        const uint16_t *y = ys + j * hidden;
        for (long i = 0; i < hidden; i++)
            o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(f32_to_bf16(bf16_to_f32(y[i]) * w)));
    }
    if (m->shared) {  /* all M rows (rows >= M), its output in ys's first M rows */
        uint16_t *own = malloc(2 * room + 2 * M), *gate = own + room;  /* gate: [M, 1] */
        uint16_t *gu = own + rows * hidden, *act = gu + rows * gu_n, *part_out = act + rows * gu_n / 2;
        projection(m->shared->gate_up, m->shared->n_gate_up, h, M, gu, part_out, threads);
        qlite_silu_mul(gu, M, width(m->shared->gate_up, m->shared->n_gate_up) / 2, act);
        product(&m->shared->down, act, M, ys, threads);
        product(&m->shared_gate, h, M, gate, threads);
        for (long r = 0; r < M; r++) {
            float g = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-bf16_to_f32(gate[r])))));
            for (long i = 0; i < hidden; i++) {
                float y = bf16_to_f32(f32_to_bf16(g * bf16_to_f32(ys[r * hidden + i])));
                out[r * hidden + i] = f32_to_bf16(bf16_to_f32(out[r * hidden + i]) + y);
            }
        }
        free(own);
    }
    free(ys);
done:
    free(logits); free(weights); free(chosen); free(at); free(token); free(slot);
    return rc;
}

/* x: the residual stream, bf16 [B, hidden], in and out. The caches and attention arguments are
 * qlite_decode_attention's (pos_step 1, row_stride 0: B new tokens of one sequence, speculation's verify),
 * layer l's caches at cache_k / cache_v + l * layer_stride bytes, its key offsets at k_offsets + l * n_kv * hd
 * (k_offsets NULL: none). */
int qlite_decode_layers(const qlite_layer *layers, long n_layers, uint16_t *x, long B, long hidden, float eps,
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
        for (long b = 0; b < B && L->q_norm; b++) {  /* each head of q, then of k, RMS-normed (attn: room) */
            uint16_t *q = qkv + b * qkv_n, *k = q + n_head * hd;
            qlite_rmsnorm(q, n_head, hd, L->q_norm, eps, attn);
            memcpy(q, attn, 2 * n_head * hd);
            qlite_rmsnorm(k, n_kv, hd, L->k_norm, eps, attn);
            memcpy(k, attn, 2 * n_kv * hd);
        }
        qlite_decode_attention(qkv, B, cos, sin, cache_k + l * layer_stride, cache_v + l * layer_stride, row_stride,
                               starts, n_head, n_kv, hd, capacity, pos, pos_step, bits,
                               k_offsets ? k_offsets + l * n_kv * hd : NULL,
                               attn, threads);
        product(&L->o, attn, B, delta, threads);
        add_into(x, delta, B * hidden);
        qlite_rmsnorm(x, B, hidden, L->post_norm, eps, h);
        if (L->moe) {
            if (qlite_sparse_mlp(L->moe, h, B, hidden, delta, threads)) { free(h); return -1; }
        } else {
            projection(L->gate_up, L->n_gate_up, h, B, gu, part_out, threads);
            long inter = width(L->gate_up, L->n_gate_up) / 2;
            qlite_silu_mul(gu, B, inter, act);
            product(&L->down, act, B, delta, threads);
        }
        add_into(x, delta, B * hidden);
    }
    free(h);
    return 0;
}

