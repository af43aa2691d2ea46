/* The fast path of kvdb.model.integer_lm's forward pass: the same equations, fused per row.
 *
 * kvdb/model/integer_lm.py is the specification (and the reference implementation): every sum there is
 * a sum of integers held exactly in floats, so here it is an int32/int64 sum, exact in any order
 * and any SIMD width; every other operation is the same IEEE-754 binary64 operation in the same
 * order. That is why this file must be compiled with -ffp-contract=off and without -ffast-math
 * (setup.py): a fused multiply-add rounds once where the specification rounds twice.
 *
 * Python owns every buffer (weights, the cache, the rotary tables, the outputs) and passes
 * pointers through ctypes; this file allocates only per-call scratch. The integer dot products
 * have an AVX2 version, chosen at run time, and a plain C one: both give the same integers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVDB_X86 1
#endif

#define ACT_LIMIT 32639.0
#define ATTN_ONE 65536.0
#define EXP_FLOOR -80.0
#define DOT_BLOCK 2048 /* int16 x int8 pairs summed in int32: 2048 / 16 * 2 * 32639 * 127 < 2^31 */

typedef struct {
    int64_t in, out;
    const int8_t *weight; /* [out, in] */
    const double *scale;  /* [out] */
    const double *bias;   /* [out] or NULL */
} Linear;

typedef struct {
    Linear qkv, out, gate_up, down;
    const double *attn_norm, *mlp_norm;
} Layer;

typedef struct {
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter, vocab, threads;
    double eps;
    const Layer *layers;
    Linear head;
    const double *norm;
    const double *exp_table;  /* 2**(j/64), j < 64 */
    const double *exp_coeffs; /* 4, highest power first */
} Model;

typedef struct {
    int64_t capacity;  /* positions per (layer, kv head) */
    int16_t *k, *v;    /* [layers, kv_heads, capacity, head_dim] */
    double *ks, *vs;   /* [layers, kv_heads, capacity] */
} Cache;

/* ---------------------------------------------------------------------------------------- */
/* elementwise functions, in the specification's order of operations                        */
/* ---------------------------------------------------------------------------------------- */

static const double LN2_64_HI = 0x1.62e42feep-7;
static const double LN2_64_LO = 0x1.a39ef35793c76p-39;
static const double INV_LN2_64 = 0x1.71547652b82fep+6;

/* round half to even, as torch.round and rint do, for |x| < 2**51: adding 1.5 * 2**52 puts x
 * where doubles are integers (the sum rounds to the nearest, ties to even), and subtracting it
 * is exact. Every value rounded here is below 2**17. Inline, where rint is a library call. */
static inline double round_even(double x) { return (x + 0x1.8p52) - 0x1.8p52; }

static inline double exp_nonpositive(const Model *m, double d) {
    d = d < EXP_FLOOR ? EXP_FLOOR : d;
    d = d > 0.0 ? 0.0 : d;
    double kf = round_even(d * INV_LN2_64);
    double r = (d - kf * LN2_64_HI) - kf * LN2_64_LO;
    int64_t k = (int64_t)kf;
    int64_t bits = ((k >> 6) + 1023) << 52;
    double power;
    memcpy(&power, &bits, sizeof power);
    const double *c = m->exp_coeffs;
    double acc = r * 0.0 + c[0];
    acc = acc * r + c[1];
    acc = acc * r + c[2];
    acc = acc * r + c[3];
    return (acc * m->exp_table[k & 63]) * power;
}

static inline double silu(const Model *m, double x) {
    double e = exp_nonpositive(m, -fabs(x));
    return x * (x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
}

/* q = round(x / s), s = max|x| / ACT_LIMIT (1 for a zero row): x ~ q * s */
static double quantize_row(const double *x, int64_t len, int16_t *q) {
    double peak = 0.0;
    for (int64_t i = 0; i < len; i++) {
        double a = fabs(x[i]);
        peak = a > peak ? a : peak;
    }
    double s = peak > 0 ? peak / ACT_LIMIT : 1.0;
    for (int64_t i = 0; i < len; i++) q[i] = (int16_t)round_even(x[i] / s);
    return s;
}

static void rms_norm(const Model *m, const double *x, const double *weight, int64_t rows, double *y, int16_t *scratch) {
    int64_t dim = m->hidden;
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * dim;
        double s = quantize_row(xr, dim, scratch);
        int64_t sum = 0;
        for (int64_t i = 0; i < dim; i++) sum += (int64_t)scratch[i] * scratch[i];
        double mean_square = (((double)sum / (double)dim) * s) * s;
        double inv = 1.0 / sqrt(mean_square + m->eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = (xr[i] * inv) * weight[i];
    }
}

/* ---------------------------------------------------------------------------------------- */
/* integer dot products                                                                     */
/* ---------------------------------------------------------------------------------------- */

/* four int16 x int8 dot products of one activation row with weight rows w0..w3 */
static void dot4_plain(const int16_t *a, const int8_t *w, int64_t len, int64_t stride, int64_t *out) {
    for (int c = 0; c < 4; c++) {
        const int8_t *b = w + c * stride;
        int64_t total = 0;
        for (int64_t k = 0; k < len; k++) total += (int64_t)a[k] * b[k];
        out[c] = total;
    }
}

static int64_t dot16_plain(const int16_t *a, const int16_t *b, int64_t len) {
    int64_t total = 0;
    for (int64_t k = 0; k < len; k++) total += (int64_t)a[k] * b[k];
    return total;
}

#ifdef KVDB_X86
__attribute__((target("avx2"))) static inline int64_t hsum32(__m256i v) {
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, v);
    int64_t total = 0;
    for (int i = 0; i < 8; i++) total += lanes[i];
    return total;
}

__attribute__((target("avx2"))) static void dot4_avx2(const int16_t *a, const int8_t *w, int64_t len, int64_t stride, int64_t *out) {
    int64_t total[4] = {0, 0, 0, 0};
    for (int64_t base = 0; base < len; base += DOT_BLOCK) {
        int64_t end = base + DOT_BLOCK < len ? base + DOT_BLOCK : len;
        __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        int64_t k = base;
        for (; k + 16 <= end; k += 16) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(a + k));
            acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(x, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)))));
            acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(x, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + stride + k)))));
            acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(x, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 2 * stride + k)))));
            acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(x, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 3 * stride + k)))));
        }
        total[0] += hsum32(acc0);
        total[1] += hsum32(acc1);
        total[2] += hsum32(acc2);
        total[3] += hsum32(acc3);
        for (; k < end; k++)
            for (int c = 0; c < 4; c++) total[c] += (int64_t)a[k] * w[c * stride + k];
    }
    memcpy(out, total, sizeof total);
}

/* two activation rows against a panel of four weight rows already widened to int16 (in L1):
 * each load feeds two or four madds */
__attribute__((target("avx2"))) static void dot2x4_avx2(const int16_t *a0, const int16_t *a1, const int16_t *w, int64_t len, int64_t *out) {
    int64_t total[8] = {0};
    for (int64_t base = 0; base < len; base += DOT_BLOCK) {
        int64_t end = base + DOT_BLOCK < len ? base + DOT_BLOCK : len;
        __m256i acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_si256();
        int64_t k = base;
        for (; k + 16 <= end; k += 16) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(a0 + k)), x1 = _mm256_loadu_si256((const __m256i *)(a1 + k));
            for (int c = 0; c < 4; c++) {
                __m256i wc = _mm256_loadu_si256((const __m256i *)(w + c * len + k));
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(x0, wc));
                acc[4 + c] = _mm256_add_epi32(acc[4 + c], _mm256_madd_epi16(x1, wc));
            }
        }
        for (int c = 0; c < 8; c++) total[c] += hsum32(acc[c]);
        for (; k < end; k++)
            for (int c = 0; c < 4; c++) {
                total[c] += (int64_t)a0[k] * w[c * len + k];
                total[4 + c] += (int64_t)a1[k] * w[c * len + k];
            }
    }
    memcpy(out, total, sizeof total);
}

/* int16 x int16: a pair's sum (<= 2 * 32639^2) fits int32, so each madd is widened to int64 */
__attribute__((target("avx2"))) static int64_t dot16_avx2(const int16_t *a, const int16_t *b, int64_t len) {
    __m256i acc = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m256i p = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a + k)), _mm256_loadu_si256((const __m256i *)(b + k)));
        acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(p)));
        acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(p, 1)));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    int64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; k < len; k++) total += (int64_t)a[k] * b[k];
    return total;
}
#endif

static void (*dot4)(const int16_t *, const int8_t *, int64_t, int64_t, int64_t *) = dot4_plain;
static void (*dot2x4)(const int16_t *, const int16_t *, const int16_t *, int64_t, int64_t *) = NULL; /* NULL: no SIMD */
static int64_t (*dot16)(const int16_t *, const int16_t *, int64_t) = dot16_plain;

/* ---------------------------------------------------------------------------------------- */
/* work split across threads (integer sums: any split gives the same results)               */
/* ---------------------------------------------------------------------------------------- */

typedef void (*RangeFn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    RangeFn fn;
    void *ctx;
    int64_t begin, end;
} Part;

static void *run_part(void *arg) {
    Part *p = (Part *)arg;
    p->fn(p->ctx, p->begin, p->end);
    return NULL;
}

/* fn over [0, total) in `threads` parts when the work (total * cost) is worth a thread */
static void parallel(const Model *m, RangeFn fn, void *ctx, int64_t total, int64_t cost) {
    int64_t threads = m->threads < 1 ? 1 : (m->threads > 16 ? 16 : m->threads);
    if (threads == 1 || total < 2 || total * cost < (1 << 21)) {
        fn(ctx, 0, total);
        return;
    }
    if (threads > total) threads = total;
    Part parts[16];
    pthread_t ids[16];
    int started[16] = {0};
    for (int64_t t = 0; t < threads; t++) {
        parts[t] = (Part){fn, ctx, total * t / threads, total * (t + 1) / threads};
        if (t > 0) started[t] = pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    }
    fn(ctx, parts[0].begin, parts[0].end);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            fn(ctx, parts[t].begin, parts[t].end); /* no thread: do its part here */
    }
}

/* ---------------------------------------------------------------------------------------- */
/* linear layers: y = (sum_k q_k w_k) * s * s_w (+ bias), q the row quantized to 16 bits     */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    const Linear *lin;
    const int16_t *q;
    const double *s;
    int64_t rows;
    double *y;
} LinearJob;

static void store(const LinearJob *job, int64_t r, int64_t j, int64_t width, const int64_t *acc) {
    const Linear *lin = job->lin;
    for (int64_t c = 0; c < width; c++) {
        double y = ((double)acc[c] * job->s[r]) * lin->scale[j + c];
        job->y[r * lin->out + j + c] = lin->bias ? y + lin->bias[j + c] : y;
    }
}

#define GROUP 4 /* panels widened together: 16 weight rows (int16) in L1, each activation row pair read once for them */

static void linear_columns(void *arg, int64_t begin, int64_t end) {
    /* columns [4 * begin, 4 * end) in panels of four weight rows. With two rows or more and SIMD,
     * a group of panels is widened to int16 once and met by two activation rows at a time. */
    const LinearJob *job = (const LinearJob *)arg;
    const Linear *lin = job->lin;
    int64_t in = lin->in, out = lin->out;
    int64_t acc[8];
    int16_t *group16 = dot2x4 && job->rows > 1 ? malloc(sizeof(int16_t) * 4 * GROUP * in) : NULL;
    for (int64_t first = begin; first < end; first += GROUP) {
        int64_t last = first + GROUP < end ? first + GROUP : end;
        int64_t full = last; /* panels [first, full) have four columns */
        if (full > first && out - 4 * (full - 1) < 4) full--;
        int64_t r = 0;
        if (group16 && full > first) {
            for (int64_t k = 0; k < 4 * (full - first) * in; k++) group16[k] = lin->weight[4 * first * in + k];
            for (; r + 2 <= job->rows; r += 2)
                for (int64_t panel = first; panel < full; panel++) {
                    dot2x4(job->q + r * in, job->q + (r + 1) * in, group16 + 4 * (panel - first) * in, in, acc);
                    store(job, r, 4 * panel, 4, acc);
                    store(job, r + 1, 4 * panel, 4, acc + 4);
                }
        }
        for (int64_t panel = first; panel < last; panel++) {
            int64_t j = panel * 4, width = out - j < 4 ? out - j : 4;
            for (int64_t rr = panel < full ? r : 0; rr < job->rows; rr++) {
                const int16_t *q = job->q + rr * in;
                if (width == 4) {
                    dot4(q, lin->weight + j * in, in, in, acc);
                } else {
                    for (int64_t c = 0; c < width; c++) {
                        acc[c] = 0;
                        for (int64_t k = 0; k < in; k++) acc[c] += (int64_t)q[k] * lin->weight[(j + c) * in + k];
                    }
                }
                store(job, rr, j, width, acc);
            }
        }
    }
    free(group16);
}

static void linear(const Model *m, const Linear *lin, const double *x, int64_t rows, double *y, int16_t *q, double *s) {
    for (int64_t r = 0; r < rows; r++) s[r] = quantize_row(x + r * lin->in, lin->in, q + r * lin->in);
    LinearJob job = {lin, q, s, rows, y};
    parallel(m, linear_columns, &job, (lin->out + 3) / 4, 4 * rows * lin->in);
}

/* ---------------------------------------------------------------------------------------- */
/* attention                                                                                */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    const Model *m;
    const int16_t *k, *v;  /* this layer's, [kv_heads, capacity, head_dim] */
    const double *ks, *vs; /* [kv_heads, capacity] */
    int64_t capacity, start, n;
    const int16_t *qq; /* [n, heads, head_dim] */
    const double *qs;  /* [n, heads] */
    double *out;       /* [n, heads * head_dim] */
    double *scratch;   /* per head: 2 * (start + n) doubles */
} AttentionJob;

#ifdef KVDB_X86
__attribute__((target_clones("avx2", "default")))
#endif
static void attention_heads(void *arg, int64_t begin, int64_t end) {
    const AttentionJob *job = (const AttentionJob *)arg;
    const Model *m = job->m;
    int64_t d = m->head_dim, group = m->heads / m->kv_heads, keys_max = job->start + job->n;
    double inv_sqrt_d = 1.0 / sqrt((double)d);
    for (int64_t h = begin; h < end; h++) {
        int64_t g = h / group;
        const int16_t *keys = job->k + g * job->capacity * d, *values = job->v + g * job->capacity * d;
        const double *ks = job->ks + g * job->capacity, *vs = job->vs + g * job->capacity;
        double *e = job->scratch + h * 2 * keys_max, *weighted = e + keys_max;
        int64_t acc[512];
        for (int64_t r = 0; r < job->n; r++) {
            int64_t keys_n = job->start + r + 1; /* causal: keys up to this position */
            const int16_t *q = job->qq + (r * m->heads + h) * d;
            double qs = job->qs[r * m->heads + h];
            double top = -INFINITY;
            for (int64_t j = 0; j < keys_n; j++) {
                double score = (((double)dot16(q, keys + j * d, d) * qs) * ks[j]) * inv_sqrt_d;
                e[j] = score;
                top = score > top ? score : top;
            }
            double peak = 0.0;
            int64_t total = 0;
            for (int64_t j = 0; j < keys_n; j++) {
                e[j] = exp_nonpositive(m, e[j] - top);
                weighted[j] = e[j] * vs[j];
                peak = weighted[j] > peak ? weighted[j] : peak;
                total += (int64_t)round_even(e[j] * ATTN_ONE);
            }
            double per_one = (1.0 / peak) * ATTN_ONE;
            memset(acc, 0, sizeof(int64_t) * d);
            for (int64_t j = 0; j < keys_n; j++) {
                int32_t w = (int32_t)round_even(weighted[j] * per_one); /* <= 65536: w * v fits int32, not the sum */
                const int16_t *vj = values + j * d;
                for (int64_t i = 0; i < d; i++) acc[i] += (int64_t)(w * (int32_t)vj[i]);
            }
            double norm = (double)total / ATTN_ONE;
            double *o = job->out + (r * m->heads + h) * d;
            for (int64_t i = 0; i < d; i++) o[i] = ((double)acc[i] / per_one) / norm;
        }
    }
}

/* RoPE on one head's row: the halves' pairs (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rotate(double *x, int64_t d, const double *cos, const double *sin) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        double x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the forward pass                                                                          */
/* ---------------------------------------------------------------------------------------- */

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* h: [n, hidden] the tokens' embeddings (overwritten); cos, sin: [>= start + n, head_dim / 2];
 * logits: [n, vocab]. The cache must hold capacity >= start + n; positions start.. are written.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int kvdb_forward(const Model *m, Cache *cache, int64_t start, int64_t n, double *h, const double *cos, const double *sin, double *logits) {
    int64_t H = m->heads, KV = m->kv_heads, d = m->head_dim, hidden = m->hidden;
    int64_t qkv_width = (H + 2 * KV) * d;
    if (m->head_dim > 512) return -2;
    size_t widest = max3((size_t)qkv_width, (size_t)(2 * m->inter), (size_t)m->vocab);
    size_t in_widest = max3((size_t)hidden, (size_t)m->inter, (size_t)(H * d));
    double *x = malloc(sizeof(double) * n * (size_t)(hidden > H * d ? hidden : H * d));
    double *wide = malloc(sizeof(double) * n * widest);
    double *act = malloc(sizeof(double) * n * (size_t)(m->inter > H * d ? m->inter : H * d));
    int16_t *q = malloc(sizeof(int16_t) * n * in_widest);
    double *s = malloc(sizeof(double) * n); /* a linear layer's row scales */
    int16_t *qq = malloc(sizeof(int16_t) * n * H * d);
    double *qs = malloc(sizeof(double) * n * H);
    double *scratch = malloc(sizeof(double) * H * 2 * (start + n));
    int status = 0;
    if (!x || !wide || !act || !q || !s || !qq || !qs || !scratch) {
        status = -1;
        goto done;
    }
    for (int64_t li = 0; li < m->n_layers; li++) {
        const Layer *layer = &m->layers[li];
        int16_t *lk = cache->k + li * KV * cache->capacity * d, *lv = cache->v + li * KV * cache->capacity * d;
        double *lks = cache->ks + li * KV * cache->capacity, *lvs = cache->vs + li * KV * cache->capacity;

        rms_norm(m, h, layer->attn_norm, n, x, q);
        linear(m, &layer->qkv, x, n, wide, q, s);
        for (int64_t r = 0; r < n; r++) {
            int64_t pos = start + r;
            double *row = wide + r * qkv_width;
            for (int64_t head = 0; head < H + KV; head++) rotate(row + head * d, d, cos + pos * (d / 2), sin + pos * (d / 2));
            for (int64_t head = 0; head < H; head++) qs[r * H + head] = quantize_row(row + head * d, d, qq + (r * H + head) * d);
            for (int64_t g = 0; g < KV; g++) {
                int64_t at = g * cache->capacity + pos;
                lks[at] = quantize_row(row + (H + g) * d, d, lk + at * d);
                lvs[at] = quantize_row(row + (H + KV + g) * d, d, lv + at * d);
            }
        }
        AttentionJob job = {m, lk, lv, lks, lvs, cache->capacity, start, n, qq, qs, act, scratch};
        parallel(m, attention_heads, &job, H, n * (start + n) * d * 2);
        linear(m, &layer->out, act, n, x, q, s);
        for (int64_t i = 0; i < n * hidden; i++) h[i] = h[i] + x[i];

        rms_norm(m, h, layer->mlp_norm, n, x, q);
        linear(m, &layer->gate_up, x, n, wide, q, s);
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < m->inter; i++) {
                const double *gu = wide + r * 2 * m->inter;
                act[r * m->inter + i] = silu(m, gu[i]) * gu[m->inter + i];
            }
        linear(m, &layer->down, act, n, x, q, s);
        for (int64_t i = 0; i < n * hidden; i++) h[i] = h[i] + x[i];
    }
    rms_norm(m, h, m->norm, n, x, q);
    linear(m, &m->head, x, n, logits, q, s);
done:
    free(x);
    free(wide);
    free(act);
    free(q);
    free(s);
    free(qq);
    free(qs);
    free(scratch);
    return status;
}

/* which dot products this machine runs: "avx2" or "plain" (the same integers either way) */
const char *kvdb_kernel_isa(int allow_simd) {
    dot4 = dot4_plain;
    dot2x4 = NULL;
    dot16 = dot16_plain;
#ifdef KVDB_X86
    __builtin_cpu_init();
    if (allow_simd && __builtin_cpu_supports("avx2")) {
        dot4 = dot4_avx2;
        dot2x4 = dot2x4_avx2;
        dot16 = dot16_avx2;
        return "avx2";
    }
#endif
    return "plain";
}

/* An importable module, so that setuptools builds and installs this file like any extension;
 * kvdb.model.integer_lm loads the same shared object with ctypes for the functions above. */
static struct PyModuleDef kernel_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_integer_kernel", .m_doc = "kvdb.model.integer_lm's fused forward pass (see integer_kernel.c)", .m_size = -1};

PyMODINIT_FUNC PyInit__integer_kernel(void) { return PyModule_Create(&kernel_module); }
