/* Causal (optionally sliding-window) prefill attention on the CPU, reading K/V in place from the paged cache.
 *
 * One sequence's span of num_query new tokens at positions offset .. offset + num_query - 1, offset =
 * context_len - num_query, their K/V already written to the cache: a whole prompt (offset 0), a later chunk or
 * the part after a prefix-cache hit. Query i (position p = offset + i) attends to keys [lo, p], lo = max(0, p -
 * window + 1) when window > 0, else 0. Key position t lives at
 *   k + block_table[t / block_size] * block_stride + (t % block_size) * row_stride + kv_head * head_stride
 * (head_dim contiguous; any block/row/head strides, so tokens-before-heads and heads-before-tokens blocks
 * alike); no table entry before the block holding the first query's lo is read.
 *
 * Why not torch's SDPA: its CPU flash kernel splits a 512-token prompt into query blocks of 64 against key
 * blocks of 512, so causal attention costs nearly as much as full attention (3.3-3.9 ms per layer of the
 * built-in model, ~20% of a 512-token prefill). Here a task is one KV head and QT queries: the rows of its
 * `group` query heads (QT x group softmax rows, query-major) share every K/V element they load. The task's
 * queries are read through q's row stride (a view of the qkv projection's output: no copy per layer) and packed
 * once, transposed and scaled ([head_dim, rows]), so scores come out transposed, S^T [keys, rows], with K's rows
 * read in place from the cache as panel_fma's left operand (MR keys x NB rows of sums in registers), and
 * O += P V reads V's rows in place as its right operand (S^T's column is P's row): nothing of K or V is copied.
 * The online softmax (online_softmax.h) runs down S^T's columns in float32 (fast_expf); P V rescales the output
 * rows as it loads its accumulators. Steps of KB keys stop at the tile's last position, so the causal triangle
 * costs about what it computes. head_dim must be a multiple of NB (the caller checks:
 * attention.prefill_fits). Sums run in another order than torch's, so outputs differ from SDPA's in the last
 * bits, not in the tokens (tests/model/test_cpu_attention.py).
 */
#pragma GCC optimize("fp-contract=fast") /* FMA contraction: -std=c99 turns it off */
/* fast_expf's clamps are selects GCC (12) does not vectorize while a float comparison may trap ("control flow in
 * loop"): the softmax's exps ran one at a time. Values are the same either way (only exception flags differ). */
#pragma GCC optimize("no-trapping-math")
#pragma GCC target("prefer-vector-width=512")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "online_softmax.h" /* online_softmax_step */
#include "panel_fma.h"      /* NB, MR, VW, NV, vf, panel_fma_rows, vload, vstore */

#define QT 32 /* queries per task: QT x group rows, a multiple of NB */
#define KB 64 /* keys per step (64 measured ~4% faster than 32 at 512 tokens) */

/* acc[R, NB] (row stride ldacc) = corr[R] * acc + p[R, K] v[K, NB]: p's element (m, k) at p[m + k * ldp] (a
 * column block of S^T), v's row k at vrow[k] (V's rows in place, the step's keys across cache blocks), corr the
 * rows' online-softmax rescale. panel_fma's register blocking with the key loop over the whole step, so the
 * accumulators are loaded, rescaled and stored once per step. */
static inline __attribute__((always_inline)) void pv_panel(const float *p, int64_t ldp, const int R,
                                                           const float *const *vrow, int64_t c, int64_t K,
                                                           const float *corr, float *acc, int64_t ldacc) {
    vf a[MR][NV];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NV; j++) a[m][j] = corr[m] * vload(acc + m * ldacc + j * VW);
    for (int64_t k = 0; k < K; k++) {
        vf wk[NV];
        for (int j = 0; j < NV; j++) wk[j] = vload(vrow[k] + c + j * VW);
        for (int m = 0; m < R; m++) {
            const float pv = p[m + k * ldp];
            for (int j = 0; j < NV; j++) a[m][j] += pv * wk[j];
        }
    }
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NV; j++) vstore(acc + m * ldacc + j * VW, a[m][j]);
}

void pdserve_paged_prefill_f32(const float *q, int64_t q_row_stride, /* [num_query, num_heads, head_dim]: heads
                                                                        * head_dim apart, tokens q_row_stride */
                               const float *k, const float *v, /* cache bases (layer views) */
                               int64_t block_stride, int64_t row_stride, int64_t head_stride, /* elements */
                               const int64_t *block_table, /* [>= ceil(context_len / block_size)] */
                               int64_t num_query, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t window, float scale,
                               float *out) /* [num_query, num_heads, head_dim] contiguous */
{
    const int64_t group = num_heads / num_kv_heads, offset = context_len - num_query;
    const int64_t num_tiles = (num_query + QT - 1) / QT, tasks = num_kv_heads * num_tiles;
    const int64_t max_rows = QT * group;
#pragma omp parallel if (num_query * context_len >= 4096)
    {
        /* per thread: qt [head_dim, max_rows], st [KB, max_rows], acc [max_rows, head_dim], mx, sum, the rows'
         * positions, the step's rescale corr and the softmax's two temporaries [max_rows] */
        const size_t floats = (size_t)(2 * head_dim * max_rows + KB * max_rows + 6 * max_rows);
        float *buf = (float *)calloc(floats, sizeof(float));
        float *qt = buf, *st = qt + head_dim * max_rows, *acc = st + KB * max_rows;
        float *mx = acc + max_rows * head_dim, *sum = mx + max_rows, *pos = sum + max_rows;
        float *corr = pos + max_rows, *tmp = corr + max_rows;
        const float *vrow[KB];
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            /* the last (longest) tiles first, so the threads finish together */
            const int64_t kh = t % num_kv_heads, tile = num_tiles - 1 - t / num_kv_heads;
            const int64_t i0 = tile * QT, i1 = i0 + QT < num_query ? i0 + QT : num_query;
            const int64_t p0 = offset + i0, p_end = offset + i1; /* positions of the tile's queries */
            /* rows padded to whole panels: a short last tile's extra rows score 0 and are never written out */
            const int64_t rows = (i1 - i0) * group, rp = (rows + NB - 1) / NB * NB;
            for (int64_t r = 0; r < rp; r++) { /* row r: query i0 + r / group, head kh * group + r % group */
                const float *qr = q + (i0 + r / group) * q_row_stride + (kh * group + r % group) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) qt[d * rp + r] = r < rows ? qr[d] * scale : 0.0f;
                mx[r] = -INFINITY;
                sum[r] = 0.0f;
                pos[r] = (float)(p0 + r / group); /* padded rows: past the last query, never written out */
            }
            memset(acc, 0, sizeof(float) * (size_t)(rp * head_dim));
            const int64_t lo0 = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
            for (int64_t key0 = lo0 - lo0 % block_size; key0 < p_end; key0 += KB) {
                const int64_t n = p_end - key0 < KB ? p_end - key0 : KB;
                /* On the diagonal, keys past a panel's last query are left out of S (the mask writes -inf there)
                 * and out of P V (where P is 0): the triangle's upper half of each diagonal block costs nothing. */
                for (int64_t j = 0; j < n;) { /* S^T = K (scale Q)^T, K's rows in place, a cache block at a time */
                    const int64_t key = key0 + j, within = key % block_size;
                    const int64_t piece = block_size - within < n - j ? block_size - within : n - j;
                    const float *kb = k + block_table[key / block_size] * block_stride + within * row_stride +
                                      kh * head_stride;
                    for (int64_t m0 = 0; m0 < piece; m0 += MR)
                        for (int64_t c = 0; c < rp; c += NB)
                            if ((float)(key + m0) <= pos[c + NB - 1])
                                panel_fma_rows(kb + m0 * row_stride, row_stride, 1, piece - m0 < MR ? piece - m0 : MR,
                                               qt + c, rp, head_dim, st + (j + m0) * rp + c, rp, 0);
                    j += piece;
                }
                online_softmax_step(st, n, rp, pos, key0, window, mx, sum, corr, tmp);
                for (int64_t j = 0; j < n; j++) { /* O += P V, V's rows in place; P's row r is S^T's column r */
                    const int64_t key = key0 + j;
                    vrow[j] = v + block_table[key / block_size] * block_stride + (key % block_size) * row_stride +
                              kh * head_stride;
                }
                for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                    const int R = rows - r0 < MR ? 1 : MR; /* a short last tile's tail rows: one at a time */
                    for (int64_t r = r0; r < r0 + MR && r < rows; r += R) {
                        const int64_t seen = (int64_t)pos[r + R - 1] - key0 + 1; /* keys the rows' last sees */
                        const int64_t kn = seen < n ? (seen > 0 ? seen : 0) : n;
                        for (int64_t c = 0; c < head_dim; c += NB) {
                            if (R == MR)
                                pv_panel(st + r, rp, MR, vrow, c, kn, corr + r, acc + r * head_dim + c, head_dim);
                            else
                                pv_panel(st + r, rp, 1, vrow, c, kn, corr + r, acc + r * head_dim + c, head_dim);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
                float *o = out + ((i0 + r / group) * num_heads + kh * group + r % group) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] = acc[r * head_dim + d] * inv;
            }
        }
        free(buf);
    }
}
