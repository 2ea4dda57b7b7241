/* A decoder layer's small ops on the CPU, each one pass over its rows instead of ~3-7 torch ops (and as many
 * OpenMP regions): add + RMSNorm, q/k-norm + rotary + KV store, and SiLU- (or GELU-tanh-) and-mul.
 * Compiled into the same library as paged_decode.c (its ABI number covers these signatures too).
 *
 * Every kernel computes in float32 in the order the portable torch ops do (model/decoder.py: RMSNorm.forward,
 * apply_rope, F.silu(gate) * up); only sums of squares and exp differ in rounding (a few ulp; allclose in
 * tests/model/test_cpu_layer_ops.py). Rows are split over OpenMP threads only when the call touches at least
 * PARALLEL_MIN_ELEMS elements: a decode step's rows stay on one thread (a parallel region costs more than it
 * saves there, and far more on a loaded machine).
 */
#pragma GCC target("prefer-vector-width=512") /* AVX-512 CPUs: full-width vectors (gcc's default is 256) */
/* fast_expf's clamps are selects GCC (12) does not vectorize while a float comparison may trap ("control flow in
 * loop"): SiLU-and-mul ran one exp at a time, 9.1 -> 2.4 ms at 512 x 1536 on one AVX2 core. The values are the
 * same either way (only exception flags differ). */
#pragma GCC optimize("no-trapping-math")
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_ELEMS (1 << 15)

#include "fast_exp.h"

/* One row of RMSNorm: out[j] = weight[j] * (x[j] * rsqrt(mean(x^2) + eps)), as RMSNorm.forward rounds it. */
static inline void rmsnorm_row(const float *x, const float *weight, float eps, int64_t n, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t j = 0; j < n; j++) out[j] = weight[j] * (x[j] * r);
}

/* residual: [num_rows, n] updated in place to x + residual (NULL: no add, the norm reads x);
 * out [num_rows, n] = RMSNorm(x + residual) * weight. All rows contiguous. */
void pdserve_add_rmsnorm_f32(const float *x, float *residual, const float *weight, float eps, int64_t num_rows,
                             int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (num_rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < num_rows; t++) {
        const float *xt = x + t * n;
        if (residual != NULL) {
            float *rt = residual + t * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) rt[j] = xt[j] + rt[j];
            xt = rt;
        }
        rmsnorm_row(xt, weight, eps, n, out + t * n);
    }
}

/* qkv [num_tokens, qkv_stride]: per token num_heads q heads, then num_kv_heads k heads, then num_kv_heads v
 * heads, head_dim each. In place: q and k heads are RMS-normed per head with q_weight / k_weight (when not
 * NULL: qwen3, gemma 3) and rotated (rotate-half: o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, cos/sin
 * [num_tokens, head_dim / 2] contiguous). Token t's rotated k and its v are stored at slot s = slots[t] of the
 * caches (s < 0: not stored): base + (s / block_size) * block_stride + (s % block_size) * row_stride
 * + head * head_stride, head_dim contiguous (model/paged.py's layer view). */
void pdserve_qkv_rope_store_f32(float *qkv, int64_t num_tokens, int64_t qkv_stride, const float *cos,
                                const float *sin, const float *q_weight, const float *k_weight, float eps,
                                float *k_cache, float *v_cache, int64_t block_stride, int64_t row_stride,
                                int64_t head_stride, int64_t block_size, const int64_t *slots, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2, qk_heads = num_heads + num_kv_heads;
#pragma omp parallel for schedule(static) if (num_tokens * qkv_stride >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        const int64_t slot = slots[t];
        const int64_t off = slot < 0 ? 0 : (slot / block_size) * block_stride + (slot % block_size) * row_stride;
        for (int64_t h = 0; h < qk_heads; h++) {
            float *x = row + h * head_dim;
            const float *w = h < num_heads ? q_weight : k_weight;
            if (w != NULL) rmsnorm_row(x, w, eps, head_dim, x);
            float *x1 = x, *x2 = x + half;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
            if (h >= num_heads && slot >= 0)
                memcpy(k_cache + off + (h - num_heads) * head_stride, x, sizeof(float) * (size_t)head_dim);
        }
        if (slot >= 0)
            for (int64_t h = 0; h < num_kv_heads; h++)
                memcpy(v_cache + off + h * head_stride, row + (qk_heads + h) * head_dim,
                       sizeof(float) * (size_t)head_dim);
    }
}

/* x [num_rows, 2 * n] = (gate | up) -> out [num_rows, n] = act(gate) * up; act = SiLU, gate / (1 + exp(-gate))
 * as torch computes it, or with gelu GELU-tanh, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). */
void pdserve_act_and_mul_f32(const float *x, int64_t num_rows, int64_t n, int32_t gelu, float *out) {
#pragma omp parallel for schedule(static) if (num_rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < num_rows; t++) {
        const float *g = x + t * 2 * n, *u = g + n;
        float *o = out + t * n;
        if (gelu) {
#pragma omp simd
            for (int64_t j = 0; j < n; j++) {
                const float y = 0.7978845608028654f * (g[j] + 0.044715f * g[j] * g[j] * g[j]);
                const float th = 1.0f - 2.0f / (fast_expf(2.0f * y) + 1.0f); /* tanh(y) */
                o[j] = 0.5f * g[j] * (1.0f + th) * u[j];
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < n; j++) o[j] = g[j] / (1.0f + fast_expf(-g[j])) * u[j];
        }
    }
}
