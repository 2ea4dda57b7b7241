/* paged_prefill.c's online softmax: one step of keys folded into each softmax row's running max and sum. */
#ifndef PDSERVE_ONLINE_SOFTMAX_H
#define PDSERVE_ONLINE_SOFTMAX_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h" /* fast_expf_no_overflow: x = s - max <= 0 */

/* st [n, rows]: this step's scores S^T, keys key0 .. key0 + n - 1 down, softmax rows across; row r's query sits
 * at position pos[r] (positions as floats: exact below 2^24) and sees keys (pos[r] - window, pos[r]], window 0:
 * all up to pos[r]. Masks what a row does not see (only on a step that crosses the diagonal or a window's
 * edge), folds the step into each row's running max mx and sum, and leaves exp(s - max) (0 where masked) in st
 * for the P V product. corr[r]: the factor the row's output accumulated so far must be scaled by (0 while the
 * row has seen no key). tmp: [2 * rows] scratch. */
static void online_softmax_step(float *st, int64_t n, int64_t rows, const float *pos, int64_t key0, int64_t window,
                                float *mx, float *sum, float *corr, float *tmp) {
    float *m_use = tmp, *t = tmp + rows;
    const float w = (float)window;
    const int masked = key0 + n - 1 > pos[0] || (window > 0 && key0 <= pos[rows - 1] - w);
    memcpy(m_use, mx, sizeof(float) * (size_t)rows);
    for (int64_t j = 0; j < n; j++) { /* the running max, masking on the way where the step needs it */
        float *sj = st + j * rows;
        const float kp = (float)(key0 + j);
        if (masked) {
#pragma omp simd
            for (int64_t r = 0; r < rows; r++) {
                const float s = kp > pos[r] || (window > 0 && kp <= pos[r] - w) ? -INFINITY : sj[r];
                sj[r] = s;
                m_use[r] = s > m_use[r] ? s : m_use[r];
            }
        } else {
#pragma omp simd
            for (int64_t r = 0; r < rows; r++) m_use[r] = sj[r] > m_use[r] ? sj[r] : m_use[r];
        }
    }
#pragma omp simd
    for (int64_t r = 0; r < rows; r++) {
        const float m_new = m_use[r];
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new; /* a row that saw nothing yet: exp(-inf - 0) = 0 */
        corr[r] = fast_expf_no_overflow(mx[r] - m_use[r]); /* 0 on the row's first keys (mx = -inf) */
        mx[r] = m_new;
        t[r] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        float *sj = st + j * rows;
#pragma omp simd
        for (int64_t r = 0; r < rows; r++) {
            const float e = fast_expf_no_overflow(sj[r] - m_use[r]);
            sj[r] = e;
            t[r] += e;
        }
    }
#pragma omp simd
    for (int64_t r = 0; r < rows; r++) sum[r] = sum[r] * corr[r] + t[r];
}

#endif
