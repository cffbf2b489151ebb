/* Paged decode attention for CPUs: one query token per sequence, KV read in place.
 *
 * Built at first use by epdserve/kernels/native.py with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off -fno-strict-aliasing), called via ctypes.
 *
 * Each (sequence, kv head) task walks the sequence's blocks straight from the paged cache
 * (no gather, no padding; the next block's rows are prefetched): logits for the G query
 * heads of the kv head, softmax, then the weighted sum of V, all in float32. Tasks are
 * spread over `threads` OpenMP threads (torch's runtime: the library needs libgomp.so.1,
 * which torch has already loaded).
 *
 * The softmax follows torch's CPU flash-attention kernel for one query row over the same
 * keys, so decode matches a model that runs SDPA on its unpadded cache (transformers'
 * default) bit for bit in most rows:
 *   - keys in chunks of 512, the running max and sum rescaled per chunk (online softmax);
 *   - lanes > 0 (bfloat16 on AVX-512: 16, AVX2: 8): exp(x - max) by the kernel's fast
 *     polynomial (fexp) on the first lanes*floor(n/lanes) keys of a chunk, summed in
 *     `lanes` partial sums folded in halves, libm expf on the rest; lanes == 0: expf;
 *   - bfloat16: the probabilities are rounded to bfloat16 before P @ V;
 *   - the output is the float32 accumulator times 1/sum (the caller rounds it).
 * Dot products are summed in any order; their last-bit differences rarely survive the
 * bfloat16 output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 512
#define MAX_G 64

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* 2^(x*log2 e) with a cubic for the fraction, assembled in the exponent bits: the fast
 * exponential (relative error ~1e-5) of torch's flash kernel. x <= 0 here. */
static inline float fexp(float x) {
    const float log2e = bits_to_f32(0x3fb8aa3bu);
    const float ln_min = bits_to_f32(0xc2aeac50u);
    const float c0 = 0.00010703434948458272f, c1 = 0.30354260500649682f;
    const float c2 = -0.22433836478672356f, c3 = -0.079204240219773236f;
    const float a = 8388608.0f, b = 8388608.0f * 127.0f;
    float xc = x < ln_min ? ln_min : x;
    float src = xc * log2e;
    float fr = src - floorf(src);
    float r = fmaf(fr, c3, c2);
    r = fmaf(fr, r, c1);
    r = fmaf(fr, r, c0);
    src = src - r;
    int32_t i = (int32_t)fmaf(a, src, b);
    return x < ln_min ? 0.0f : bits_to_f32((uint32_t)i);
}

static inline int64_t row_offset(const int32_t *blocks, int64_t pos, int64_t bs, int64_t s_n,
                                 int64_t s_b, int64_t h, int64_t s_h) {
    return (int64_t)blocks[pos / bs] * s_n + (pos % bs) * s_b + h * s_h;
}

/* n rows (stride s_b elements, d elements each) from base + off into buf[n][d] as float32 */
static inline void load_rows(float *restrict buf, const void *base, int64_t off, int64_t n,
                             int64_t s_b, int64_t d, int bf16) {
    if (bf16) { /* bfloat16 is the top half of a float32 */
        const uint16_t *src = (const uint16_t *)base + off;
        uint32_t *bits = (uint32_t *)buf; /* built with -fno-strict-aliasing */
        for (int64_t o = 0; o < n; o++) {
            const uint16_t *s = src + o * s_b;
            uint32_t *t = bits + o * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) t[i] = (uint32_t)s[i] << 16;
        }
    } else {
        const float *src = (const float *)base + off;
        for (int64_t o = 0; o < n; o++) memcpy(buf + o * d, src + o * s_b, (size_t)d * sizeof(float));
    }
}

/* blocks are scattered, so the hardware cannot guess the next one: ask for its rows early */
static inline void prefetch_rows(const void *base, int64_t off, int64_t n, int64_t s_b, int64_t d,
                                 int bf16) {
    int64_t elt = bf16 ? 2 : 4;
    const char *p = (const char *)base + off * elt;
    for (int64_t o = 0; o < n; o++)
        for (int64_t b = 0; b < d * elt; b += 64) __builtin_prefetch(p + o * s_b * elt + b);
}

typedef float v16f __attribute__((vector_size(64)));

/* sum of a[i] * b[i]: 16 partial sums folded as a tree (any order will do here) */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        v16f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    v16f t = __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += t;
    t = __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += t;
    t = __builtin_shufflevector(acc, acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += t;
    float sum = acc[0] + acc[1];
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}

/* exp(row - mx) in place over n keys; returns their sum. lanes > 0: the flash kernel's way
 * (fexp on the first lanes*floor(n/lanes) keys summed in `lanes` partial sums folded in
 * halves, libm expf on the rest); lanes == 0: libm expf, summed in order. */
static float exp_chunk(float *restrict row, int64_t n, float mx, int lanes) {
    float part[16] = {0};
    int64_t nvec = lanes > 0 ? lanes * (n / lanes) : 0;
    for (int64_t b = 0; b < nvec; b += lanes) {
#pragma omp simd
        for (int l = 0; l < lanes; l++) {
            float e = fexp(row[b + l] - mx);
            part[l] += e;
            row[b + l] = e;
        }
    }
    for (int step = lanes / 2; step >= 1; step /= 2)
        for (int l = 0; l < step; l++) part[l] += part[l + step];
    float sum = part[0];
    for (int64_t j = nvec; j < n; j++) {
        float e = expf(row[j] - mx);
        sum += e;
        row[j] = e;
    }
    return sum;
}

/* round to nearest even bfloat16, kept as float32 */
static inline void round_bf16(float *restrict x, int64_t n) {
    uint32_t *bits = (uint32_t *)x; /* built with -fno-strict-aliasing */
#pragma omp simd
    for (int64_t j = 0; j < n; j++) bits[j] = (bits[j] + 0x7FFFu + ((bits[j] >> 16) & 1u)) & 0xFFFF0000u;
}

static void one_task(const float *restrict q, float *restrict out, const void *kbase,
                     const void *vbase, int64_t s_n, int64_t s_b, int64_t s_h, int bf16,
                     int64_t bs, int64_t h, int64_t g_count, int64_t d,
                     const int32_t *restrict blocks, int64_t len, float scale, int64_t window,
                     float soft_cap, int lanes, float *restrict work) {
    float *logits = work;                   /* [G, CHUNK] */
    float *acc = logits + g_count * CHUNK;  /* [G, D] */
    float *rows = acc + g_count * d;        /* [BS, D] */
    float mx[MAX_G], sum[MAX_G];
    int64_t lo = window > 0 && len > window ? len - window : 0;
    for (int64_t g = 0; g < g_count; g++) {
        mx[g] = -INFINITY;
        sum[g] = 0.0f;
    }
    memset(acc, 0, (size_t)(g_count * d) * sizeof(float));
    for (int64_t n0 = 0; n0 < len; n0 += CHUNK) {
        int64_t cb = len - n0 < CHUNK ? len - n0 : CHUNK;
        if (n0 + cb <= lo) continue; /* wholly outside the window: adds nothing */
        for (int64_t j = 0, take; j < cb; j += take) {
            int64_t pos = n0 + j, slot = pos % bs;
            take = bs - slot < cb - j ? bs - slot : cb - j;
            if (pos + take <= lo) {
                for (int64_t g = 0; g < g_count; g++)
                    for (int64_t o = 0; o < take; o++) logits[g * CHUNK + j + o] = -INFINITY;
                continue;
            }
            if (j + take < cb) prefetch_rows(kbase, row_offset(blocks, pos + take, bs, s_n, s_b, h, s_h), bs, s_b, d, bf16);
            load_rows(rows, kbase, row_offset(blocks, pos, bs, s_n, s_b, h, s_h), take, s_b, d, bf16);
            for (int64_t g = 0; g < g_count; g++) {
                const float *qg = q + g * d;
                float *lg = logits + g * CHUNK + j;
                for (int64_t o = 0; o < take; o++) {
                    float x = dot(qg, rows + o * d, d) * scale;
                    if (soft_cap > 0.0f) x = tanhf(x / soft_cap) * soft_cap;
                    lg[o] = pos + o < lo ? -INFINITY : x;
                }
            }
        }
        for (int64_t g = 0; g < g_count; g++) {
            float *lg = logits + g * CHUNK;
            float cmax = -INFINITY;
#pragma omp simd reduction(max : cmax)
            for (int64_t j = 0; j < cb; j++) cmax = lg[j] > cmax ? lg[j] : cmax;
            float tmax = mx[g] > cmax ? mx[g] : cmax;
            if (tmax == -INFINITY) {
                memset(lg, 0, (size_t)cb * sizeof(float));
                continue;
            }
            float csum = exp_chunk(lg, cb, tmax, lanes);
            if (bf16) round_bf16(lg, cb); /* P is bfloat16 in P @ V */
            float rescale = expf(mx[g] - tmax);
            sum[g] = csum + rescale * sum[g];
            mx[g] = tmax;
            if (n0 > 0) {
                float *ag = acc + g * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ag[i] *= rescale;
            }
        }
        for (int64_t j = 0, take; j < cb; j += take) {
            int64_t pos = n0 + j, slot = pos % bs;
            take = bs - slot < cb - j ? bs - slot : cb - j;
            if (pos + take <= lo) continue;
            if (j + take < cb) prefetch_rows(vbase, row_offset(blocks, pos + take, bs, s_n, s_b, h, s_h), bs, s_b, d, bf16);
            load_rows(rows, vbase, row_offset(blocks, pos, bs, s_n, s_b, h, s_h), take, s_b, d, bf16);
            for (int64_t g = 0; g < g_count; g++) {
                const float *pg = logits + g * CHUNK + j;
                float *ag = acc + g * d;
                for (int64_t o = 0; o < take; o++) {
                    const float p = pg[o], *vr = rows + o * d;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) ag[i] += p * vr[i];
                }
            }
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        float inv = 1.0f / (sum[g] == 0.0f ? 1.0f : sum[g]);
        float *og = out + g * d;
        const float *ag = acc + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) og[i] = ag[i] * inv;
    }
}

/* q/out: [S, H, D] float32 contiguous. Sequence s reads table row rows[s] (s when rows is
 * NULL) and has lens[s] keys. Caches: element (block, slot, head, i) at
 * base + block*s_n + slot*s_b + head*s_h + i, bfloat16 (bf16 != 0) or float32.
 * Returns 0; -1 for an unsupported layout, -2 when scratch memory ran out. */
int epd_paged_decode(const float *q, float *out, int64_t num_seqs, int64_t num_heads,
                     int64_t head_dim, const void *kbase, const void *vbase, int64_t s_n,
                     int64_t s_b, int64_t s_h, int bf16, int64_t block_size, int64_t kv_heads,
                     const int32_t *table, int64_t table_stride, const int32_t *rows,
                     const int32_t *lens, float scale, int64_t window, float soft_cap,
                     int lanes, int threads) {
    int64_t g_count = num_heads / kv_heads;
    if (g_count > MAX_G || g_count * kv_heads != num_heads || (lanes != 0 && lanes != 8 && lanes != 16))
        return -1;
    int64_t work_floats = g_count * CHUNK + g_count * head_dim + block_size * head_dim;
    int64_t tasks = num_seqs * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *work = (float *)malloc((size_t)work_floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!work) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            int64_t s = t / kv_heads, h = t % kv_heads;
            int64_t r = rows ? rows[s] : s;
            int64_t qoff = (s * num_heads + h * g_count) * head_dim;
            one_task(q + qoff, out + qoff, kbase, vbase, s_n, s_b, s_h, bf16, block_size, h,
                     g_count, head_dim, table + r * table_stride, lens[s], scale, window,
                     soft_cap, lanes, work);
        }
        free(work);
    }
    return failed ? -2 : 0;
}
