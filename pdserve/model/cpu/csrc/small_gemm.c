/* y = x W^T (+ bias) for a few rows of x, from W packed in column panels: the decode step's linears.
 *
 * MKL's sgemm packs its right operand on every call; at a handful of rows that doubles the weight traffic and
 * the step is bound by it (a batch-8 decode step of the built-in model streams ~420 MB of linear weights:
 * 37.7 ms through F.linear, 28.4 ms here; at one row both are at the memory's speed). Here W is packed once at
 * load time (linear.pack) into P = ceil(N / NB) panels of [K, NB] floats, zero-padded past N, so each
 * thread streams its panels front to back exactly once and keeps MR x NB partial sums in registers (MR rows of
 * x, NB floats: panel_fma.h sizes both to the registers). Rows past MR re-read the panel from L2.
 *
 * Summation runs over k in order with fused multiply-adds: the result differs from MKL's in the last bits
 * (as MKL's own 1-row and 8-row results do), not in the tokens (tests/model/test_cpu_linear.py).
 */
#pragma GCC optimize("fp-contract=fast") /* FMA contraction: -std=c99 turns it off */
#pragma GCC target("prefer-vector-width=512")
#include <stddef.h>
#include <stdint.h>

#include "panel_fma.h" /* NB, MR, panel_fma_rows */

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
            panel_fma_rows(xm, ldx, 1, r, w, NB, K, out, NB, 0);
            for (int64_t m = 0; m < r; m++) {
                float *ym = y + (m0 + m) * ldy + n0;
                for (int64_t j = 0; j < nn; j++) ym[j] = out[m * NB + j] + (bias != NULL ? bias[n0 + j] : 0.0f);
            }
        }
    }
}
