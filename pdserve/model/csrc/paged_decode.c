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

#define PARALLEL_MIN (1 << 18) /* elements of K read per step: batch 1 at 512 tokens x 3 heads x 64 reads 2^16.6 */

int pdserve_paged_decode_abi(void) { return 2; } /* bump with any change to the signatures below (2: + prefill) */

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
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qb + g * head_dim;
                    float *sg = scores + g * block_size;
                    float m = mx[g];
                    for (int64_t r = r0; r < r1; r++) {
                        const float *kr = kb + r * row_stride;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kr[d];
                        sg[r] = dot * scale;
                        if (sg[r] > m) m = sg[r];
                    }
                    const float corr = expf(mx[g] - m); /* 0 on the first block (mx = -inf) */
                    float *ag = acc + g * head_dim;
                    float s = sum[g] * corr;
                    for (int64_t d = 0; d < head_dim; d++) ag[d] *= corr;
                    for (int64_t r = r0; r < r1; r++) {
                        const float p = expf(sg[r] - m);
                        const float *vr = vb + r * row_stride;
                        s += p;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ag[d] += p * vr[d];
                    }
                    mx[g] = m;
                    sum[g] = s;
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
 * query's lo is read. Work is split over (KV head, tile of QTILE queries); per tile and key block the block's K
 * is transposed into a [head_dim, block_size] scratch (L1-sized) so scores vectorise over the block's rows, and
 * each (query, head) row keeps an online softmax in float32.
 */
#define QTILE 16

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
    const int64_t reads = num_query * context_len * num_kv_heads; /* rough work: parallel only when it pays */
#pragma omp parallel if (reads >= PARALLEL_MIN / 4)
    {
        /* per thread: kt [head_dim, block_size], scores [block_size], acc [nrows, head_dim], mx/sum [nrows] */
        float *buf = (float *)malloc(sizeof(float) * (size_t)(head_dim * block_size + block_size +
                                                              nrows * (head_dim + 2)));
        float *kt = buf, *sc = kt + head_dim * block_size, *acc = sc + block_size;
        float *mx = acc + nrows * head_dim, *sum = mx + nrows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t kh = t % num_kv_heads, tile = t / num_kv_heads;
            const int64_t i0 = tile * QTILE, i1 = i0 + QTILE < num_query ? i0 + QTILE : num_query;
            const int64_t p0 = offset + i0, p_last = offset + i1 - 1;
            const int64_t lo0 = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
            for (int64_t r = 0; r < (i1 - i0) * group; r++) {
                mx[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)((i1 - i0) * group * head_dim));
            for (int64_t start = lo0 - lo0 % block_size; start <= p_last; start += block_size) {
                const int64_t n = context_len - start < block_size ? context_len - start : block_size;
                const int64_t off = block_table[start / block_size] * block_stride + kh * head_stride;
                const float *kb = k + off, *vb = v + off;
                for (int64_t r = 0; r < n; r++)
                    for (int64_t d = 0; d < head_dim; d++) kt[d * block_size + r] = kb[r * row_stride + d];
                for (int64_t qi = i0; qi < i1; qi++) {
                    const int64_t p = offset + qi;
                    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
                    const int64_t r0 = lo > start ? lo - start : 0;
                    const int64_t r1 = p - start + 1 < n ? p - start + 1 : n;
                    if (r0 >= r1) continue;
                    for (int64_t g = 0; g < group; g++) {
                        const float *qg = q + (qi * num_heads + kh * group + g) * head_dim;
                        const int64_t row = (qi - i0) * group + g;
                        for (int64_t r = 0; r < block_size; r++) sc[r] = 0.0f;
                        for (int64_t d = 0; d < head_dim; d++) {
                            const float qd = qg[d];
                            const float *kd = kt + d * block_size;
#pragma omp simd
                            for (int64_t r = 0; r < block_size; r++) sc[r] += qd * kd[r];
                        }
                        float m = mx[row];
                        for (int64_t r = r0; r < r1; r++) {
                            sc[r] *= scale;
                            if (sc[r] > m) m = sc[r];
                        }
                        const float corr = expf(mx[row] - m); /* 0 on the row's first block (mx = -inf) */
                        float *ar = acc + row * head_dim;
                        float s = sum[row] * corr;
                        for (int64_t d = 0; d < head_dim; d++) ar[d] *= corr;
                        for (int64_t r = r0; r < r1; r++) {
                            const float pr = expf(sc[r] - m);
                            const float *vr = vb + r * row_stride;
                            s += pr;
#pragma omp simd
                            for (int64_t d = 0; d < head_dim; d++) ar[d] += pr * vr[d];
                        }
                        mx[row] = m;
                        sum[row] = s;
                    }
                }
            }
            for (int64_t qi = i0; qi < i1; qi++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t row = (qi - i0) * group + g;
                    const float inv = sum[row] > 0.0f ? 1.0f / sum[row] : 0.0f;
                    float *o = out + (qi * num_heads + kh * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[row * head_dim + d] * inv;
                }
        }
        free(buf);
    }
}
