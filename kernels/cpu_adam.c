/*
 * CPU Adam / AdamW for offloaded optimizer shards.
 *
 * Why it exists: on the host the optimizer step is bound by memory bandwidth, not
 * arithmetic, so the only thing that matters is touching each byte once. One pass reads
 * param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (28 bytes per
 * fp32 param); a low-precision grad is widened in L1 and the low-precision copy of the
 * updated param (what goes to the device) is produced in the same pass and written with
 * streaming stores, so the downcast costs 2 bytes per param and no second pass.
 *
 * Numerics follow torch.optim.Adam(W)'s single-tensor path: exp_avg and exp_avg_sq op by op
 * (an explicit fma exactly where torch's lerp/addcmul/add(alpha) use one), so they come out
 * bit-identical; the param update is torch's formula too, with the division by
 * sqrt(bias_correction2) done by a correctly rounded reciprocal + FMA correction (div_bc2),
 * so params differ from torch only where torch's own vectorized sqrt is off by an ulp
 * (it is not correctly rounded; ours is). No implicit contraction (build with -ffp-contract=off): the AVX-512 body,
 * the auto-vectorized portable loop and its scalar tail perform the same IEEE operations,
 * so an element gets bit-identical results whatever the thread split.
 *
 * Threads: zo_adam_omp splits [0, n) with OpenMP (when built with -fopenmp); otherwise the
 * caller runs zo_adam_range on disjoint ranges from its own threads (ctypes drops the GIL).
 * Ranges starting on multiples of ZO_ALIGN_ELEMS keep streaming stores aligned; any split
 * is still correct.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ZO_TILE 2048     /* elements per tile: 8 KiB fp32 scratch, stays in L1/L2 */
#define ZO_ALIGN_ELEMS 64 /* thread ranges start on multiples of this */
#define ZO_PREFETCH_ELEMS 256 /* software prefetch distance: 1 KiB of each fp32 stream, into L2 */

enum { ZO_F32 = 0, ZO_BF16 = 1, ZO_F16 = 2, ZO_NONE = -1 };

/* Version of the C ABI below; the Python binding checks it. */
int zo_abi_version(void) { return 3; }

int zo_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Hyperparameters, folded by the caller in double precision like torch's Python-side math,
 * then rounded to fp32 once, in this order (ZO_NUM_HP floats). */
enum { ZO_NUM_HP = 11 };

int zo_num_hp(void) { return ZO_NUM_HP; }

typedef struct {
    float decay;          /* AdamW: 1 - lr * wd (param.mul_); else 1 */
    float l2;             /* Adam: wd (grad += wd * param); else 0 */
    float w1;             /* lerp weight 1 - beta1 */
    float one_minus_w1;   /* 1 - w1 in fp32, for w1 >= 0.5 (torch's other lerp branch) */
    float beta2;
    float one_minus_beta2;
    float eps;
    float neg_step_size;  /* -lr / (1 - beta1^step) */
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
    float inv_bc2_sqrt;   /* fp32(1 / bc2_sqrt) */
    float grad_scale;     /* the grad is multiplied by it first, in fp32 (unscale, clip) */
    int adamw;
    int lerp_small;       /* w1 < 0.5 */
} zo_hp;

/* sqrt(v) / bc2_sqrt without a divide: q = s * r, then one Newton correction with FMAs,
 * which gives the correctly rounded quotient (checked on 14M random operands against
 * true division); the divider is the scarce unit, and the step already needs it once.
 * An inf or NaN quotient keeps q, as a true division would. */
static inline float div_bc2(float s, float c, float r) {
    float q = s * r, e = fmaf(-q, c, s), q2 = fmaf(e, r, q);
    return e != e ? q : q2;
}

/* ---- conversions (exact: widening is exact, narrowing is round-to-nearest-even) ---- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, like torch */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static void narrow_bf16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

#ifdef __F16C__
static void widen_f16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(src[i]);
}

static void narrow_f16(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}
#else
/* Portable IEEE half conversions for machines without F16C. */
static float f16_to_f32_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_f16_soft(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (a < 0x38800000u) {                                    /* subnormal or zero in half */
        float m = fabsf(f) * 16777216.0f;                      /* 2^24: ulp of half subnormals */
        return (uint16_t)(sign | (uint32_t)nearbyintf(m));
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static void widen_f16(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32_soft(src[i]);
}

static void narrow_f16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16_soft(src[i]);
}
#endif

/* Copy a tile of 16-bit values to memory that is not read again soon: streaming stores
 * skip the read-for-ownership, saving 2 of the 4 bytes a plain store would move. */
static void store_stream_u16(uint16_t* dst, const uint16_t* src, int64_t n) {
#if defined(__AVX512F__)
    int64_t i = 0;
    while (i < n && ((uintptr_t)(dst + i) & 63u)) { dst[i] = src[i]; i++; }
    for (; i + 32 <= n; i += 32)
        _mm512_stream_si512((void*)(dst + i), _mm512_loadu_si512((const void*)(src + i)));
    for (; i < n; i++) dst[i] = src[i];
#elif defined(__AVX__)
    int64_t i = 0;
    while (i < n && ((uintptr_t)(dst + i) & 31u)) { dst[i] = src[i]; i++; }
    for (; i + 16 <= n; i += 16)
        _mm256_stream_si256((__m256i*)(dst + i), _mm256_loadu_si256((const __m256i*)(src + i)));
    for (; i < n; i++) dst[i] = src[i];
#else
    memcpy(dst, src, (size_t)n * 2);
#endif
}

static inline void store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* ---- the update ---- */

/* One element, exactly as the vector path computes it (same ops, same order). */
#define ZO_ADAM_ELEMENT(P, G, M, V)                                                  \
    do {                                                                             \
        float pi_ = (P), gi_ = (G) * gs, mi_ = (M), vi_;                             \
        if (adamw) pi_ = pi_ * decay; else gi_ = fmaf(l2, pi_, gi_);                 \
        mi_ = lerp_small ? fmaf(w1, gi_ - mi_, mi_) : fmaf(-omw1, gi_ - mi_, gi_);   \
        vi_ = fmaf(omb2 * gi_, gi_, (V) * b2);                                       \
        (P) = pi_ + (nss * mi_) / (div_bc2(sqrtf(vi_), bc2s, rbc2s) + eps);            \
        (M) = mi_;                                                                   \
        (V) = vi_;                                                                   \
    } while (0)

/* The tile loop for one (adamw, lerp_small) pair given as constants: GCC does not
 * vectorize a loop with a branch in it ("control flow in loop"), so each of the four
 * variants is its own branch-free loop (inlined with the flags folded). */
static inline __attribute__((always_inline)) void adam_tile_as(
        float* restrict p, const float* restrict g, float* restrict m, float* restrict v,
        int64_t n, const zo_hp* hp, const int adamw, const int lerp_small) {
    const float decay = hp->decay, l2 = hp->l2, w1 = hp->w1, omw1 = hp->one_minus_w1;
    const float b2 = hp->beta2, omb2 = hp->one_minus_beta2, eps = hp->eps;
    const float nss = hp->neg_step_size, bc2s = hp->bc2_sqrt, rbc2s = hp->inv_bc2_sqrt;
    const float gs = hp->grad_scale;
#pragma GCC ivdep
    for (int64_t i = 0; i < n; i++) ZO_ADAM_ELEMENT(p[i], g[i], m[i], v[i]);
}

/* One tile with an fp32 grad (possibly the widened scratch): plain loops the compiler
 * vectorizes for whatever -march=native offers. */
static void adam_tile(float* restrict p, const float* restrict g, float* restrict m,
                      float* restrict v, int64_t n, const zo_hp* hp) {
    if (hp->adamw) {
        if (hp->lerp_small) adam_tile_as(p, g, m, v, n, hp, 1, 1);
        else adam_tile_as(p, g, m, v, n, hp, 1, 0);
    } else {
        if (hp->lerp_small) adam_tile_as(p, g, m, v, n, hp, 0, 1);
        else adam_tile_as(p, g, m, v, n, hp, 0, 0);
    }
}

/* Portable path: tiles of widen -> update -> narrow + streaming store, all in L1. */
static void generic_range(float* p, const void* g, int g_dtype, float* m, float* v,
                          void* out, int out_dtype, int64_t begin, int64_t end,
                          const zo_hp* hp) {
    float gbuf[ZO_TILE] __attribute__((aligned(64)));
    uint16_t obuf[ZO_TILE] __attribute__((aligned(64)));
    for (int64_t i0 = begin; i0 < end; i0 += ZO_TILE) {
        int64_t n = end - i0 < ZO_TILE ? end - i0 : ZO_TILE;
        const float* gf;
        if (g_dtype == ZO_F32) {
            gf = (const float*)g + i0;
        } else {
            if (g_dtype == ZO_BF16) widen_bf16((const uint16_t*)g + i0, gbuf, n);
            else widen_f16((const uint16_t*)g + i0, gbuf, n);
            gf = gbuf;
        }
        adam_tile(p + i0, gf, m + i0, v + i0, n, hp);
        if (out_dtype == ZO_BF16 || out_dtype == ZO_F16) {
            if (out_dtype == ZO_BF16) narrow_bf16(p + i0, obuf, n);
            else narrow_f16(p + i0, obuf, n);
            store_stream_u16((uint16_t*)out + i0, obuf, n);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(ZO_SCALAR)
#define ZO_VEC_PATH "avx512"

static inline __m512 load_grad(const void* g, int g_dtype, int64_t i) {
    if (g_dtype == ZO_F32) return _mm512_loadu_ps((const float*)g + i);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)g + i));
    if (g_dtype == ZO_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* fp32 -> bf16 round-nearest-even (NaN -> 0x7fc0) for 16 lanes, result in the high
 * 16 bits of each 32-bit lane. Integer math, so denormals round exactly like torch. */
static inline __m512i bf16_rne_hi(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

/* 32 updated params -> one cache line of bf16/fp16. */
static inline __m512i narrow32(__m512 lo, __m512 hi, int out_dtype) {
    if (out_dtype == ZO_BF16) {
        const __m512i odd = _mm512_set_epi16(
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
            31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        return _mm512_permutex2var_epi16(bf16_rne_hi(lo), odd, bf16_rne_hi(hi));
    }
    const int rc = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, rc)),
                              _mm512_cvtps_ph(hi, rc), 1);
}

static inline __m512 adam_vec(float* p, __m512 g, float* m, float* v, const zo_hp* hp) {
    __m512 pv = _mm512_loadu_ps(p);
    g = _mm512_mul_ps(g, _mm512_set1_ps(hp->grad_scale));
    if (hp->adamw) pv = _mm512_mul_ps(pv, _mm512_set1_ps(hp->decay));
    else g = _mm512_fmadd_ps(_mm512_set1_ps(hp->l2), pv, g);
    __m512 mv = _mm512_loadu_ps(m);
    __m512 d = _mm512_sub_ps(g, mv);
    if (hp->lerp_small) mv = _mm512_fmadd_ps(_mm512_set1_ps(hp->w1), d, mv);
    else mv = _mm512_fnmadd_ps(_mm512_set1_ps(hp->one_minus_w1), d, g);
    __m512 vv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(hp->one_minus_beta2), g), g,
                                _mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(hp->beta2)));
    __m512 root = _mm512_sqrt_ps(vv), r = _mm512_set1_ps(hp->inv_bc2_sqrt);
    __m512 q = _mm512_mul_ps(root, r);
    __m512 e = _mm512_fnmadd_ps(q, _mm512_set1_ps(hp->bc2_sqrt), root);
    q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(e, e, _CMP_ORD_Q), q, _mm512_fmadd_ps(e, r, q));
    __m512 den = _mm512_add_ps(q, _mm512_set1_ps(hp->eps));
    pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(hp->neg_step_size), mv), den));
    _mm512_storeu_ps(p, pv);
    _mm512_storeu_ps(m, mv);
    _mm512_storeu_ps(v, vv);
    return pv;
}

/* AVX-512 path: 32 elements (one output cache line) per iteration, grads widened in
 * registers, output narrowed in registers and streamed. Head (until the output is
 * line-aligned) and tail go through the portable path, which rounds identically. */
static void adam_range(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                       int out_dtype, int64_t begin, int64_t end, const zo_hp* hp) {
    int has_out = out_dtype != ZO_NONE;
    int64_t i = begin;
    if (has_out && !((uintptr_t)out & 1u)) {
        int64_t head = (int64_t)(((64u - ((uintptr_t)((uint16_t*)out + begin) & 63u)) & 63u) / 2u);
        if (head > end - begin) head = end - begin;
        generic_range(p, g, g_dtype, m, v, out, out_dtype, begin, begin + head, hp);
        i += head;
    }
    int stream = has_out && !((uintptr_t)((uint16_t*)out + i) & 63u);
    const int g_shift = g_dtype == ZO_F32 ? 2 : 1; /* log2 bytes per grad element */
    for (; i + 32 <= end; i += 32) {
        /* Hardware prefetchers stop at 4 KiB page boundaries; a software prefetch 1 KiB
         * ahead into L2 keeps every stream's next page in flight. A page ahead into L1
         * (the earlier choice) filled half of Zen 4's 32 KiB L1 with lines not yet needed:
         * 0.89x torch's fused step there, 1.08x with this (20M fp32, 1 thread). */
        const int64_t a = i + ZO_PREFETCH_ELEMS;
        _mm_prefetch((const char*)(p + a), _MM_HINT_T1);
        _mm_prefetch((const char*)(p + a + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)(m + a), _MM_HINT_T1);
        _mm_prefetch((const char*)(m + a + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)(v + a), _MM_HINT_T1);
        _mm_prefetch((const char*)(v + a + 16), _MM_HINT_T1);
        _mm_prefetch((const char*)g + (a << g_shift), _MM_HINT_T1);
        if (g_dtype == ZO_F32) _mm_prefetch((const char*)g + (a << g_shift) + 64, _MM_HINT_T1);
        __m512 lo = adam_vec(p + i, load_grad(g, g_dtype, i), m + i, v + i, hp);
        __m512 hi = adam_vec(p + i + 16, load_grad(g, g_dtype, i + 16), m + i + 16, v + i + 16, hp);
        if (has_out) {
            __m512i o = narrow32(lo, hi, out_dtype);
            if (stream) _mm512_stream_si512((void*)((uint16_t*)out + i), o);
            else _mm512_storeu_si512((void*)((uint16_t*)out + i), o);
        }
    }
    generic_range(p, g, g_dtype, m, v, out, out_dtype, i, end, hp);
    if (has_out) store_fence();
}
#else
/* The portable loop, named after what the compiler could vectorize it with: "avx2" (with
 * FMA), "scalar" (built with -DZO_SCALAR -fno-tree-vectorize, no AVX/FMA/F16C: fmaf and
 * half conversions in software), "generic" otherwise (SSE-only x86, other architectures). */
#if defined(ZO_SCALAR)
#define ZO_VEC_PATH "scalar"
#elif defined(__AVX2__) && defined(__FMA__)
#define ZO_VEC_PATH "avx2"
#else
#define ZO_VEC_PATH "generic"
#endif

static void adam_range(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                       int out_dtype, int64_t begin, int64_t end, const zo_hp* hp) {
    generic_range(p, g, g_dtype, m, v, out, out_dtype, begin, end, hp);
    if (out_dtype != ZO_NONE) store_fence();
}
#endif

/* Which code path this build uses ("avx512", "avx2", "scalar" or "generic"), for logs,
 * benchmarks and the ISA check of the binding. */
const char* zo_vec_path(void) { return ZO_VEC_PATH; }

static int check_args(int g_dtype, int out_dtype, int64_t begin, int64_t end) {
    if (g_dtype != ZO_F32 && g_dtype != ZO_BF16 && g_dtype != ZO_F16) return 1;
    if (out_dtype != ZO_NONE && out_dtype != ZO_BF16 && out_dtype != ZO_F16) return 2;
    if (begin < 0 || end < begin) return 3;
    return 0;
}

static zo_hp make_hp(const float* v, int adamw) {
    zo_hp hp = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], adamw != 0,
                v[2] < 0.5f};
    return hp;
}

/* Update elements [begin, end). Returns 0, or a nonzero code for bad arguments (nothing
 * is touched then). Safe to call concurrently on disjoint ranges. */
int zo_adam_range(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                  int out_dtype, int64_t begin, int64_t end, const float* hpv, int adamw) {
    int rc = check_args(g_dtype, out_dtype, begin, end);
    if (rc) return rc;
    zo_hp hp = make_hp(hpv, adamw);
    adam_range(p, g, g_dtype, m, v, out, out_dtype, begin, end, &hp);
    return 0;
}

#ifdef _OPENMP
/* Split [0, n) into one aligned range per thread. */
static void thread_range(int64_t n, int t, int nt, int64_t* b, int64_t* e) {
    int64_t per = (n + nt - 1) / nt;
    per = (per + ZO_ALIGN_ELEMS - 1) / ZO_ALIGN_ELEMS * ZO_ALIGN_ELEMS;
    *b = per * t < n ? per * t : n;
    *e = per * (t + 1) < n ? per * (t + 1) : n;
}
#endif

/* Whole tensor with an OpenMP split (one thread when built without OpenMP). */
int zo_adam_omp(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                int out_dtype, int64_t n, const float* hpv, int adamw, int num_threads) {
    int rc = check_args(g_dtype, out_dtype, 0, n);
    if (rc) return rc;
    zo_hp hp = make_hp(hpv, adamw);
    int nt = num_threads > 0 ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
        int64_t b, e;
        thread_range(n, omp_get_thread_num(), omp_get_num_threads(), &b, &e);
        adam_range(p, g, g_dtype, m, v, out, out_dtype, b, e, &hp);
    }
#else
    (void)nt;
    adam_range(p, g, g_dtype, m, v, out, out_dtype, 0, n, &hp);
#endif
    return 0;
}
