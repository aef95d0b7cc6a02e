/*
 * The ceiling for a CPU Adam step: Adam's memory traffic with trivial arithmetic.
 *
 * Why: the step is bound by memory bandwidth, and this host's bandwidth changes minute to
 * minute, so a benchmark reports the step as a fraction of this kernel measured in the same
 * run, on the same threads. It reads four fp32 arrays and writes three of them back in
 * place (28 bytes per element, like param/grad/exp_avg/exp_avg_sq). Values contract towards
 * d, so they stay bounded: no denormals or infs slow it down.
 */
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ZO_ALIGN_ELEMS 64
#define ZO_PREFETCH_ELEMS 256

static void traffic_tail(float* restrict a, float* restrict b, float* restrict c,
                         const float* restrict d, int64_t begin, int64_t end) {
    const float s = 0.5f;
#pragma GCC ivdep
    for (int64_t i = begin; i < end; i++) {
        float di = d[i];
        a[i] = a[i] * s + di;
        b[i] = b[i] * s + di;
        c[i] = c[i] * s + di * di;
    }
}

static void traffic_range(float* restrict a, float* restrict b, float* restrict c,
                          const float* restrict d, int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__)
    /* the same loop shape and software prefetch as the Adam kernel: a tuned ceiling */
    const __m512 s = _mm512_set1_ps(0.5f);
    for (; i + 32 <= end; i += 32) {
        const int64_t k = i + ZO_PREFETCH_ELEMS;
        _mm_prefetch((const char*)(a + k), _MM_HINT_T1);
        _mm_prefetch((const char*)(a + k + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)(b + k), _MM_HINT_T1);
        _mm_prefetch((const char*)(b + k + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)(c + k), _MM_HINT_T1);
        _mm_prefetch((const char*)(c + k + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)(d + k), _MM_HINT_T1);
        _mm_prefetch((const char*)(d + k + 16), _MM_HINT_T1);
        for (int h = 0; h < 32; h += 16) {
            __m512 dv = _mm512_loadu_ps(d + i + h);
            _mm512_storeu_ps(a + i + h, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(a + i + h), s), dv));
            _mm512_storeu_ps(b + i + h, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(b + i + h), s), dv));
            _mm512_storeu_ps(c + i + h, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(c + i + h), s),
                                                      _mm512_mul_ps(dv, dv)));
        }
    }
#endif
    traffic_tail(a, b, c, d, i, end);
}

int zo_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Elements [begin, end); callers may run disjoint ranges on their own threads. */
int zo_traffic_range(float* a, float* b, float* c, const float* d, int64_t begin, int64_t end) {
    if (begin < 0 || end < begin) return 3;
    traffic_range(a, b, c, d, begin, end);
    return 0;
}

/* Whole arrays with the same OpenMP split as zo_adam_omp. */
int zo_traffic_omp(float* a, float* b, float* c, const float* d, int64_t n, int num_threads) {
    if (n < 0) return 3;
    int nt = num_threads > 0 ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        int64_t per = (n + k - 1) / k;
        per = (per + ZO_ALIGN_ELEMS - 1) / ZO_ALIGN_ELEMS * ZO_ALIGN_ELEMS;
        int64_t lo = per * t < n ? per * t : n, hi = per * (t + 1) < n ? per * (t + 1) : n;
        traffic_range(a, b, c, d, lo, hi);
    }
#else
    (void)nt;
    traffic_range(a, b, c, d, 0, n);
#endif
    return 0;
}
