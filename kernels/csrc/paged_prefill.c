/* Paged prefill attention for CPUs: every query span of a batch in one call, KV read in place.
 *
 * Built with its sibling paged_decode.c (one query token per sequence), same flags, by
 * epdserve/kernels/native_build.py; called via ctypes.
 *
 * Sequence s owns queries q_start[s] .. q_start[s] + q_lens[s] - 1, the LAST q_lens[s]
 * positions of its lens[s]-token context; they attend causally (a query at position p sees
 * keys <= p, and > p - window with a sliding window). Keys and values are read from the
 * paged cache through the sequence's block-table row, with any strides (the engine's
 * per-layer views of a cross-layer cache), bfloat16 or float32.
 *
 * Work item: (sequence, kv head, a run of up to MAX_ROWS / group query positions), its rows
 * being every (position, query head of the kv group) pair (GQA: K/V are repacked once for
 * all heads that read them). Items are spread over `threads` OpenMP threads (dynamic).
 * An item walks the keys it can see in chunks of CH = 512 from key 0 (the last one ctx - n0
 * long), repacks each chunk once (prefill_tiles.h), then every group of 4 rows that sees
 * any of its keys computes logits 64 keys at a time (outer products, 16 accumulator
 * vectors), takes its softmax step over the chunk and adds P @ V to its accumulators.
 *
 * Numerics: per row, torch's CPU flash kernel on a masked (not is_causal) SDPA, so bfloat16
 * spans agree with the torch twin bit for bit in ~99.9% of outputs (tests):
 *   - logits: float32 dot products (fused multiply-adds on AVX-512; bfloat16 caches on a
 *     CPU with AVX512_BF16: vdpbf16ps, two exact bfloat16 products per step, the query
 *     rounded to bfloat16 first, exact for a bfloat16 query), summed in any order, times
 *     `scale`, then soft_cap * tanhf(x / soft_cap) when soft_cap > 0; masked keys -inf;
 *   - softmax: online over chunks of 512 keys (the kv split): chunk max, then bfloat16:
 *     exp_chunk (flash_softmax.h: the fast exp in `lanes` partial sums, libm expf on the
 *     tail), float32: vexp16 (1-2 ulp) in 16 partial sums; running sum = chunk sum +
 *     expf(old max - new max) * sum, accumulators rescaled by the same factor;
 *   - bfloat16: the probabilities are rounded to bfloat16 before P @ V; float32: not;
 *   - P @ V: float32 accumulators, keys added in order (in pairs with vdpbf16ps, which
 *     reads denormals as 0); output = accumulator * (1 / sum), float32 (the caller rounds);
 *   - a row's result depends on its sequence alone: not on the batch, the items or threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#include "flash_softmax.h" /* exp_chunk, round_bf16 */
#include "prefill_tiles.h" /* layout_t, KT, CH, loading chunks, the 4-row x KT-key products */

#define MAX_ROWS 256 /* query rows (positions x heads of a kv group) per work item */

typedef struct {
    int32_t seq, head, first, count; /* kv head; queries first..first+count-1 of the span */
} item_t;

/* exp(row - mx) over n keys (a multiple of 16, -inf past the live ones): vexp16, 16 partial
 * sums folded in halves */
static inline float exp_f32(float *restrict row, int64_t n, float mx) {
    v16f acc = {0};
    for (int64_t j = 0; j < n; j += 16) {
        v16f x;
        memcpy(&x, row + j, 64);
        x = vexp16(x - mx);
        acc += x;
        memcpy(row + j, &x, 64);
    }
    return hsum16(acc);
}

/* One row's softmax step over chunk keys n0 .. n0 + need - 1 of a chunk of len keys, as the
 * flash kernel takes a row over a kv split: s (the raw logits, room for need rounded up to
 * 16) scaled, capped, masked; then the chunk max, exp and sum (exp_chunk over len keys, the
 * ones from need on being -inf), P rounded to bfloat16 (and packed into ph when dp), the
 * running max m, sum l and accumulator o rescaled. */
static void row_softmax(const layout_t *L, float *restrict s, int64_t len, int64_t need,
                        int64_t n0, int64_t pos, int masked, float *m, float *l,
                        float *restrict o, uint16_t *restrict ph) {
    const int64_t need16 = (need + 15) & ~15;
    const v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f ninf = splat16(-INFINITY);
    v16f mx = ninf;
    for (int64_t j = 0; j < need16; j += 16) {
        v16f x;
        memcpy(&x, s + j, 64);
        x *= L->scale;
        if (L->soft_cap > 0.0f)
            for (int e = 0; e < 16; e++) x[e] = tanhf(x[e] / L->soft_cap) * L->soft_cap;
        if (masked || j + 16 > need) {
            v16i k = iota + (int32_t)j; /* key n0 + k */
            v16i dead = (k >= (int32_t)need) | (k > (int32_t)(pos - n0));
            if (L->window > 0) dead |= k <= (int32_t)(pos - n0 - L->window);
            x = select16(dead, ninf, x);
        }
        memcpy(s + j, &x, 64);
        mx = select16(x > mx, x, mx);
    }
    float cmax = hmax16(mx), tmax = *m > cmax ? *m : cmax;
    if (tmax == -INFINITY) { /* nothing seen yet: P is 0 */
        memset(s, 0, (size_t)need16 * sizeof(float));
    } else {
        float csum = L->bf16 ? exp_chunk(s, len, need, tmax, L->lanes) : exp_f32(s, need16, tmax);
        for (int64_t j = need; j < need16; j++) s[j] = 0.0f; /* -inf left by exp_chunk */
        if (L->bf16) round_bf16(s, need16); /* P is bfloat16 in P @ V */
        float alpha = expf(*m - tmax);
        *l = csum + alpha * *l;
        *m = tmax;
        if (alpha != 1.0f)
            for (int64_t i = 0; i < L->d; i++) o[i] *= alpha;
    }
    if (L->dp) /* bfloat16 bits of the rounded probabilities */
        for (int64_t j = 0; j < need16; j++) {
            uint32_t b;
            memcpy(&b, s + j, 4);
            ph[j] = (uint16_t)(b >> 16);
        }
}

/* Four query rows (q[r] float32, qp[r] bfloat16 pairs when dp; positions pos[r]) against the
 * first `need` keys of a chunk of len keys from n0 (kt, vt: load_chunk or load_pairs):
 * logits, softmax step, and P @ V into o[4][d]. `masked`: some of those keys lie past a
 * row's position or before its window. s: [4][CH] float32, ph: [4][CH] bfloat16 scratch. */
static void row_group(const layout_t *L, const float *const q[4], const uint32_t *const qp[4],
                      const int64_t pos[4], int64_t n0, int64_t len, int64_t need, int masked,
                      const float *restrict kt, const float *restrict vt, float *restrict o,
                      float *restrict m, float *restrict l, float *restrict s,
                      uint16_t *restrict ph) {
    const int64_t d = L->d;
    for (int64_t t = 0; t < need; t += KT) {
#if HAVE_DP
        if (L->dp)
            qk_dp_4xKT(qp, (const uint32_t *)kt + t, d, s + t);
        else
#endif
            qk_4xKT(q, kt + t, d, s + t);
    }
    for (int r = 0; r < 4; r++)
        row_softmax(L, s + r * CH, len, need, n0, pos[r], masked, m + r, l + r, o + r * d,
                    ph + r * CH);
    int64_t c = 0;
#if HAVE_DP
    if (L->dp) {
        const uint32_t *pp = (const uint32_t *)ph, *vp = (const uint32_t *)vt;
        for (; c + 64 <= d; c += 64) pv_dp_4x4(pp, vp, (need + 1) / 2, d, c, o);
        for (; c + 32 <= d; c += 32) pv_dp_4x2(pp, vp, (need + 1) / 2, d, c, o);
        if (c < d) pv_dp_4x1(pp, vp, (need + 1) / 2, d, c, o);
        return;
    }
#endif
    for (; c + 64 <= d; c += 64) pv_4x4(s, vt, need, d, c, o);
    for (; c + 32 <= d; c += 32) pv_4x2(s, vt, need, d, c, o);
    if (c < d) pv_4x1(s, vt, need, d, c, o); /* head_dim % 32 == 16 */
}

/* round to nearest even bfloat16 */
static inline uint32_t bf16_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

/* One work item: rows r = i * group + g (query `first + i` of the span, head g of kv head
 * `head`), padded to a multiple of 4 with zero queries at the last row's position. Keys in
 * chunks of CH from 0, the last one ctx - n0 long, as the flash kernel splits them. */
static void one_item(const layout_t *L, const float *q, float *out, item_t it, int64_t qs,
                     int64_t q_len, int64_t ctx, const int32_t *blocks, float *work) {
    const int64_t d = L->d, g = L->group, rows = it.count * g, padded = (rows + 3) & ~3;
    float *kt = work, *vt = kt + d * CH, *o = vt + CH * d; /* [d][CH], [CH][d], [rows][d] */
    float *m = o + padded * d, *l = m + padded, *s = l + padded, *zero = s + 6 * CH;
    uint16_t *ph = (uint16_t *)(s + 4 * CH);
    uint32_t *qpairs = (uint32_t *)(zero + d); /* [padded][d / 2] */
    const float *qr[MAX_ROWS + 4];
    const uint32_t *qpr[MAX_ROWS + 4];
    int64_t pos[MAX_ROWS + 4];
    memset(zero, 0, (size_t)d * sizeof(float));
    for (int64_t r = 0; r < padded; r++) {
        int64_t i = (r < rows ? r : rows - 1) / g, hq = it.head * g + r % g;
        pos[r] = ctx - q_len + it.first + i;
        qr[r] = r < rows ? q + ((qs + it.first + i) * L->heads + hq) * d : zero;
        qpr[r] = qpairs + r * (d / 2);
        for (int64_t e = 0; L->dp && e < d / 2; e++)
            qpairs[r * (d / 2) + e] = bf16_bits(qr[r][2 * e]) | bf16_bits(qr[r][2 * e + 1]) << 16;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, (size_t)(padded * d) * sizeof(float));
    int64_t pmin = pos[0], pmax = pos[padded - 1];
    int64_t n0 = L->window > 0 && pmin - L->window + 1 > 0 ? pmin - L->window + 1 : 0;
    for (n0 -= n0 % CH; n0 <= pmax; n0 += CH) {
        int64_t len = ctx - n0 < CH ? ctx - n0 : CH, count = pmax + 1 - n0;
        count = count < len ? count : len;
        if (L->dp)
            load_pairs(L, blocks, it.head, n0, count, (uint32_t *)kt, (uint32_t *)vt);
        else
            load_tile(L, blocks, it.head, n0, count, kt, vt);
        for (int64_t r0 = 0; r0 < padded; r0 += 4) {
            int64_t lo = pos[r0], hi = pos[r0 + 3];
            if (n0 > hi) continue; /* every key after every row's position */
            int64_t need = hi + 1 - n0 < count ? hi + 1 - n0 : count;
            if (L->window > 0 && n0 + need - 1 <= lo - L->window) continue; /* before windows */
            int masked = n0 + need - 1 > lo || (L->window > 0 && n0 <= hi - L->window);
            row_group(L, qr + r0, qpr + r0, pos + r0, n0, len, need, masked, kt, vt,
                      o + r0 * d, m + r0, l + r0, s, ph);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float inv = 1.0f / (l[r] == 0.0f ? 1.0f : l[r]);
        float *dst = out + (qr[r] - q);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) dst[i] = o[r * d + i] * inv;
    }
}

/* q/out: [T, H, D] float32 contiguous; only the listed spans' rows are written. Sequence s:
 * table row rows[s], queries q_start[s] .. + q_lens[s] - 1, a context of lens[s] keys.
 * Caches: element (block, slot, head, i) at base + block*s_n + slot*s_b + head*s_h + i,
 * float32 (bf16 == 0) or bfloat16: read as pairs for vdpbf16ps where the CPU has it
 * (bf16 == 1), else converted to float32 (bf16 == 2 forces that, for tests). Returns 0; -1 for an unsupported layout or inconsistent
 * lengths, -2 when scratch memory ran out, -3 when a table names a block outside
 * 0..num_blocks-1 (nothing is computed then). */
int epd_paged_prefill(const float *q, float *out, int64_t num_heads, int64_t head_dim,
                      const void *kbase, const void *vbase, int64_t s_n, int64_t s_b,
                      int64_t s_h, int bf16, int64_t block_size, int64_t kv_heads,
                      int64_t num_blocks, const int32_t *table, int64_t table_stride,
                      int64_t table_cols, int64_t num_seqs, const int32_t *rows,
                      const int32_t *q_start, const int32_t *q_lens, const int32_t *lens,
                      float scale, int64_t window, float soft_cap, int lanes, int threads) {
    if (kv_heads <= 0 || num_heads % kv_heads || head_dim <= 0 || head_dim % 16 ||
        block_size <= 0 || num_heads / kv_heads > MAX_ROWS || (lanes && lanes != 8 && lanes != 16))
        return -1;
    const int64_t g = num_heads / kv_heads;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_lens[s] < 1 || q_lens[s] > lens[s] || lens[s] > table_cols * block_size)
            return -1;
        const int32_t *blocks = table + (int64_t)rows[s] * table_stride;
        for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return -3;
    }
    /* positions per item: MAX_ROWS rows, halved while there are few items for the threads */
    int64_t qb = MAX_ROWS / g, count = 0;
    for (;; qb /= 2) {
        count = 0;
        for (int64_t s = 0; s < num_seqs; s++) count += (q_lens[s] + qb - 1) / qb * kv_heads;
        if (count >= 4 * threads || qb * g <= 32 || qb == 1) break;
    }
    item_t *items = malloc((size_t)(count > 0 ? count : 1) * sizeof(item_t));
    if (!items) return -2;
    int64_t t = 0;
    for (int32_t s = 0; s < num_seqs; s++)
        for (int32_t first = 0; first < q_lens[s]; first += (int32_t)qb)
            for (int32_t h = 0; h < kv_heads; h++)
                items[t++] = (item_t){s, h, first,
                                      q_lens[s] - first < qb ? q_lens[s] - first : (int32_t)qb};
    const layout_t L = {kbase, vbase, s_n, s_b, s_h, block_size, head_dim, num_heads, g,
                        window, bf16 ? 2 : 4, bf16 != 0, bf16 == 1 && HAVE_DP, lanes, scale,
                        soft_cap};
    const int64_t padded = (qb * g + 3) & ~3;
    const int64_t work_floats =
        2 * head_dim * CH + padded * (head_dim + 2) + 6 * CH + head_dim + padded * head_dim / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && count > 1)
    {
        float *work = malloc((size_t)work_floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (!work) {
#pragma omp atomic write
                failed = 2;
                continue;
            }
            item_t it = items[i];
            one_item(&L, q, out, it, q_start[it.seq], q_lens[it.seq], lens[it.seq],
                     table + (int64_t)rows[it.seq] * table_stride, work);
        }
        free(work);
    }
    free(items);
    return -failed;
}
