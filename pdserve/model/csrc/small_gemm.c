/* y = x W^T (+ bias) for a few rows of x, from W packed in column panels: the decode step's linears.
 *
 * MKL's sgemm packs its right operand on every call; at a handful of rows that doubles the weight traffic and
 * the step is bound by it (a batch-8 decode step of the built-in model streams ~420 MB of linear weights:
 * 37.7 ms through F.linear, 28.4 ms here; at one row both are at the memory's speed). Here W is packed once at
 * load time (cpu_linear.pack) into P = ceil(N / NB) panels of [K, NB] floats, zero-padded past N, so each
 * thread streams its panels front to back exactly once and keeps MR x NB partial sums in registers (MR rows of
 * x, NB = 2 x 16 floats: 16 AVX-512 accumulators). Rows past MR re-read the panel from L2.
 *
 * Summation runs over k in order with fused multiply-adds: the result differs from MKL's in the last bits
 * (as MKL's own 1-row and 8-row results do), not in the tokens (tests/model/test_cpu_linear.py).
 */
#pragma GCC optimize("fp-contract=fast") /* FMA contraction: -std=c99 turns it off */
#pragma GCC target("prefer-vector-width=512")
#include <stdint.h>
#include <string.h>

#define NB 32 /* columns of a panel: two 512-bit vectors of float32 */
#define MR 8  /* rows of x per pass over a panel */

typedef float v16f __attribute__((vector_size(64)));

/* out[R, NB] = x[R, K] (row stride ldx) times one panel w[K, NB]; R is a constant after inlining, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t ldx, const int R,
                                                             const float *w, int64_t K, float *out) {
    v16f a0[MR], a1[MR];
    for (int m = 0; m < R; m++) a0[m] = a1[m] = (v16f){0};
    for (int64_t k = 0; k < K; k++) {
        v16f w0, w1;
        memcpy(&w0, w + k * NB, sizeof w0);
        memcpy(&w1, w + k * NB + 16, sizeof w1);
        for (int m = 0; m < R; m++) {
            const float xv = x[m * ldx + k];
            a0[m] += xv * w0;
            a1[m] += xv * w1;
        }
    }
    for (int m = 0; m < R; m++) {
        memcpy(out + m * NB, &a0[m], sizeof a0[m]);
        memcpy(out + m * NB + 16, &a1[m], sizeof a1[m]);
    }
}

int64_t pdserve_linear_panel_width(void) { return NB; }

/* x: [M, K] (row stride ldx, unit column stride); wp: [P, K, NB] packed; bias: [N] or NULL;
 * y: [M, N] (row stride ldy). Panels are split over OpenMP threads. */
void pdserve_linear_panels_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N,
                               const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const float *w = wp + p * K * NB;
        const int64_t n0 = p * NB, nn = N - n0 < NB ? N - n0 : NB;
        float out[MR * NB];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t r = M - m0 < MR ? M - m0 : MR;
            const float *xm = x + m0 * ldx;
            switch (r) {
                case 1: panel_rows(xm, ldx, 1, w, K, out); break;
                case 2: panel_rows(xm, ldx, 2, w, K, out); break;
                case 3: panel_rows(xm, ldx, 3, w, K, out); break;
                case 4: panel_rows(xm, ldx, 4, w, K, out); break;
                case 5: panel_rows(xm, ldx, 5, w, K, out); break;
                case 6: panel_rows(xm, ldx, 6, w, K, out); break;
                case 7: panel_rows(xm, ldx, 7, w, K, out); break;
                default: panel_rows(xm, ldx, MR, w, K, out); break;
            }
            for (int64_t m = 0; m < r; m++) {
                float *ym = y + (m0 + m) * ldy + n0;
                for (int64_t j = 0; j < nn; j++) ym[j] = out[m * NB + j] + (bias != NULL ? bias[n0 + j] : 0.0f);
            }
        }
    }
}
