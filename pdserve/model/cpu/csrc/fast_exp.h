/* Shared by the CPU kernels' sources (layer_ops.c, paged_decode.c, online_softmax.h): a vectorizable exp. */
#ifndef PDSERVE_FAST_EXP_H
#define PDSERVE_FAST_EXP_H
#include <math.h>
#include <stdint.h>

/* exp(x) in plain float arithmetic the compiler vectorizes (glibc's expf is scalar without -ffast-math, and a
 * 512-token prefill's SiLU takes 786k of them per layer): 2^n * e^r with |r| <= ln2 / 2, e^r a degree-6
 * polynomial (Cephes expf's coefficients), ~1 ulp. Above ln(FLT_MAX): +inf; below -86.5: 0 (the true value is
 * under 2.7e-38, and every caller adds it to 1). n is rounded with the 1.5 * 2^23 trick: floorf does not
 * vectorize without -ffast-math, and this file's float results must not depend on fast-math. GCC 12 vectorizes
 * the selects only with -fno-trapping-math (paged_prefill.c sets it; the values are the same either way). The
 * softmax's x = s - max <= 0 takes fast_expf_no_overflow, two selects fewer. */
static inline float fast_expf_no_overflow(float x) { /* fast_expf for x <= ln(FLT_MAX) (-inf included) */
    const float lo = -86.5f;
    const int under = x < lo;
    x = x < lo ? lo : x;
    const float magic = 12582912.0f;                           /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + magic) - magic; /* round(x / ln2), in [-125, 128] */
    float r = x - n * 0.693359375f; /* ln2 split in two: n * 0.693359375 is exact */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 126) << 23; /* 2^(n - 1), a normal float for n in [-125, 128] */
    const float y = p * scale.f * 2.0f;
    return under ? 0.0f : y;
}

static inline float fast_expf(float x) {
    const float hi = 88.72283905206835f; /* ln(FLT_MAX) */
    return x > hi ? INFINITY : fast_expf_no_overflow(x);
}

#endif
