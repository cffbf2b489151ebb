/* LoRA delta for CPUs, many adapters in one batch: for each token t whose slot
 * s = slots[t] is not -1,  y[t] += round(B[s] @ (scaling[s] * (A[s] @ x[t]))).
 *
 * Numerics of the torch twin (epdserve/kernels/lora_ref.py): shrink and expand in float32,
 * the delta rounded to y's dtype, then one add in y's dtype. Sums run in another order
 * than torch's GEMM (16 lanes, then a tree; FMA), so float32 results agree to rounding.
 * With bfloat16 x and A on a CPU with AVX512-BF16 the shrink uses its dot product
 * (shrink_dpbf16: exact products, float32 sums, denormals flushed).
 *
 * Each thread takes a contiguous range of tokens and handles it slot by slot: B[s] is
 * transposed to float32 once per (thread, slot), then the slot's rows (in any order) go
 * through in groups of GROUP, each row of A[s] and of B[s]^T loaded once per group. B is
 * not transposed when its memory is already [S, r, out] (a transposed view: read in place),
 * nor for a slot with at most GROUP rows and a rank that is a multiple of 16 (read by rows,
 * 16 dot products reduced at once: cheaper than the transposition at decode sizes).
 * Called via ctypes (epdserve/kernels/lora.py); built with the other C kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#include "lora_simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 4
typedef struct {
    void *y;
    const void *x, *a, *b; /* b: B [S, out, r] with strides b_ss, b_so, b_sk (elements) */
    const int32_t *slots;
    const float *scaling;
    int64_t y_stride, x_stride, tokens, num_slots, rank, in_dim, out_dim, b_ss, b_so, b_sk;
    int act_bf16, w_bf16;
} Args;

/* h[j][k] = scaling * (x_j . a_k) for GROUP float32 rows (pointers may repeat) and
 * k < rank, two rows of A per sweep over x (an odd rank does its last row twice) */
static inline __attribute__((always_inline)) void shrink(const Args *p, const float **xs,
                                                         const void *a, float sc, float *h,
                                                         int wb) {
    int64_t in = p->in_dim, r = p->rank, vec = in & ~(int64_t)15;
    for (int64_t k0 = 0; k0 < r; k0 += 2) {
        int64_t ks[2] = {k0, k0 + 1 < r ? k0 + 1 : k0};
        v16f acc[2][GROUP] = {{{0}}};
        for (int64_t i = 0; i < vec; i += 16) {
            v16f w0 = load16(a, ks[0] * in + i, wb), w1 = load16(a, ks[1] * in + i, wb);
            for (int j = 0; j < GROUP; j++) {
                v16f xv;
                memcpy(&xv, xs[j] + i, 64);
                acc[0][j] = fma16(xv, w0, acc[0][j]);
                acc[1][j] = fma16(xv, w1, acc[1][j]);
            }
        }
        for (int c = 0; c < 2; c++)
            for (int j = 0; j < GROUP; j++) {
                float tail = 0.0f;
                for (int64_t i = vec; i < in; i++)
                    tail = __builtin_fmaf(xs[j][i], load1(a, ks[c] * in + i, wb), tail);
                h[j * r + ks[c]] = (hsum16(acc[c][j]) + tail) * sc;
            }
    }
}

/* B[s] as the expand reads it, bfloat16 or float32: B^T [rank, out] with rows `ld` elements
 * apart, or (rows != 0) B's own rows [out, rank], `ld` apart, k contiguous */
typedef struct {
    const void *p;
    int64_t ld;
    int bf16, rows;
} Bt;

/* y_j += round(h_j @ bt) for the first g rows */
static inline __attribute__((always_inline)) void expand_t(const Args *p, void **ys, int g,
                                                           const float *h, Bt bt, int wb) {
    int64_t out = p->out_dim, r = p->rank, vec = out & ~(int64_t)15;
    for (int64_t o = 0; o < vec; o += 16) {
        v16f acc[GROUP] = {{0}};
        for (int64_t k = 0; k < r; k++) {
            v16f b = load16(bt.p, k * bt.ld + o, wb);
            for (int j = 0; j < GROUP; j++) acc[j] = fma16(splat16(h[j * r + k]), b, acc[j]);
        }
        for (int j = 0; j < g; j++) add16(ys[j], o, acc[j], p->act_bf16);
    }
    for (int64_t o = vec; o < out; o++)
        for (int j = 0; j < g; j++) {
            float d = 0.0f;
            for (int64_t k = 0; k < r; k++)
                d = __builtin_fmaf(h[j * r + k], load1(bt.p, k * bt.ld + o, wb), d);
            add1(ys[j], o, d, p->act_bf16);
        }
}

/* sum_k B[o, k] h[k] as 16 lanes (r a multiple of 16, k contiguous) */
static inline __attribute__((always_inline)) v16f dot_row(const void *b, int64_t off,
                                                          const float *h, int64_t r, int wb) {
    v16f acc = {0};
    for (int64_t k = 0; k < r; k += 16) {
        v16f hv;
        memcpy(&hv, h + k, 64);
        acc = fma16(load16(b, off + k, wb), hv, acc);
    }
    return acc;
}

/* the same from B's rows (rank r a multiple of 16): 16 outputs' dot products at a time,
 * reduced together; for a slot with a few rows, where transposing B would cost more */
static inline __attribute__((always_inline)) void expand_rows_t(const Args *p, void **ys, int g,
                                                                const float *h, Bt bt, int64_t r,
                                                                int wb) {
    int64_t out = p->out_dim, vec = out & ~(int64_t)15;
    for (int j = 0; j < g; j++) {
        const float *hj = h + j * r;
        for (int64_t o0 = 0; o0 < vec; o0 += 16) {
            v16f v[16];
            for (int i = 0; i < 16; i++) v[i] = dot_row(bt.p, (o0 + i) * bt.ld, hj, r, wb);
            add16(ys[j], o0, reduce16x16(v), p->act_bf16);
        }
        for (int64_t o = vec; o < out; o++)
            add1(ys[j], o, hsum16(dot_row(bt.p, o * bt.ld, hj, r, wb)), p->act_bf16);
    }
}

static void expand(const Args *p, void **ys, int g, const float *h, Bt bt) {
    if (bt.rows && p->rank == 16) /* the default rank: one vector per row of B */
        bt.bf16 ? expand_rows_t(p, ys, g, h, bt, 16, 1) : expand_rows_t(p, ys, g, h, bt, 16, 0);
    else if (bt.rows)
        bt.bf16 ? expand_rows_t(p, ys, g, h, bt, p->rank, 1)
                : expand_rows_t(p, ys, g, h, bt, p->rank, 0);
    else
        bt.bf16 ? expand_t(p, ys, g, h, bt, 1) : expand_t(p, ys, g, h, bt, 0);
}

/* rows[0..g-1] of slot s (g <= GROUP); xf: GROUP * in floats for bfloat16 rows widened */
static void run_group(const Args *p, int64_t s, const int64_t *rows, int g, Bt bt, float *h,
                      float *xf) {
    const float *xs[GROUP];
    void *ys[GROUP];
    int64_t in = p->in_dim, asz = p->act_bf16 ? 2 : 4, wsz = p->w_bf16 ? 2 : 4;
    const void *a = (const char *)p->a + s * p->rank * in * wsz;
#ifdef __AVX512BF16__
    if (p->act_bf16 && p->w_bf16) { /* bfloat16 dot products straight from x's rows */
        const uint16_t *xr[GROUP];
        for (int j = 0; j < GROUP; j++) { /* padding rows repeat the last, as below */
            int64_t t = rows[j < g ? j : g - 1];
            xr[j] = (const uint16_t *)p->x + t * p->x_stride;
            ys[j] = (uint16_t *)p->y + t * p->y_stride;
        }
        shrink_dpbf16(xr, GROUP, a, p->rank, in, p->scaling[s], h);
        expand(p, ys, g, h, bt);
        return;
    }
#endif
    for (int j = 0; j < GROUP; j++) {
        if (j >= g) { /* padding rows repeat the last: computed, never stored */
            xs[j] = xs[g - 1], ys[j] = ys[g - 1];
            continue;
        }
        const char *row = (const char *)p->x + rows[j] * p->x_stride * asz;
        ys[j] = (char *)p->y + rows[j] * p->y_stride * asz;
        if (p->act_bf16) {
            float *dst = xf + j * in;
            for (int64_t i = 0; i < in; i++) dst[i] = load1(row, i, 1);
            xs[j] = dst;
        } else {
            xs[j] = (const float *)row;
        }
    }
    if (p->w_bf16)
        shrink(p, xs, a, p->scaling[s], h, 1);
    else
        shrink(p, xs, a, p->scaling[s], h, 0);
    expand(p, ys, g, h, bt);
}

/* bt [r, out] float32 = B^T, B [out, r] with strides so, sk: 16 outputs at a time, so each
 * small tile of B stays in L1 while its columns become rows of bt */
static void transpose_b(float *restrict bt, const void *b, int64_t out, int64_t r, int64_t so,
                        int64_t sk, int bf16) {
    int64_t o0 = 0;
    for (; o0 + 16 <= out; o0 += 16)
        for (int64_t k = 0; k < r; k++) {
            float col[16];
            if (bf16) {
                const uint16_t *src = (const uint16_t *)b + o0 * so + k * sk;
                for (int i = 0; i < 16; i++) col[i] = bits_to_f32((uint32_t)src[i * so] << 16);
            } else {
                const float *src = (const float *)b + o0 * so + k * sk;
                for (int i = 0; i < 16; i++) col[i] = src[i * so];
            }
            memcpy(bt + k * out + o0, col, sizeof col);
        }
    for (int64_t o = o0; o < out; o++)
        for (int64_t k = 0; k < r; k++) bt[k * out + o] = load1(b, o * so + k * sk, bf16);
}

static inline int64_t up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* whether slot s has at most GROUP tokens in start..t1-1 */
static int few_rows(const int32_t *slots, int64_t start, int64_t t1, int32_t s) {
    int n = 0;
    for (int64_t t = start; t < t1 && n <= GROUP; t++) n += slots[t] == s;
    return n <= GROUP;
}

static int seen(const int32_t *done, int n, int32_t s) {
    for (int i = 0; i < n; i++)
        if (done[i] == s) return 1;
    return 0;
}

/* tokens t0..t1-1, one pass per distinct slot (first occurrences in order): a pass starting
 * at `start` does every token of its slot, none of which lies before `start`.
 * scratch: bt [rank*out], h [GROUP*rank], xf [GROUP*in] floats, then the done slots
 * (<= num_slots+1 ints) */
static void run_range(const Args *p, int64_t t0, int64_t t1, float *scratch) {
    int64_t r = p->rank, out = p->out_dim, wsz = p->w_bf16 ? 2 : 4;
    /* each region starts on a cache line: a vector load never spans two */
    float *bt = scratch, *h = bt + up16(r * out), *xf = h + up16(GROUP * r);
    int32_t *done = (int32_t *)(xf + up16(GROUP * p->in_dim));
    int nd = 0;
    for (int64_t start = t0, next; start < t1; start = next) {
        int32_t s = p->slots[start];
        int64_t rows[GROUP];
        int g = 0;
        done[nd++] = s;
        next = t1;
        Bt bts = {bt, out, 0, 0};
        if (s >= 0) {
            const void *b = (const char *)p->b + s * p->b_ss * wsz;
            if (p->b_so == 1) /* B stored transposed ([S, r, out] memory): used in place */
                bts = (Bt){b, p->b_sk, p->w_bf16, 0};
            else if (p->b_sk == 1 && r % 16 == 0 && few_rows(p->slots, start, t1, s))
                bts = (Bt){b, p->b_so, p->w_bf16, 1};
            else
                transpose_b(bt, b, out, r, p->b_so, p->b_sk, p->w_bf16);
        }
        for (int64_t t = start; t < t1; t++) {
            int32_t st = p->slots[t];
            if (st != s) {
                if (next == t1 && !seen(done, nd, st)) next = t;
            } else if (s >= 0) {
                rows[g++] = t;
                if (g == GROUP) run_group(p, s, rows, g, bts, h, xf), g = 0;
            }
        }
        if (g) run_group(p, s, rows, g, bts, h, xf);
    }
}

/* Returns 0; -1 (nothing written) when a slot is outside -1..num_slots-1; -2 without
 * memory for the scratch. `threads` OpenMP threads split the tokens when the work is large. */
int epd_lora_apply(void *y, int64_t y_stride, const void *x, int64_t x_stride,
                   const int32_t *slots, int64_t tokens, const void *a, const void *b,
                   int64_t b_ss, int64_t b_so, int64_t b_sk, const float *scaling,
                   int64_t num_slots, int64_t rank, int64_t in_dim, int64_t out_dim,
                   int act_bf16, int w_bf16, int threads) {
    int64_t active = 0;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
        active += slots[t] >= 0;
    }
    if (!active || !rank) return 0;
    Args p = {.y = y, .x = x, .a = a, .b = b, .slots = slots, .scaling = scaling,
              .y_stride = y_stride, .x_stride = x_stride, .tokens = tokens,
              .num_slots = num_slots, .rank = rank, .in_dim = in_dim, .out_dim = out_dim,
              .b_ss = b_ss, .b_so = b_so, .b_sk = b_sk, .act_bf16 = act_bf16, .w_bf16 = w_bf16};
    int64_t work = active * rank * (in_dim + out_dim);
    int n = work < (1 << 20) ? 1 : threads < 1 ? 1 : threads;
    if (n > tokens) n = (int)tokens;
    size_t floats = (size_t)(up16(rank * out_dim) + up16(GROUP * rank) + up16(GROUP * in_dim) +
                             up16(num_slots + 1));
    int failed = 0;
#pragma omp parallel num_threads(n) if (n > 1) reduction(| : failed)
    {
        static _Thread_local float *buf;
        static _Thread_local size_t cap;
        int id = 0, nt = 1;
#ifdef _OPENMP
        id = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        if (cap < floats) {
            free(buf);
            buf = aligned_alloc(64, floats * sizeof(float)); /* a multiple of 64 bytes */
            cap = buf ? floats : 0;
        }
        if (!buf) {
            failed = 1;
        } else {
            int64_t per = (tokens + nt - 1) / nt, t0 = id * per;
            int64_t t1 = t0 + per < tokens ? t0 + per : tokens;
            if (t0 < t1) run_range(&p, t0, t1, buf);
        }
    }
    return failed ? -2 : 0;
}
