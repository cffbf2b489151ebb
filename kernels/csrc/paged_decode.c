/* Paged decode attention for CPUs: one query token per sequence, KV read in place.
 *
 * Built at first use by epdserve/kernels/native.py with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off -fno-strict-aliasing), called via ctypes.
 *
 * Each sequence is one task: it walks its blocks straight from the paged cache (no gather,
 * no padding; the next block is prefetched), reading each block once for all heads (a
 * contiguous [BS, KVH, D] span in the engine's layout; converted to float32 at most 32 KiB
 * at a time so the rows stay in L1): logits of every query head against
 * its kv head (GQA), softmax, then the weighted sum of V (accumulators kept in registers
 * over a block), all in float32. Sequences are spread over `threads` OpenMP threads
 * (torch's runtime: the library needs libgomp.so.1, which torch has already loaded); with
 * fewer sequences than threads, each sequence's kv heads are split into parts.
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
#define PIECE 8192 /* floats of converted rows at a time (32 KiB) */

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
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

/* element offset of token `pos` (head 0) through the sequence's block table */
static inline int64_t slot_offset(const int32_t *blocks, int64_t pos, int64_t bs, int64_t s_n,
                                  int64_t s_b) {
    return (int64_t)blocks[pos / bs] * s_n + (pos % bs) * s_b;
}

/* n token slots x kvh heads (strides s_b, s_h elements; d elements each) from base + off
 * into buf[n][kvh][d] as float32 */
static inline void load_rows(float *restrict buf, const void *base, int64_t off, int64_t n,
                             int64_t kvh, int64_t s_b, int64_t s_h, int64_t d, int bf16) {
    for (int64_t o = 0; o < n; o++)
        for (int64_t h = 0; h < kvh; h++) {
            int64_t src_off = off + o * s_b + h * s_h;
            float *dst = buf + (o * kvh + h) * d;
            if (bf16) { /* bfloat16 is the top half of a float32 */
                const uint16_t *src = (const uint16_t *)base + src_off;
                uint32_t *bits = (uint32_t *)dst; /* built with -fno-strict-aliasing */
#pragma omp simd
                for (int64_t i = 0; i < d; i++) bits[i] = (uint32_t)src[i] << 16;
            } else {
                memcpy(dst, (const float *)base + src_off, (size_t)d * sizeof(float));
            }
        }
}

/* blocks are scattered, so the hardware cannot guess the next one: ask for its rows early */
static inline void prefetch_rows(const void *base, int64_t off, int64_t n, int64_t kvh,
                                 int64_t s_b, int64_t s_h, int64_t d, int bf16) {
    int64_t elt = bf16 ? 2 : 4;
    const char *p = (const char *)base + off * elt;
    for (int64_t o = 0; o < n; o++)
        for (int64_t h = 0; h < kvh; h++)
            for (int64_t b = 0; b < d * elt; b += 64) __builtin_prefetch(p + (o * s_b + h * s_h) * elt + b);
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

/* acc[i] += sum over rows o (`stride` floats apart) of p[o] * rows[o][i]. The accumulators stay in registers for
 * the whole block (a load and a store per block, not per row); per element the rows are
 * still added in order. */
static inline void weighted_rows(float *restrict acc, const float *restrict p,
                                 const float *restrict rows, int64_t n, int64_t stride,
                                 int64_t d) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        v16f a0, a1, a2, a3;
        memcpy(&a0, acc + i, 64);
        memcpy(&a1, acc + i + 16, 64);
        memcpy(&a2, acc + i + 32, 64);
        memcpy(&a3, acc + i + 48, 64);
        for (int64_t o = 0; o < n; o++) {
            const float *r = rows + o * stride + i;
            v16f r0, r1, r2, r3;
            memcpy(&r0, r, 64);
            memcpy(&r1, r + 16, 64);
            memcpy(&r2, r + 32, 64);
            memcpy(&r3, r + 48, 64);
            a0 += p[o] * r0;
            a1 += p[o] * r1;
            a2 += p[o] * r2;
            a3 += p[o] * r3;
        }
        memcpy(acc + i, &a0, 64);
        memcpy(acc + i + 16, &a1, 64);
        memcpy(acc + i + 32, &a2, 64);
        memcpy(acc + i + 48, &a3, 64);
    }
    for (; i + 16 <= d; i += 16) {
        v16f a;
        memcpy(&a, acc + i, 64);
        for (int64_t o = 0; o < n; o++) {
            v16f r;
            memcpy(&r, rows + o * stride + i, 64);
            a += p[o] * r;
        }
        memcpy(acc + i, &a, 64);
    }
    for (; i < d; i++)
        for (int64_t o = 0; o < n; o++) acc[i] += p[o] * rows[o * stride + i];
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

/* One sequence, kvh kv heads from kbase/vbase on (all of them, or one part when there are
 * few sequences for the threads): each block of its cache is read once for these heads
 * (whole contiguous [BS, KVH, D] spans in the engine's layout when they are all). */
static void one_sequence(const float *restrict q, float *restrict out, const void *kbase,
                         const void *vbase, int64_t s_n, int64_t s_b, int64_t s_h, int bf16,
                         int64_t bs, int64_t kvh, int64_t heads, int64_t d,
                         const int32_t *restrict blocks, int64_t len, float scale,
                         int64_t window, float soft_cap, int lanes, float *restrict work) {
    const int64_t g_count = heads / kvh, row = kvh * d; /* floats per token in `rows` */
    float *logits = work;                 /* [H, CHUNK] */
    float *acc = logits + heads * CHUNK;  /* [H, D] */
    float *mx = acc + heads * d;          /* [H] */
    float *sum = mx + heads;              /* [H] */
    float *rows = sum + heads;            /* [BS, KVH, D] */
    int64_t lo = window > 0 && len > window ? len - window : 0;
    for (int64_t hq = 0; hq < heads; hq++) {
        mx[hq] = -INFINITY;
        sum[hq] = 0.0f;
    }
    memset(acc, 0, (size_t)(heads * d) * sizeof(float));
    for (int64_t n0 = 0; n0 < len; n0 += CHUNK) {
        int64_t cb = len - n0 < CHUNK ? len - n0 : CHUNK;
        if (n0 + cb <= lo) continue; /* wholly outside the window: adds nothing */
        for (int64_t j = 0, take; j < cb; j += take) {
            int64_t pos = n0 + j, slot = pos % bs;
            take = bs - slot < cb - j ? bs - slot : cb - j;
            if (take * row > PIECE) take = PIECE / row > 0 ? PIECE / row : 1; /* stay in L1 */
            if (pos + take <= lo) {
                for (int64_t hq = 0; hq < heads; hq++)
                    for (int64_t o = 0; o < take; o++) logits[hq * CHUNK + j + o] = -INFINITY;
                continue;
            }
            if (j + take < cb && (pos + take) % bs == 0) /* the next block */
                prefetch_rows(kbase, slot_offset(blocks, pos + take, bs, s_n, s_b), bs, kvh,
                              s_b, s_h, d, bf16);
            load_rows(rows, kbase, slot_offset(blocks, pos, bs, s_n, s_b), take, kvh, s_b,
                      s_h, d, bf16);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *qh = q + hq * d, *kr = rows + (hq / g_count) * d;
                float *lg = logits + hq * CHUNK + j;
                for (int64_t o = 0; o < take; o++) {
                    float x = dot(qh, kr + o * row, d) * scale;
                    if (soft_cap > 0.0f) x = tanhf(x / soft_cap) * soft_cap;
                    lg[o] = pos + o < lo ? -INFINITY : x;
                }
            }
        }
        for (int64_t hq = 0; hq < heads; hq++) {
            float *lg = logits + hq * CHUNK;
            float cmax = -INFINITY;
#pragma omp simd reduction(max : cmax)
            for (int64_t j = 0; j < cb; j++) cmax = lg[j] > cmax ? lg[j] : cmax;
            float tmax = mx[hq] > cmax ? mx[hq] : cmax;
            if (tmax == -INFINITY) {
                memset(lg, 0, (size_t)cb * sizeof(float));
                continue;
            }
            float csum = exp_chunk(lg, cb, tmax, lanes);
            if (bf16) round_bf16(lg, cb); /* P is bfloat16 in P @ V */
            float rescale = expf(mx[hq] - tmax);
            sum[hq] = csum + rescale * sum[hq];
            mx[hq] = tmax;
            if (n0 > 0) {
                float *ah = acc + hq * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ah[i] *= rescale;
            }
        }
        for (int64_t j = 0, take; j < cb; j += take) {
            int64_t pos = n0 + j, slot = pos % bs;
            take = bs - slot < cb - j ? bs - slot : cb - j;
            if (take * row > PIECE) take = PIECE / row > 0 ? PIECE / row : 1; /* stay in L1 */
            if (pos + take <= lo) continue;
            if (j + take < cb && (pos + take) % bs == 0) /* the next block */
                prefetch_rows(vbase, slot_offset(blocks, pos + take, bs, s_n, s_b), bs, kvh,
                              s_b, s_h, d, bf16);
            load_rows(rows, vbase, slot_offset(blocks, pos, bs, s_n, s_b), take, kvh, s_b,
                      s_h, d, bf16);
            for (int64_t hq = 0; hq < heads; hq++)
                weighted_rows(acc + hq * d, logits + hq * CHUNK + j, rows + (hq / g_count) * d,
                              take, row, d);
        }
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        float inv = 1.0f / (sum[hq] == 0.0f ? 1.0f : sum[hq]);
        float *oh = out + hq * d;
        const float *ah = acc + hq * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) oh[i] = ah[i] * inv;
    }
}

/* q/out: [S, H, D] float32 contiguous. Sequence s reads table row rows[s] (s when rows is
 * NULL) and has lens[s] keys. Caches: element (block, slot, head, i) at
 * base + block*s_n + slot*s_b + head*s_h + i, bfloat16 (bf16 != 0) or float32, with
 * num_blocks blocks. Returns 0; -1 for an unsupported layout, -2 when scratch memory ran
 * out, -3 when a sequence's table names a block outside the cache (nothing is read then). */
int epd_paged_decode(const float *q, float *out, int64_t num_seqs, int64_t num_heads,
                     int64_t head_dim, const void *kbase, const void *vbase, int64_t s_n,
                     int64_t s_b, int64_t s_h, int bf16, int64_t block_size, int64_t kv_heads,
                     int64_t num_blocks, const int32_t *table, int64_t table_stride,
                     const int32_t *rows, const int32_t *lens, float scale, int64_t window,
                     float soft_cap, int lanes, int threads) {
    if (kv_heads <= 0 || num_heads % kv_heads != 0 || (lanes != 0 && lanes != 8 && lanes != 16))
        return -1;
    int64_t work_floats = num_heads * (CHUNK + head_dim + 2) + block_size * kv_heads * head_dim;
    /* fewer sequences than threads: split each one's kv heads into parts (same numerics) */
    int64_t parts = 1, g_count = num_heads / kv_heads, elt = bf16 ? 2 : 4;
    if (threads > 1 && num_seqs < threads) {
        parts = (threads + num_seqs - 1) / num_seqs;
        parts = parts < kv_heads ? parts : kv_heads;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && num_seqs * parts > 1)
    {
        float *work = (float *)malloc((size_t)work_floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_seqs * parts; t++) {
            if (!work) {
#pragma omp atomic write
                failed = 2;
                continue;
            }
            int64_t s = t / parts, h0 = t % parts * kv_heads / parts;
            int64_t h1 = (t % parts + 1) * kv_heads / parts;
            int64_t r = rows ? rows[s] : s, qoff = (s * num_heads + h0 * g_count) * head_dim;
            const int32_t *blocks = table + r * table_stride;
            int bad = 0;
            for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; b++)
                bad |= blocks[b] < 0 || blocks[b] >= num_blocks;
            if (bad) {
#pragma omp atomic write
                failed = 3;
                continue;
            }
            one_sequence(q + qoff, out + qoff, (const char *)kbase + h0 * s_h * elt,
                         (const char *)vbase + h0 * s_h * elt, s_n, s_b, s_h, bf16, block_size,
                         h1 - h0, (h1 - h0) * g_count, head_dim, blocks, lens[s], scale, window,
                         soft_cap, lanes, work);
        }
        free(work);
    }
    return -failed;
}
