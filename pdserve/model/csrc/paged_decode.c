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
/* the softmax exps vectorized: see layer_ops.c (fast_expf's clamps stay scalar while comparisons may trap) */
#pragma GCC optimize("no-trapping-math")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#define PARALLEL_MIN (1 << 18) /* elements of K read per step: batch 1 at 512 tokens x 3 heads x 64 reads 2^16.6 */

/* bump with any change to the signatures below, in paged_prefill.c, layer_ops.c or small_gemm.c (2: + prefill;
 * 3: + layer_ops.c; 4: + small_gemm.c; 5: prefill moved to paged_prefill.c, register-blocked; 6: prefill reads
 * q through a row stride) */
int pdserve_paged_decode_abi(void) { return 6; }

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
