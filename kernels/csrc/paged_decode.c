/* Paged decode attention for CPUs: one query token per sequence, KV read in place.
 *
 * Built at first use by epdserve/kernels/native.py with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off -fno-strict-aliasing), called via ctypes.
 *
 * Each sequence is one task: it walks its blocks straight from the paged cache (no gather,
 * no padding), reading each block once for all heads: logits of every query head against
 * its kv head (GQA), softmax, then the weighted sum of V, all in float32. Logits are
 * computed 16 keys at a time (one accumulator vector per key, then a transposing tree of
 * adds: no horizontal sum per key); P @ V keeps four heads' accumulators in registers.
 * bfloat16 caches in the engine's layout (head size a multiple of 32) are read in place: a
 * 64-byte load is 32 values, split into the even and the odd ones as float32 by a shift and
 * a mask (bf16_split); other caches are converted to float32 rows at most 32 KiB at a time.
 * On a CPU with AVX512_BF16 a bfloat16 query's logits take vdpbf16ps instead (two exact
 * products per lane, K read as pairs), and so does P @ V when the heads go four at a time
 * (two V rows interleaved by unpacklo/hi, the earlier row in the half vdpbf16ps adds first, so
 * rows are still added in order and the products are exact as before; only denormals, read
 * as 0, differ). One thread, per call: 1.2-1.6x faster than the split (docs/performance.md).
 * Blocks larger than a 4 KiB page are prefetched one block ahead. Sequences are spread over
 * `threads` OpenMP threads (torch's runtime: the library needs libgomp.so.1, which torch has
 * already loaded); with fewer sequences than threads, each sequence's kv heads are split
 * into parts.
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

#include "cpu_simd.h"      /* v16f, bits_to_f32, hsum16 */
#include "flash_softmax.h" /* fexp, exp_chunk, round_bf16 */

#define CHUNK 512
#define PIECE 8192 /* floats of converted rows at a time (32 KiB) */

/* element offset of token `pos` (head 0) through the sequence's block table */
static inline int64_t slot_offset(const int32_t *blocks, int64_t pos, int64_t bs, int64_t s_n,
                                  int64_t s_b) {
    return (int64_t)blocks[pos / bs] * s_n + (pos % bs) * s_b;
}

/* n token slots x kvh heads (strides s_b, s_h elements; d elements each) from base + off
 * into buf[n][kvh][d] as float32 */
static inline void load_rows(float *restrict buf, const void *base, int64_t off, int64_t n,
                             int64_t kvh, int64_t s_b, int64_t s_h, int64_t d, int bf16) {
    if (bf16 && s_h == d && s_b == kvh * d) { /* the engine's layout: one contiguous span */
        const uint16_t *src = (const uint16_t *)base + off;
        uint32_t *bits = (uint32_t *)buf;
        int64_t total = n * kvh * d;
#pragma omp simd
        for (int64_t i = 0; i < total; i++) bits[i] = (uint32_t)src[i] << 16;
        return;
    }
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

/* the 16 lane sums of a[i] * b[i] over the first 16 * floor(d / 16) elements */
static inline v16f lanes_dot(const float *restrict a, const float *restrict b, int64_t d) {
    v16f acc = {0};
    for (int64_t i = 0; i + 16 <= d; i += 16) {
        v16f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    return acc;
}

/* sum of a[i] * b[i]: 16 partial sums folded as a tree, then the tail (any order will do) */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float sum = hsum16(lanes_dot(a, b, d));
    for (int64_t i = 16 * (d / 16); i < d; i++) sum += a[i] * b[i];
    return sum;
}

/* out[l] = the sum of acc[bitrev4(l)]'s lanes: a transposing tree; each level adds the two
 * halves of every row's lanes and packs two rows into one vector, so no horizontal sums */
static inline void transpose_sum16(const v16f acc[16], float *restrict out) {
    v16f l1[8], l2[4], l3[2];
    for (int k = 0; k < 8; k++)
        l1[k] = __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                        17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                        24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)
        l2[k] = __builtin_shufflevector(l1[2 * k], l1[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8,
                                        9, 10, 11, 24, 25, 26, 27) +
                __builtin_shufflevector(l1[2 * k], l1[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12,
                                        13, 14, 15, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)
        l3[k] = __builtin_shufflevector(l2[2 * k], l2[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8,
                                        9, 24, 25, 12, 13, 28, 29) +
                __builtin_shufflevector(l2[2 * k], l2[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                        11, 26, 27, 14, 15, 30, 31);
    v16f r = __builtin_shufflevector(l3[0], l3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                     28, 14, 30) +
             __builtin_shufflevector(l3[0], l3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                     29, 15, 31);
    memcpy(out, &r, sizeof r);
}

static const int rev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* logits of keys o, o + 16, ... below `take` by DOT16 (one of the dot16 variants), the head
 * size a constant where it is 32, 64 or 128 (the dot unrolls, no loop per row); the caller
 * does the keys left over */
#define DOT16_KEYS(DOT16, qh, kr, stride, d, take, o, lg)                                \
    do {                                                                             \
        if ((d) == 32)                                                               \
            for (; o + 16 <= take; o += 16) DOT16(qh, kr + o * stride, stride, 32, lg + o);  \
        else if ((d) == 64)                                                          \
            for (; o + 16 <= take; o += 16) DOT16(qh, kr + o * stride, stride, 64, lg + o);  \
        else if ((d) == 128)                                                         \
            for (; o + 16 <= take; o += 16) DOT16(qh, kr + o * stride, stride, 128, lg + o); \
        else                                                                         \
            for (; o + 16 <= take; o += 16) DOT16(qh, kr + o * stride, stride, d, lg + o);   \
    } while (0)

/* out[l] = a . rows[l * stride] for 16 rows, d % 16 == 0: one accumulator vector per row,
 * accumulator k taking row bitrev4(k), then transpose_sum16 (which puts it back in lane k) */
static inline void dot16(const float *restrict a, const float *restrict rows, int64_t stride,
                         int64_t d, float *restrict out) {
    v16f acc[16];
    for (int k = 0; k < 16; k++) acc[k] = lanes_dot(a, rows + rev4[k] * stride, d);
    transpose_sum16(acc, out);
}

/* bfloat16 read in place (the engine's layout, d % 32 == 0): 32 values are 16 32-bit words;
 * `w << 16` holds the even ones and `w & 0xffff0000` the odd ones, each as float32 — no
 * conversion buffer, no shuffles. Dot products do not care about the order; P @ V keeps its
 * accumulators in this (even, odd) order per 32 elements and puts them back at the end. */
static inline void bf16_split(const uint16_t *p, v16f *even, v16f *odd) {
    v16u w;
    memcpy(&w, p, 64);
    *even = (v16f)(w << 16);
    *odd = (v16f)(w & 0xFFFF0000u);
}

/* the 16 lane sums of qp . r over d bfloat16 values (qp: the query in (even, odd) order per
 * 32) */
static inline v16f lanes_dot_bf16(const float *restrict qp, const uint16_t *restrict r,
                                  int64_t d) {
    v16f s = {0};
    for (int64_t i = 0; i < d; i += 32) {
        v16f qe, qo, e, o;
        memcpy(&qe, qp + i, 64);
        memcpy(&qo, qp + i + 16, 64);
        bf16_split(r + i, &e, &o);
        s += qe * e;
        s += qo * o;
    }
    return s;
}

/* dot16 on bfloat16 rows */
static inline void dot16_bf16(const float *restrict qp, const uint16_t *restrict rows,
                              int64_t stride, int64_t d, float *restrict out) {
    v16f acc[16];
    for (int k = 0; k < 16; k++) acc[k] = lanes_dot_bf16(qp, rows + rev4[k] * stride, d);
    transpose_sum16(acc, out);
}

static inline float dot_bf16(const float *restrict qp, const uint16_t *restrict r, int64_t d) {
    return hsum16(lanes_dot_bf16(qp, r, d));
}

#ifdef __AVX512BF16__
#include <immintrin.h>
#define HAVE_DP 1
/* the 16 lane sums of qb . r over d bfloat16 values, both read as pairs (qb: the query as
 * bfloat16, in order): vdpbf16ps adds two exact products per lane (denormals read as 0) */
static inline v16f lanes_dot_dp(const uint16_t *restrict qb, const uint16_t *restrict r,
                                int64_t d) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qb + i),
                             (__m512bh)_mm512_loadu_si512(r + i));
    return (v16f)s;
}

/* dot16 with vdpbf16ps */
static inline void dot16_dp(const uint16_t *restrict qb, const uint16_t *restrict rows,
                            int64_t stride, int64_t d, float *restrict out) {
    v16f acc[16];
    for (int k = 0; k < 16; k++) acc[k] = lanes_dot_dp(qb, rows + rev4[k] * stride, d);
    transpose_sum16(acc, out);
}

/* weighted_rows4 on bfloat16 rows by vdpbf16ps, d % 32 == 0: rows o and o + 1 are
 * interleaved per element by unpacklo/hi (row o in the odd half, which vdpbf16ps adds first,
 * so rows are still added in order; the products are exact, as in the split path) and
 * weighted by the pair (p[o], p[o + 1]). Accumulators per 32 elements in unpack order: lane
 * 4l + m of the first vector is element 8l + m, of the second 8l + 4 + m (dp_unorder). */
static inline void weighted_rows4_dp(float *restrict acc, const float *restrict p,
                                     int64_t p_stride, const uint16_t *const rows[4], int64_t n,
                                     int64_t stride, int64_t d) {
    const uint32_t *pb = (const uint32_t *)p; /* probabilities already rounded to bfloat16 */
    for (int64_t i = 0; i < d; i += 32) {
        __m512 a[4][2];
        for (int t = 0; t < 4; t++) {
            a[t][0] = _mm512_loadu_ps(acc + t * d + i);
            a[t][1] = _mm512_loadu_ps(acc + t * d + i + 16);
        }
        for (int64_t o = 0; o < n; o += 2)
            for (int t = 0; t < 4; t++) {
                __m512i r0 = _mm512_loadu_si512(rows[t] + o * stride + i);
                __m512i r1 = o + 1 < n ? _mm512_loadu_si512(rows[t] + (o + 1) * stride + i)
                                       : _mm512_setzero_si512();
                uint32_t w0 = pb[t * p_stride + o] & 0xFFFF0000u;
                uint32_t w1 = o + 1 < n ? pb[t * p_stride + o + 1] >> 16 : 0;
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)(w0 | w1));
                a[t][0] = _mm512_dpbf16_ps(a[t][0], (__m512bh)_mm512_unpacklo_epi16(r1, r0), w);
                a[t][1] = _mm512_dpbf16_ps(a[t][1], (__m512bh)_mm512_unpackhi_epi16(r1, r0), w);
            }
        for (int t = 0; t < 4; t++) {
            _mm512_storeu_ps(acc + t * d + i, a[t][0]);
            _mm512_storeu_ps(acc + t * d + i + 16, a[t][1]);
        }
    }
}

/* out[i] = acc[...] * inv for one head, from weighted_rows4_dp's order */
static inline void dp_unorder(float *restrict out, const float *restrict acc, int64_t d,
                              float inv) {
    for (int64_t i = 0; i < d; i += 32)
        for (int l = 0; l < 4; l++)
            for (int m = 0; m < 4; m++) {
                out[i + 8 * l + m] = acc[i + 4 * l + m] * inv;
                out[i + 8 * l + 4 + m] = acc[i + 16 + 4 * l + m] * inv;
            }
}
#else
#define HAVE_DP 0
#endif

/* blocks are scattered, so the hardware cannot guess the next one: ask for its n rows early
 * (kvh heads of d bfloat16 values each) */
static inline void prefetch_rows_bf16(const uint16_t *p, int64_t n, int64_t kvh, int64_t s_b,
                                      int64_t s_h, int64_t d) {
    for (int64_t o = 0; o < n; o++)
        for (int64_t h = 0; h < kvh; h++)
            for (int64_t b = 0; b < d; b += 32) __builtin_prefetch(p + o * s_b + h * s_h + b);
}

static inline void weighted_rows_bf16(float *restrict acc, const float *restrict p,
                                      const uint16_t *restrict rows, int64_t n, int64_t stride,
                                      int64_t d) {
    for (int64_t i = 0; i < d; i += 32) {
        v16f a0, a1;
        memcpy(&a0, acc + i, 64);
        memcpy(&a1, acc + i + 16, 64);
        for (int64_t o = 0; o < n; o++) {
            v16f e, od;
            bf16_split(rows + o * stride + i, &e, &od);
            a0 += p[o] * e;
            a1 += p[o] * od;
        }
        memcpy(acc + i, &a0, 64);
        memcpy(acc + i + 16, &a1, 64);
    }
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

/* 32 values of a row as two float32 vectors: in place, (even, odd) for bfloat16 (bf16_split),
 * else the two halves */
static inline void load32(const void *row, int bf16, v16f *lo, v16f *hi) {
    if (bf16) {
        bf16_split(row, lo, hi);
    } else {
        memcpy(lo, row, 64);
        memcpy(hi, (const float *)row + 16, 64);
    }
}

/* weighted_rows for four heads at once, d % 32 == 0: head t adds p[t * p_stride + o] times
 * row o of rows[t] (`stride` elements apart; float32 rows, or bfloat16 read in place with
 * the accumulators in (even, odd) order per 32) into acc + t * d. Eight accumulator vectors
 * in flight (a single head of 32 has two, each waiting on its previous add); per element the
 * rows are still added in order. */
static inline void weighted_rows4(float *restrict acc, const float *restrict p, int64_t p_stride,
                                  const void *const rows[4], int64_t n, int64_t stride,
                                  int64_t d, int bf16) {
    int64_t elt = bf16 ? 2 : 4;
    for (int64_t i = 0; i < d; i += 32) {
        v16f a[4][2];
        for (int t = 0; t < 4; t++) {
            memcpy(&a[t][0], acc + t * d + i, 64);
            memcpy(&a[t][1], acc + t * d + i + 16, 64);
        }
        for (int64_t o = 0; o < n; o++)
            for (int t = 0; t < 4; t++) {
                v16f r0, r1;
                load32((const char *)rows[t] + (o * stride + i) * elt, bf16, &r0, &r1);
                float w = p[t * p_stride + o];
                a[t][0] += w * r0;
                a[t][1] += w * r1;
            }
        for (int t = 0; t < 4; t++) {
            memcpy(acc + t * d + i, &a[t][0], 64);
            memcpy(acc + t * d + i + 16, &a[t][1], 64);
        }
    }
}

/* logits of `take` keys from position pos on: scaled, soft-capped, and -inf before lo */
static inline void finish_logits(float *restrict lg, int64_t take, int64_t pos, int64_t lo,
                                 float scale, float soft_cap) {
    for (int64_t o = 0; o < take; o++) {
        float x = lg[o] * scale;
        if (soft_cap > 0.0f) x = tanhf(x / soft_cap) * soft_cap;
        lg[o] = pos + o < lo ? -INFINITY : x;
    }
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
    float *qp = sum + heads;              /* [H, D]: q in (even, odd) order (direct) */
    float *rows = qp + heads * d;         /* [BS, KVH, D] */
    int64_t lo = window > 0 && len > window ? len - window : 0;
    /* bfloat16 read in place (bf16_split); else rows are converted into `rows` */
    const int direct = bf16 && d % 32 == 0;
    const uint16_t *kb16 = kbase, *vb16 = vbase;
    /* blocks of one 4 KiB page or less: the hardware keeps up (asking costs more than it saves) */
    const int prefetch = bs * kvh * d * 2 > 4096;
    /* vdpbf16ps where the CPU has it and the query is bfloat16-exact (a bfloat16 model's
     * query always is): two exact products per lane; else (even, odd) float32 FMAs */
    const uint32_t *qbits = (const uint32_t *)q; /* built with -fno-strict-aliasing */
    int dp = HAVE_DP && direct;
    for (int64_t i = 0; dp && i < heads * d; i++) dp = (qbits[i] & 0xFFFFu) == 0;
    /* P @ V by vdpbf16ps too (bfloat16 P and V: exact products, rows still in order) when
     * every head goes four at a time */
    const int pv_dp = HAVE_DP && direct && heads % 4 == 0;
    uint16_t *qb = (uint16_t *)qp; /* [H, D] bfloat16 (dp), in qp's room */
    if (dp)
        for (int64_t i = 0; i < heads * d; i++) qb[i] = (uint16_t)(qbits[i] >> 16);
    else if (direct)
        for (int64_t i = 0; i < heads * d; i += 32)
            for (int64_t j = 0; j < 16; j++) {
                qp[i + j] = q[i + 2 * j];
                qp[i + 16 + j] = q[i + 2 * j + 1];
            }
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
            if (!direct && take * row > PIECE) /* converted rows stay in L1 */
                take = PIECE / row > 0 ? PIECE / row : 1;
            if (pos + take <= lo) {
                for (int64_t hq = 0; hq < heads; hq++)
                    for (int64_t o = 0; o < take; o++) logits[hq * CHUNK + j + o] = -INFINITY;
                continue;
            }
            if (direct) {
                const uint16_t *kp = kb16 + slot_offset(blocks, pos, bs, s_n, s_b);
                if (prefetch && j + take < cb && (pos + take) % bs == 0) /* the next block */
                    prefetch_rows_bf16(kb16 + slot_offset(blocks, pos + take, bs, s_n, s_b), bs,
                                       kvh, s_b, s_h, d);
                for (int64_t hq = 0; hq < heads; hq++) {
                    const float *qh = qp + hq * d;
                    const uint16_t *kr = kp + (hq / g_count) * s_h;
                    float *lg = logits + hq * CHUNK + j;
                    int64_t o = 0;
#if HAVE_DP
                    if (dp) {
                        const uint16_t *qbh = qb + hq * d;
                        DOT16_KEYS(dot16_dp, qbh, kr, s_b, d, take, o, lg);
                        for (; o < take; o++) lg[o] = hsum16(lanes_dot_dp(qbh, kr + o * s_b, d));
                    } else
#endif
                    {
                        DOT16_KEYS(dot16_bf16, qh, kr, s_b, d, take, o, lg);
                        for (; o < take; o++) lg[o] = dot_bf16(qh, kr + o * s_b, d);
                    }
                    finish_logits(lg, take, pos, lo, scale, soft_cap);
                }
                continue;
            }
            load_rows(rows, kbase, slot_offset(blocks, pos, bs, s_n, s_b), take, kvh, s_b,
                      s_h, d, bf16);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *qh = q + hq * d, *kr = rows + (hq / g_count) * d;
                float *lg = logits + hq * CHUNK + j;
                int64_t o = 0;
                if (d % 16 == 0) DOT16_KEYS(dot16, qh, kr, row, d, take, o, lg);
                for (; o < take; o++) lg[o] = dot(qh, kr + o * row, d);
                finish_logits(lg, take, pos, lo, scale, soft_cap);
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
            float csum = exp_chunk(lg, cb, cb, tmax, lanes);
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
            if (!direct && take * row > PIECE) /* converted rows stay in L1 */
                take = PIECE / row > 0 ? PIECE / row : 1;
            if (pos + take <= lo) continue;
            int64_t hq = 0;
            if (direct) {
                const uint16_t *vp = vb16 + slot_offset(blocks, pos, bs, s_n, s_b);
                if (prefetch && j + take < cb && (pos + take) % bs == 0)
                    prefetch_rows_bf16(vb16 + slot_offset(blocks, pos + take, bs, s_n, s_b), bs,
                                       kvh, s_b, s_h, d);
#if HAVE_DP
                if (pv_dp) {
                    for (; hq < heads; hq += 4) {
                        const uint16_t *const r4[4] = {
                            vp + (hq / g_count) * s_h, vp + ((hq + 1) / g_count) * s_h,
                            vp + ((hq + 2) / g_count) * s_h, vp + ((hq + 3) / g_count) * s_h};
                        weighted_rows4_dp(acc + hq * d, logits + hq * CHUNK + j, CHUNK, r4,
                                          take, s_b, d);
                    }
                    continue;
                }
#endif
                for (; hq + 4 <= heads; hq += 4) {
                    const void *const r4[4] = {
                        vp + (hq / g_count) * s_h, vp + ((hq + 1) / g_count) * s_h,
                        vp + ((hq + 2) / g_count) * s_h, vp + ((hq + 3) / g_count) * s_h};
                    weighted_rows4(acc + hq * d, logits + hq * CHUNK + j, CHUNK, r4, take, s_b,
                                   d, 1);
                }
                for (; hq < heads; hq++)
                    weighted_rows_bf16(acc + hq * d, logits + hq * CHUNK + j,
                                       vp + (hq / g_count) * s_h, take, s_b, d);
                continue;
            }
            load_rows(rows, vbase, slot_offset(blocks, pos, bs, s_n, s_b), take, kvh, s_b,
                      s_h, d, bf16);
            if (d % 32 == 0)
                for (; hq + 4 <= heads; hq += 4) {
                    const void *const r4[4] = {
                        rows + (hq / g_count) * d, rows + ((hq + 1) / g_count) * d,
                        rows + ((hq + 2) / g_count) * d, rows + ((hq + 3) / g_count) * d};
                    weighted_rows4(acc + hq * d, logits + hq * CHUNK + j, CHUNK, r4, take, row,
                                   d, 0);
                }
            for (; hq < heads; hq++)
                weighted_rows(acc + hq * d, logits + hq * CHUNK + j, rows + (hq / g_count) * d,
                              take, row, d);
        }
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        float inv = 1.0f / (sum[hq] == 0.0f ? 1.0f : sum[hq]);
        float *oh = out + hq * d;
        const float *ah = acc + hq * d;
#if HAVE_DP
        if (pv_dp) {
            dp_unorder(oh, ah, d, inv);
            continue;
        }
#endif
        if (direct) /* back from (even, odd) order */
            for (int64_t i = 0; i < d; i += 32)
                for (int64_t j = 0; j < 16; j++) {
                    oh[i + 2 * j] = ah[i + j] * inv;
                    oh[i + 2 * j + 1] = ah[i + 16 + j] * inv;
                }
        else
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
    int64_t work_floats =
        num_heads * (CHUNK + 2 * head_dim + 2) + block_size * kv_heads * head_dim;
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
