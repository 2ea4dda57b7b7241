/* Paged decode attention on the CPU, reading K/V in place from the block-major cache (model/paged.py).
 *
 * One query token per sequence. Sequence b's key at position p lives at
 *   k + block_tables[b * table_width + p / block_size] * block_stride + (p % block_size) * row_stride
 *     + kv_head * head_stride   (head_dim contiguous; the same offsets in v).
 * Sequence b attends to positions [lo, context_lens[b]) with lo = max(0, context_lens[b] - window) when
 * window > 0, else 0; no table entry outside that range is read (a windowed layer's older entries may be stale,
 * padded entries past the end are never touched). Query head h reads KV head h / (num_heads / num_kv_heads).
 * Softmax is online per block in float32: out = sum_p exp(s_p - m) v_p / sum_p exp(s_p - m),
 * s_p = scale * <q, k_p>. Where head_dim is 2, 4, 8 or 16 vectors of VW floats (the machine's width) the task
 * runs on vectors with its sums in registers (task_vec): each K row's dots with RB rows at a time (RB independent
 * chains of fused multiply-adds: one chain per dot waits on the FMA latency at every step), each V row added to
 * the group's outputs held in registers for a whole block; other head dims take the scalar loops (task_scalar).
 * Each block's successor is prefetched while it runs (the blocks of a sequence lie anywhere in the cache).
 * Work is split over sequences with OpenMP (SEQS_PER_THREAD and more per thread: a task reads each block's KV
 * heads as one run; batch 8 of the case below, 30 layers: 18.0-18.5 ms vs 19.2-20.3 with a task per KV head)
 * or else over (sequence, KV head) pairs, on one thread when the step reads fewer than
 * PARALLEL_MIN cached elements (a parallel region costs more than it saves there, and far more on a loaded
 * machine, where the barrier waits for a descheduled thread). The step is bound by reading the cache from
 * memory: batch 1 at 512 tokens (SmolLM2's 3 KV heads of 64) reads 786 KB a layer, 190 us on one thread of an
 * AVX2 EPYC and 140 with two (the vector task alone: 110 us with every block in cache, 30 of them the call).
 */
/* the softmax exps vectorized: see layer_ops.c (fast_expf's clamps stay scalar while comparisons may trap) */
#pragma GCC optimize("no-trapping-math")
#pragma GCC optimize("fp-contract=fast") /* FMA contraction: -std=c99 turns it off */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "panel_fma.h" /* VW, vf, vload, vstore */

#define PARALLEL_MIN (1 << 14) /* elements of K read per step: batch 1 at 512 tokens x 3 heads x 64 reads 2^16.6 */

/* bump with any change to the signatures below, in paged_prefill.c, layer_ops.c or small_gemm.c (2: + prefill;
 * 3: + layer_ops.c; 4: + small_gemm.c; 5: prefill moved to paged_prefill.c, register-blocked; 6: prefill reads
 * q through a row stride) */
int pdserve_paged_decode_abi(void) { return 6; }

#define SEQS_PER_THREAD 2 /* sequences per thread from which a task takes all KV heads of its sequence */
#define RB 8 /* K rows per pass of task_vec's dots: RB sums and one q vector in registers (of AVX2's 16) */

static inline __attribute__((always_inline)) float vsum(vf a) { /* a tree, not a chain: the same in any lane order */
    float t[VW];
    memcpy(t, &a, sizeof a);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* One block's online softmax for every query head of the group: scores sc [group, block_size] rows r0..r1 become
 * exp(s - max); returns nothing, leaves each head's rescale factor in corr[g] and updates mx, sum. */
static inline void block_softmax(float *sc, int64_t block_size, int64_t group, int64_t r0, int64_t r1, float *mx,
                                 float *sum, float *corr) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = sc + g * block_size;
        float m = mx[g];
#pragma omp simd reduction(max : m)
        for (int64_t r = r0; r < r1; r++) m = sg[r] > m ? sg[r] : m;
        corr[g] = fast_expf(mx[g] - m); /* 0 on the first block (mx = -inf) */
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t r = r0; r < r1; r++) {
            sg[r] = fast_expf(sg[r] - m);
            s += sg[r];
        }
        sum[g] = sum[g] * corr[g] + s;
        mx[g] = m;
    }
}

/* A task's softmax state before its first block: running max -inf, sums and outputs 0, for n query heads. */
static inline void state_reset(int64_t n, int64_t head_dim, float *mx, float *sum, float *acc) {
    for (int64_t g = 0; g < n; g++) {
        mx[g] = -INFINITY;
        sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(n * head_dim));
}

/* A task's outputs after its last block: each head's weighted sum over its softmax's sum (0 where it saw no key). */
static inline void write_out(int64_t n, int64_t head_dim, const float *acc, const float *sum, float *ob) {
    for (int64_t g = 0; g < n; g++) {
        const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) ob[g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

/* The task (one sequence, `heads` KV heads from kv_off on, head_stride apart) for head_dim = NVD * VW, NVD a
 * constant after inlining: its G = heads * group query heads are rows of one softmax each, query head g reading
 * KV head g / group of the task. */
static inline __attribute__((always_inline)) void task_vec(const int NVD, const float *qb, const float *k,
                                                           const float *v, const int64_t *table, int64_t lo,
                                                           int64_t len, int64_t block_stride, int64_t row_stride,
                                                           int64_t kv_off, int64_t heads, int64_t head_stride,
                                                           int64_t group, int64_t block_size, float scale, float *sc,
                                                           float *acc, float *mx, float *sum, float *corr, float *ob) {
    const int64_t hd = NVD * VW, G = heads * group;
    state_reset(G, hd, mx, sum, acc);
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t r0 = start < lo ? lo - start : 0;
        const int64_t r1 = len - start < block_size ? len - start : block_size;
        const int64_t off = table[start / block_size] * block_stride + kv_off;
        const float *kb = k + off, *vb = v + off;
        if (start + block_size < len) { /* the next block's K and V on their way from memory while this one runs */
            const int64_t next = table[start / block_size + 1] * block_stride + kv_off;
            for (int64_t h = 0; h < heads; h++)
                for (int64_t r = 0; r < block_size; r++)
                    for (int64_t d = 0; d < hd; d += 64 / (int64_t)sizeof(float)) {
                        __builtin_prefetch(k + next + h * head_stride + r * row_stride + d);
                        __builtin_prefetch(v + next + h * head_stride + r * row_stride + d);
                    }
        }
        for (int64_t g = 0; g < G; g++) { /* scores: RB rows' dots at a time, then one row at a time */
            const float *qg = qb + g * hd, *kg = kb + (g / group) * head_stride;
            float *sg = sc + g * block_size;
            int64_t r = r0;
            for (; r + RB <= r1; r += RB) {
                vf a[RB];
                for (int i = 0; i < RB; i++) a[i] = (vf){0};
                for (int j = 0; j < NVD; j++) {
                    const vf qv = vload(qg + j * VW);
                    for (int i = 0; i < RB; i++) a[i] += qv * vload(kg + (r + i) * row_stride + j * VW);
                }
                for (int i = 0; i < RB; i++) sg[r + i] = vsum(a[i]) * scale;
            }
            for (; r < r1; r++) {
                vf a = (vf){0};
                for (int j = 0; j < NVD; j++) a += vload(qg + j * VW) * vload(kg + r * row_stride + j * VW);
                sg[r] = vsum(a) * scale;
            }
        }
        block_softmax(sc, block_size, G, r0, r1, mx, sum, corr);
        for (int64_t g = 0; g < G; g++) { /* P.V into the head's outputs, in registers for the block */
            const float *pg = sc + g * block_size, *vg = vb + (g / group) * head_stride;
            float *ag = acc + g * hd;
            vf o[NVD];
            for (int j = 0; j < NVD; j++) o[j] = vload(ag + j * VW) * corr[g];
            for (int64_t r = r0; r < r1; r++) {
                const float p = pg[r];
                const float *vr = vg + r * row_stride;
                for (int j = 0; j < NVD; j++) o[j] += p * vload(vr + j * VW);
            }
            for (int j = 0; j < NVD; j++) vstore(ag + j * VW, o[j]);
        }
    }
    write_out(G, hd, acc, sum, ob);
}

/* The task for any head_dim: scalar loops the compiler vectorizes over head_dim. */
static void task_scalar(const float *qb, const float *k, const float *v, const int64_t *table, int64_t lo,
                        int64_t len, int64_t block_stride, int64_t row_stride, int64_t kv_off, int64_t group,
                        int64_t head_dim, int64_t block_size, float scale, float *sc, float *acc, float *mx,
                        float *sum, float *corr, float *ob) {
    state_reset(group, head_dim, mx, sum, acc);
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t r0 = start < lo ? lo - start : 0;
        const int64_t r1 = len - start < block_size ? len - start : block_size;
        const int64_t off = table[start / block_size] * block_stride + kv_off;
        const float *kb = k + off, *vb = v + off;
        /* scores of every query head of this KV head: each K row read once for the group */
        for (int64_t r = r0; r < r1; r++) {
            const float *kr = kb + r * row_stride;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qb + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kr[d];
                sc[g * block_size + r] = dot * scale;
            }
        }
        block_softmax(sc, block_size, group, r0, r1, mx, sum, corr);
        for (int64_t g = 0; g < group; g++) {
            float *ag = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ag[d] *= corr[g];
        }
        /* P.V: each V row read once for the group */
        for (int64_t r = r0; r < r1; r++) {
            const float *vr = vb + r * row_stride;
            for (int64_t g = 0; g < group; g++) {
                const float p = sc[g * block_size + r];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += p * vr[d];
            }
        }
    }
    write_out(group, head_dim, acc, sum, ob);
}

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
    const int64_t nvd = head_dim % VW == 0 ? head_dim / VW : 0; /* task_vec's cases below, else task_scalar */
    const int vec = nvd == 2 || nvd == 4 || nvd == 8 || nvd == 16;
    /* a vector task takes all KV heads of its sequence when there are sequences enough to share out (it then
     * reads each block's heads in one contiguous run), else one KV head */
    const int64_t heads = vec && num_seqs >= SEQS_PER_THREAD * omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t tasks = num_seqs * (num_kv_heads / heads);
    int64_t reads = 0; /* elements of K this step reads (an upper bound with windows) */
    for (int64_t b = 0; b < num_seqs; b++) reads += context_lens[b] * num_kv_heads * head_dim;
#pragma omp parallel if (reads >= PARALLEL_MIN)
    {
        /* per thread: scores [G, block_size], accumulators [G, head_dim], max/sum/rescale [G], G query heads */
        const int64_t G = heads * group;
        float *buf = (float *)malloc(sizeof(float) * (size_t)(G * (block_size + head_dim + 3)));
        float *sc = buf, *acc = buf + G * block_size;
        float *mx = acc + G * head_dim, *sum = mx + G, *corr = sum + G;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / (num_kv_heads / heads), kh = t % (num_kv_heads / heads) * heads;
            const int64_t len = context_lens[b];
            const int64_t lo = window > 0 && len > window ? len - window : 0;
            const float *qb = q + (b * num_heads + kh * group) * head_dim; /* this task's query heads */
            float *ob = out + (b * num_heads + kh * group) * head_dim;
            const int64_t *table = block_tables + b * table_width;
            const int64_t kv_off = kh * head_stride;
#define TASK_VEC(n) task_vec(n, qb, k, v, table, lo, len, block_stride, row_stride, kv_off, heads, head_stride, \
                             group, block_size, scale, sc, acc, mx, sum, corr, ob)
            switch (nvd) {
                case 2: TASK_VEC(2); break;
                case 4: TASK_VEC(4); break;
                case 8: TASK_VEC(8); break;
                case 16: TASK_VEC(16); break;
                default:
                    task_scalar(qb, k, v, table, lo, len, block_stride, row_stride, kv_off, group, head_dim,
                                block_size, scale, sc, acc, mx, sum, corr, ob);
            }
#undef TASK_VEC
        }
        free(buf);
    }
}
