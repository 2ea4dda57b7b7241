/* Shared by small_gemm.c and paged_prefill.c: R rows of x times one [K, NB] panel of w, sums in registers. */
#ifndef PDSERVE_PANEL_FMA_H
#define PDSERVE_PANEL_FMA_H
#include <stdint.h>
#include <string.h>

#define NB 32 /* columns of a panel */

/* The vectors are the machine's own width: GCC lowers a generic vector wider than the target's registers
 * through stack copies and general-purpose registers (a 64-byte vector on AVX2 made every FMA read its sum
 * from the stack and ran the panel product 4.7x slower than MKL's sgemm). A panel row is NV vectors of VW
 * floats. MR, the rows of x per pass over a panel, is as many as keep the NV x MR sums in registers: AVX-512
 * 2 x 8 of its 32 beside the panel's 2; with 16 registers (AVX2) 4 x 3, the broadcast element and the
 * panel taken from memory as the FMAs' operand. */
#ifdef __AVX512F__
#define VW 16
#define MR 8
#else
#define VW 8
#define MR 3
#endif
#define NV (NB / VW)

typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline __attribute__((always_inline)) vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* acc[R, NB] (row stride ldacc) = (accumulate ? acc : 0) + x[R, K] w[K, NB] (row stride ldw), x's element
 * (m, k) at x[m * ldx + k * ldxk]. R <= MR and accumulate are constants after inlining, so the NV x R partial
 * sums stay in registers; each step over k loads NV vectors of w and feeds them to NV x R fused multiply-adds
 * with x's broadcast element.
 * Summation runs over k in order. */
static inline __attribute__((always_inline)) void panel_fma(const float *x, int64_t ldx, int64_t ldxk, const int R,
                                                            const float *w, int64_t ldw, int64_t K, float *acc,
                                                            int64_t ldacc, const int accumulate) {
    vf a[MR][NV];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NV; j++) a[m][j] = accumulate ? vload(acc + m * ldacc + j * VW) : (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf wk[NV];
        for (int j = 0; j < NV; j++) wk[j] = vload(w + k * ldw + j * VW);
        for (int m = 0; m < R; m++) {
            const float xv = x[m * ldx + k * ldxk];
            for (int j = 0; j < NV; j++) a[m][j] += xv * wk[j];
        }
    }
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NV; j++) vstore(acc + m * ldacc + j * VW, a[m][j]);
}

/* panel_fma with R given at run time (1..MR): one constant-R copy per case. */
static inline __attribute__((always_inline)) void panel_fma_rows(const float *x, int64_t ldx, int64_t ldxk,
                                                                 int64_t R, const float *w, int64_t ldw, int64_t K,
                                                                 float *acc, int64_t ldacc, const int accumulate) {
    switch (R) { /* no case above MR: its constant R would index past the sums */
        case 1: panel_fma(x, ldx, ldxk, 1, w, ldw, K, acc, ldacc, accumulate); break;
        case 2: panel_fma(x, ldx, ldxk, 2, w, ldw, K, acc, ldacc, accumulate); break;
#if MR > 3
        case 3: panel_fma(x, ldx, ldxk, 3, w, ldw, K, acc, ldacc, accumulate); break;
        case 4: panel_fma(x, ldx, ldxk, 4, w, ldw, K, acc, ldacc, accumulate); break;
        case 5: panel_fma(x, ldx, ldxk, 5, w, ldw, K, acc, ldacc, accumulate); break;
        case 6: panel_fma(x, ldx, ldxk, 6, w, ldw, K, acc, ldacc, accumulate); break;
        case 7: panel_fma(x, ldx, ldxk, 7, w, ldw, K, acc, ldacc, accumulate); break;
#endif
        default: panel_fma(x, ldx, ldxk, MR, w, ldw, K, acc, ldacc, accumulate); break;
    }
}

#endif
