/* Paged decode attention on the CPU, reading K/V in place from the block-major cache (model/paged.py).
 *
 * One query token per sequence. Sequence b's key at position p lives at
 *   k + block_tables[b * table_width + p / block_size] * block_stride + (p % block_size) * row_stride
 *     + kv_head * head_stride   (head_dim contiguous; the same offsets in v).
 * Sequence b attends to positions [lo, context_lens[b]) with lo = max(0, context_lens[b] - window) when
 * window > 0, else 0; no table entry outside that range is read (a windowed layer's older entries may be stale,
 * padded entries past the end are never touched). Query head h reads KV head h / (num_heads / num_kv_heads).
 * Softmax is online per block in float32: out = sum_p exp(s_p - m) v_p / sum_p exp(s_p - m),
 * s_p = scale * <q, k_p>. Work is split over (sequence, KV head) pairs with OpenMP, on one thread when the
 * step reads fewer than PARALLEL_MIN cached elements (a parallel region costs more than it saves there, and far
 * more on a loaded machine, where the barrier waits for a descheduled thread).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#define PARALLEL_MIN (1 << 18) /* elements of K read per step: batch 1 at 512 tokens x 3 heads x 64 reads 2^16.6 */

/* bump with any change to the signatures below, in layer_ops.c or small_gemm.c (2: + prefill; 3: + layer_ops.c;
 * 4: + small_gemm.c) */
int pdserve_paged_decode_abi(void) { return 4; }

void pdserve_paged_decode_f32(const float *q,          /* [B, num_heads, head_dim] contiguous */
                              const float *k, const float *v, /* cache bases (layer views) */
                              int64_t block_stride, int64_t row_stride, int64_t head_stride, /* elements */
                              const int64_t *block_tables, int64_t table_width, /* [B, table_width] */
                              const int64_t *context_lens,                      /* [B] */
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t window, float scale,
                              float *out) /* [B, num_heads, head_dim] contiguous */
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tasks = num_seqs * num_kv_heads;
    int64_t reads = 0; /* elements of K this step reads (an upper bound with windows) */
    for (int64_t b = 0; b < num_seqs; b++) reads += context_lens[b] * num_kv_heads * head_dim;
#pragma omp parallel if (reads >= PARALLEL_MIN)
    {
        /* per thread: scores [group, block_size], running max/sum [group], accumulators [group, head_dim] */
        float *buf = (float *)malloc(sizeof(float) * (size_t)(group * (block_size + head_dim + 2)));
        float *scores = buf, *acc = buf + group * block_size;
        float *mx = acc + group * head_dim, *sum = mx + group;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / num_kv_heads, kh = t % num_kv_heads;
            const int64_t len = context_lens[b];
            const int64_t lo = window > 0 && len > window ? len - window : 0;
            const float *qb = q + (b * num_heads + kh * group) * head_dim; /* this KV head's query heads */
            const int64_t *table = block_tables + b * table_width;
            for (int64_t g = 0; g < group; g++) {
                mx[g] = -INFINITY;
                sum[g] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
                const int64_t r0 = start < lo ? lo - start : 0;
                const int64_t r1 = len - start < block_size ? len - start : block_size;
                const int64_t off = table[start / block_size] * block_stride + kh * head_stride;
                const float *kb = k + off, *vb = v + off;
                /* scores of every query head of this KV head: each K row read once for the group */
                for (int64_t r = r0; r < r1; r++) {
                    const float *kr = kb + r * row_stride;
                    for (int64_t g = 0; g < group; g++) {
                        const float *qg = qb + g * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kr[d];
                        scores[g * block_size + r] = dot * scale;
                    }
                }
                /* online softmax per head: new max, rescale, the block's weights (exp vectorized over rows) */
                for (int64_t g = 0; g < group; g++) {
                    float *sg = scores + g * block_size;
                    float m = mx[g];
#pragma omp simd reduction(max : m)
                    for (int64_t r = r0; r < r1; r++) m = sg[r] > m ? sg[r] : m;
                    const float corr = fast_expf(mx[g] - m); /* 0 on the first block (mx = -inf) */
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t r = r0; r < r1; r++) {
                        sg[r] = fast_expf(sg[r] - m);
                        s += sg[r];
                    }
                    float *ag = acc + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) ag[d] *= corr;
                    sum[g] = sum[g] * corr + s;
                    mx[g] = m;
                }
                /* P.V: each V row read once for the group */
                for (int64_t r = r0; r < r1; r++) {
                    const float *vr = vb + r * row_stride;
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * block_size + r];
                        float *ag = acc + g * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ag[d] += p * vr[d];
                    }
                }
            }
            float *ob = out + (b * num_heads + kh * group) * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
                for (int64_t d = 0; d < head_dim; d++) ob[g * head_dim + d] = acc[g * head_dim + d] * inv;
            }
        }
        free(buf);
    }
}

/* Paged prefill attention over a cached prefix: one sequence's span of num_query new tokens, at positions
 * offset .. offset + num_query - 1 with offset = context_len - num_query, their K/V already written to the cache.
 * Query i (position p = offset + i) attends to keys [lo, p], lo = max(0, p - window + 1) when window > 0, else 0,
 * read in place through block_table (the same addressing as the decode kernel: any block/row/head strides, so
 * tokens-before-heads and heads-before-tokens blocks alike). No table entry before the block holding the first
 * query's lo is read. Work is split over (KV head, tile of QTILE queries). Per tile and key block the block's K
 * is transposed into a [head_dim, VW]-column scratch (L1-sized, zero-padded to VW columns) so that the scores of
 * RB softmax rows at once accumulate in registers (each K load feeds RB FMAs); each (query, head) row keeps an
 * online softmax in float32, and P.V accumulates VW-wide slices of head_dim in registers.
 */
#define QTILE 16
#define VW 16 /* columns of one score vector (one 512-bit register of float32) */
#define RB 4  /* softmax rows whose scores are computed together */

static void scores_rows(const float *kt, int64_t cols, int64_t head_dim, const float *const *qrows, int64_t nr,
                        float scale, float *sc /* [RB, cols] */) {
    for (int64_t c0 = 0; c0 < cols; c0 += VW) {
        float a[RB][VW];
        for (int64_t i = 0; i < RB; i++)
            for (int64_t j = 0; j < VW; j++) a[i][j] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float *kd = kt + d * cols + c0;
            for (int64_t i = 0; i < RB; i++) {
                const float qd = i < nr ? qrows[i][d] : 0.0f;
#pragma omp simd
                for (int64_t j = 0; j < VW; j++) a[i][j] += qd * kd[j];
            }
        }
        for (int64_t i = 0; i < nr; i++)
            for (int64_t j = 0; j < VW; j++) sc[i * cols + c0 + j] = a[i][j] * scale;
    }
}

void pdserve_paged_prefill_f32(const float *q,                  /* [num_query, num_heads, head_dim] contiguous */
                               const float *k, const float *v,  /* cache bases (layer views) */
                               int64_t block_stride, int64_t row_stride, int64_t head_stride, /* elements */
                               const int64_t *block_table,      /* [>= ceil(context_len / block_size)] */
                               int64_t num_query, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t window, float scale,
                               float *out) /* [num_query, num_heads, head_dim] contiguous */
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t offset = context_len - num_query;
    const int64_t num_tiles = (num_query + QTILE - 1) / QTILE;
    const int64_t tasks = num_kv_heads * num_tiles;
    const int64_t nrows = QTILE * group; /* softmax rows of one tile: query-major, row = qi * group + g */
    const int64_t cols = (block_size + VW - 1) / VW * VW;
    const int64_t reads = num_query * context_len * num_kv_heads; /* rough work: parallel only when it pays */
#pragma omp parallel if (reads >= PARALLEL_MIN / 4)
    {
        /* per thread: kt [head_dim, cols], scores [RB, cols], acc [nrows, head_dim], mx/sum [nrows] */
        float *buf = (float *)calloc((size_t)(head_dim * cols + RB * cols + nrows * (head_dim + 2)), sizeof(float));
        float *kt = buf, *sc = kt + head_dim * cols, *acc = sc + RB * cols;
        float *mx = acc + nrows * head_dim, *sum = mx + nrows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t kh = t % num_kv_heads, tile = t / num_kv_heads;
            const int64_t i0 = tile * QTILE, i1 = i0 + QTILE < num_query ? i0 + QTILE : num_query;
            const int64_t p0 = offset + i0, p_last = offset + i1 - 1, rows = (i1 - i0) * group;
            const int64_t lo0 = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
            for (int64_t r = 0; r < rows; r++) {
                mx[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
            for (int64_t start = lo0 - lo0 % block_size; start <= p_last; start += block_size) {
                const int64_t n = context_len - start < block_size ? context_len - start : block_size;
                const int64_t off = block_table[start / block_size] * block_stride + kh * head_stride;
                const float *kb = k + off, *vb = v + off;
                for (int64_t d = 0; d < head_dim; d++) {
                    for (int64_t r = 0; r < n; r++) kt[d * cols + r] = kb[r * row_stride + d];
                    for (int64_t r = n; r < cols; r++) kt[d * cols + r] = 0.0f;
                }
                /* rows whose query sees part of this block: from the first query whose position reaches it */
                const int64_t qfirst = start - offset > i0 ? start - offset : i0;
                for (int64_t row0 = (qfirst - i0) * group; row0 < rows; row0 += RB) {
                    const int64_t nr = rows - row0 < RB ? rows - row0 : RB;
                    const float *qrows[RB];
                    for (int64_t i = 0; i < nr; i++) {
                        const int64_t qi = i0 + (row0 + i) / group, g = (row0 + i) % group;
                        qrows[i] = q + (qi * num_heads + kh * group + g) * head_dim;
                    }
                    scores_rows(kt, cols, head_dim, qrows, nr, scale, sc);
                    for (int64_t i = 0; i < nr; i++) {
                        const int64_t row = row0 + i, p = offset + i0 + row / group;
                        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
                        const int64_t r0 = lo > start ? lo - start : 0;
                        const int64_t r1 = p - start + 1 < n ? p - start + 1 : n;
                        if (r0 >= r1) continue;
                        float *si = sc + i * cols;
                        float m = mx[row];
#pragma omp simd reduction(max : m)
                        for (int64_t r = r0; r < r1; r++) m = si[r] > m ? si[r] : m;
                        const float corr = expf(mx[row] - m); /* 0 on the row's first block (mx = -inf) */
                        float s = sum[row] * corr;
#pragma omp simd reduction(+ : s)
                        for (int64_t r = r0; r < r1; r++) {
                            si[r] = expf(si[r] - m);
                            s += si[r];
                        }
                        float *ar = acc + row * head_dim;
                        int64_t d0 = 0;
                        for (; d0 + VW <= head_dim; d0 += VW) { /* a VW-wide slice of the row in registers */
                            float a[VW];
                            for (int64_t j = 0; j < VW; j++) a[j] = ar[d0 + j] * corr;
                            for (int64_t r = r0; r < r1; r++) {
                                const float pr = si[r], *vr = vb + r * row_stride + d0;
#pragma omp simd
                                for (int64_t j = 0; j < VW; j++) a[j] += pr * vr[j];
                            }
                            for (int64_t j = 0; j < VW; j++) ar[d0 + j] = a[j];
                        }
                        for (; d0 < head_dim; d0++) { /* head_dim not a multiple of VW: the tail, one by one */
                            float a = ar[d0] * corr;
                            for (int64_t r = r0; r < r1; r++) a += si[r] * vb[r * row_stride + d0];
                            ar[d0] = a;
                        }
                        mx[row] = m;
                        sum[row] = s;
                    }
                }
            }
            for (int64_t row = 0; row < rows; row++) {
                const int64_t qi = i0 + row / group, g = row % group;
                const float inv = sum[row] > 0.0f ? 1.0f / sum[row] : 0.0f;
                float *o = out + (qi * num_heads + kh * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] = acc[row * head_dim + d] * inv;
            }
        }
        free(buf);
    }
}
