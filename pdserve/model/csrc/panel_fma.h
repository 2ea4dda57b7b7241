/* Shared by small_gemm.c and paged_prefill.c: R rows of x times one [K, NB] panel of w, sums in registers. */
#ifndef PDSERVE_PANEL_FMA_H
#define PDSERVE_PANEL_FMA_H
#include <stdint.h>
#include <string.h>

#define NB 32 /* columns of a panel: two 512-bit vectors of float32 */
#define MR 8  /* rows of x per pass over a panel: 2 x MR accumulators + 2 panel vectors fit AVX-512's 32 */

typedef float v16f __attribute__((vector_size(64)));

/* acc[R, NB] (row stride ldacc) = (accumulate ? acc : 0) + x[R, K] w[K, NB] (row stride ldw), x's element
 * (m, k) at x[m * ldx + k * ldxk]. R <= MR and accumulate are constants after inlining, so the 2 x R partial sums stay in registers; each step
 * over k loads two vectors of w and feeds them to 2 x R fused multiply-adds with x's broadcast element.
 * Summation runs over k in order. */
static inline __attribute__((always_inline)) void panel_fma(const float *x, int64_t ldx, int64_t ldxk, const int R,
                                                            const float *w, int64_t ldw, int64_t K, float *acc,
                                                            int64_t ldacc, const int accumulate) {
    v16f a0[MR], a1[MR];
    for (int m = 0; m < R; m++) {
        if (accumulate) {
            memcpy(&a0[m], acc + m * ldacc, sizeof a0[m]);
            memcpy(&a1[m], acc + m * ldacc + 16, sizeof a1[m]);
        } else {
            a0[m] = a1[m] = (v16f){0};
        }
    }
    for (int64_t k = 0; k < K; k++) {
        v16f w0, w1;
        memcpy(&w0, w + k * ldw, sizeof w0);
        memcpy(&w1, w + k * ldw + 16, sizeof w1);
        for (int m = 0; m < R; m++) {
            const float xv = x[m * ldx + k * ldxk];
            a0[m] += xv * w0;
            a1[m] += xv * w1;
        }
    }
    for (int m = 0; m < R; m++) {
        memcpy(acc + m * ldacc, &a0[m], sizeof a0[m]);
        memcpy(acc + m * ldacc + 16, &a1[m], sizeof a1[m]);
    }
}

/* panel_fma with R given at run time (1..MR): one constant-R copy per case. */
static inline __attribute__((always_inline)) void panel_fma_rows(const float *x, int64_t ldx, int64_t ldxk,
                                                                 int64_t R, const float *w, int64_t ldw, int64_t K,
                                                                 float *acc, int64_t ldacc, const int accumulate) {
    switch (R) {
        case 1: panel_fma(x, ldx, ldxk, 1, w, ldw, K, acc, ldacc, accumulate); break;
        case 2: panel_fma(x, ldx, ldxk, 2, w, ldw, K, acc, ldacc, accumulate); break;
        case 3: panel_fma(x, ldx, ldxk, 3, w, ldw, K, acc, ldacc, accumulate); break;
        case 4: panel_fma(x, ldx, ldxk, 4, w, ldw, K, acc, ldacc, accumulate); break;
        case 5: panel_fma(x, ldx, ldxk, 5, w, ldw, K, acc, ldacc, accumulate); break;
        case 6: panel_fma(x, ldx, ldxk, 6, w, ldw, K, acc, ldacc, accumulate); break;
        case 7: panel_fma(x, ldx, ldxk, 7, w, ldw, K, acc, ldacc, accumulate); break;
        default: panel_fma(x, ldx, ldxk, MR, w, ldw, K, acc, ldacc, accumulate); break;
    }
}

#endif
