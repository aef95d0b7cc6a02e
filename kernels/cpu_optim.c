/*
 * CPU optimizer steps for every state precision: AdamW / Adam / Lion / Adagrad with fp32,
 * bf16 or 8-bit blockwise moments and an fp32, bf16+Kahan or bf16 stochastically rounded
 * master (zero_offload/optim/policy.py says what each is).
 *
 * Why it is written this way: the step is bound by memory bandwidth, so each state byte is
 * read and written once. A work row (zero_offload/optim/layout.py) is a run of elements
 * stored alike; an 8-bit row is processed a block (256 elements) at a time: codes are
 * dequantized in registers, the block's new moments go to a 1 KiB scratch in L1 while the
 * master and the low-precision param are written, then the block's new absmax is known and
 * the scratch is quantized back to codes (the AVX-512 VBMI path quantizes one block while it
 * updates the next). Grads are widened and params narrowed in the same pass.
 *
 * Exactness: the vector paths (AVX2 + FMA, 8 lanes; AVX-512 F/BW/DQ/VL, 16 lanes, where
 * -march=native has it) and the scalar reference perform the same IEEE operations in the same
 * order (explicit fmaf where the vector paths fuse; build with -ffp-contract=off), the block
 * absmax is an exact max (any order gives it), quantization uses the exact
 * decision points computed by the binding, and stochastic rounding draws its bits from a
 * hash of (stream key, element index): every path, thread split and row cut gives the same
 * bits (NaN inputs aside).
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

#define ZO_BLOCK 256
#define ZO_ROW_FIELDS 5

enum { ZO_F32 = 0, ZO_BF16 = 1, ZO_F16 = 2, ZO_NONE = -1 };
enum { K_ADAMW = 0, K_ADAM = 1, K_LION = 2, K_ADAGRAD = 3 };
enum { MOM_F32 = 0, MOM_BF16 = 1, MOM_INT8 = 2 };
enum { MA_F32 = 0, MA_KAHAN = 1, MA_SR = 2 };
enum { NUM_SCALARS = 13 };
/* pointer slots of one span's state (zo_ptrs in the binding) */
enum { P_MASTER, P_COMP, P_GRAD, P_OUT, P_M, P_V, P_M_ABSMAX, P_V_ABSMAX, P_M_SIDE, P_V_SIDE, NUM_PTRS };

int zo_optim_abi_version(void) { return 2; }
int zo_optim_num_scalars(void) { return NUM_SCALARS; }
int zo_optim_num_ptrs(void) { return NUM_PTRS; }

int zo_optim_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* A quantization map: 256 values ascending, and the lookup that finds a value's code. The
 * binding builds `lut`: for |x| bits folded into buckets of 2^shift (tiny magnitudes below
 * 2^-23 into bucket 0), each entry is base << 20 | t; the code is base + (low >= t) where low
 * is x's bits within the bucket (mirrored for negatives, so it grows with x). */
typedef struct {
    const float* values;
    const uint32_t* lut;
    int32_t shift;
    int32_t buckets; /* per sign; negatives use lut[buckets + bucket] */
    /* the AVX-512 VBMI path's tables (zero_offload/optim/quant.py builds them) */
    const uint8_t* value_planes; /* byte_planes(values) */
    const uint8_t* thr_planes;   /* byte_planes(threshold_words) */
    const float* lines;          /* span_lines */
    float neg_k;                 /* negative_offset */
} zo_qmap;

#define ZO_MAG0 0x34000000u /* bits of 2^-23: smaller magnitudes are all "zero" */
#define ZO_MAG1 0x3F800000u /* bits of 1.0: normalized values never exceed it */

typedef struct {
    int kind, moments, master, g_dtype, out_dtype, decoupled, lerp_small;
    float decay, l2, w1, omw1, b1, omb1, b2, omb2, eps, nss, bc2s, rbc2s, gs;
    uint32_t key_master, key_m;
    int64_t index_base;
    const zo_qmap* qm;
    const zo_qmap* qv;
} zo_cfg;

/* ---------------------------------------------------------------- scalar building blocks */

static inline __attribute__((always_inline)) uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline __attribute__((always_inline)) float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) uint32_t fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

/* stochastic rounding: add 16 random bits r below bf16's mantissa, truncate */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16_sr(float f, uint32_t r) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

#ifndef __F16C__
static float f16_to_f32_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return u2f(u);
}

static uint16_t f32_to_f16_soft(float f) {
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {
        float m = fabsf(f) * 16777216.0f;
        return (uint16_t)(sign | (uint32_t)nearbyintf(m));
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

#endif

static inline __attribute__((always_inline)) float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_f32_soft(h);
#endif
}

static inline __attribute__((always_inline)) uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return f32_to_f16_soft(f);
#endif
}

static inline __attribute__((always_inline)) float load_grad1(const void* g, int dt, int64_t i) {
    if (dt == ZO_F32) return ((const float*)g)[i];
    if (dt == ZO_BF16) return bf16_to_f32(((const uint16_t*)g)[i]);
    return f16_to_f32(((const uint16_t*)g)[i]);
}

static inline __attribute__((always_inline)) uint8_t quantize1(float x, const zo_qmap* q) {
    uint32_t b = f2u(x), sign = b >> 31, mag = b & 0x7fffffffu;
    const uint32_t low_mask = (1u << q->shift) - 1u;
    const uint32_t top = ZO_MAG1 - ZO_MAG0 + (1u << q->shift);
    mag = mag < ZO_MAG0 ? 0u : mag - ZO_MAG0 + (1u << q->shift);
    mag = mag > top ? top : mag;
    uint32_t low = mag & low_mask, t = (mag >> q->shift) + (sign ? (uint32_t)q->buckets : 0u);
    low = sign ? low_mask - low : low;
    uint32_t e = q->lut[t];
    return (uint8_t)((e >> 20) + (low >= (e & 0xfffffu)));
}

/* sqrt(v) / bc2_sqrt by reciprocal + one FMA correction (correctly rounded), as cpu_adam.c */
static inline __attribute__((always_inline)) float div_bc2(float s, float c, float r) {
    float q = s * r, e = fmaf(-q, c, s), q2 = fmaf(e, r, q);
    return e != e ? q : q2;
}

/* One element's update on fp32 values; m, v (or Adagrad's sum in m) in and out. */
static inline __attribute__((always_inline)) float update1(const zo_cfg* c, float p, float g, float* m, float* v) {
    g = g * c->gs;
    if (c->kind == K_LION) {
        p = p * c->decay;
        float u = fmaf(c->omb1, g, *m * c->b1);
        float s = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
        p = fmaf(c->nss, s, p);
        *m = fmaf(c->omb2, g, *m * c->b2);
        return p;
    }
    if (c->kind == K_ADAGRAD) {
        g = fmaf(c->l2, p, g);
        float s = fmaf(g, g, *m);
        *m = s;
        return p + (c->nss * g) / (sqrtf(s) + c->eps);
    }
    if (c->decoupled) p = p * c->decay;
    else g = fmaf(c->l2, p, g);
    float mi = *m, d = g - mi;
    mi = c->lerp_small ? fmaf(c->w1, d, mi) : fmaf(-c->omw1, d, g);
    float vi = fmaf(c->omb2 * g, g, *v * c->b2);
    *m = mi;
    *v = vi;
    return p + (c->nss * mi) / (div_bc2(sqrtf(vi), c->bc2s, c->rbc2s) + c->eps);
}

static inline __attribute__((always_inline)) float load_master1(const zo_cfg* c, void* const* P, int64_t i) {
    if (c->master == MA_F32) return ((const float*)P[P_MASTER])[i];
    float p = bf16_to_f32(((const uint16_t*)P[P_MASTER])[i]);
    if (c->master == MA_KAHAN) p = p + bf16_to_f32(((const uint16_t*)P[P_COMP])[i]);
    return p;
}

/* Store the new master (and compensation), and the param in the out dtype. */
static inline __attribute__((always_inline)) void store_master1(const zo_cfg* c, void* const* P, int64_t i, float p) {
    float val = p;
    uint16_t hi = 0;
    if (c->master == MA_F32) {
        ((float*)P[P_MASTER])[i] = p;
    } else {
        if (c->master == MA_KAHAN) {
            hi = f32_to_bf16(p);
            float hf = bf16_to_f32(hi);
            uint16_t lo = f32_to_bf16(p - hf);
            ((uint16_t*)P[P_COMP])[i] = lo;
            val = hf + bf16_to_f32(lo);
        } else {
            hi = f32_to_bf16_sr(p, fmix32((uint32_t)(c->index_base + i) ^ c->key_master));
            val = bf16_to_f32(hi);
        }
        ((uint16_t*)P[P_MASTER])[i] = hi;
    }
    if (c->out_dtype == ZO_BF16)
        ((uint16_t*)P[P_OUT])[i] = c->master == MA_F32 ? f32_to_bf16(val) : hi;
    else if (c->out_dtype == ZO_F16)
        ((uint16_t*)P[P_OUT])[i] = f32_to_f16(val);
    else if (c->out_dtype == ZO_F32)
        ((float*)P[P_OUT])[i] = val;
}

static inline __attribute__((always_inline)) float load_moment1(int prec, const void* a, int64_t i) {
    return prec == MOM_F32 ? ((const float*)a)[i] : bf16_to_f32(((const uint16_t*)a)[i]);
}

static inline __attribute__((always_inline)) void store_moment1(int prec, void* a, int64_t i, float x, uint32_t r) {
    if (prec == MOM_F32) ((float*)a)[i] = x;
    else ((uint16_t*)a)[i] = f32_to_bf16_sr(x, r);
}

static inline __attribute__((always_inline)) int two_moments(const zo_cfg* c) { return c->kind == K_ADAMW || c->kind == K_ADAM; }

/* Elements [a, b) of a row with dense (fp32 / bf16) moments, or an 8-bit layout's fp32 side
 * moments (side: moment index of element a, or -1 for dense). */
static inline __attribute__((always_inline)) void dense_scalar(const zo_cfg* c, void* const* P, int64_t a, int64_t b, int64_t side) {
    const int two = two_moments(c);
    const int prec = side >= 0 ? MOM_F32 : c->moments;
    void* ma = side >= 0 ? (void*)((float*)P[P_M_SIDE] + side - a) : P[P_M];
    void* va = !two ? NULL : side >= 0 ? (void*)((float*)P[P_V_SIDE] + side - a) : P[P_V];
    for (int64_t i = a; i < b; i++) {
        float m = load_moment1(prec, ma, i), v = two ? load_moment1(prec, va, i) : 0.0f;
        float p = update1(c, load_master1(c, P, i), load_grad1(P[P_GRAD], c->g_dtype, i), &m, &v);
        store_master1(c, P, i, p);
        /* one hash per element rounds both moments: m takes its low half, v its high */
        uint32_t r = prec == MOM_BF16 ? fmix32((uint32_t)(c->index_base + i) ^ c->key_m) : 0u;
        store_moment1(prec, ma, i, m, r);
        if (two) store_moment1(prec, va, i, v, r >> 16);
    }
}

/* Pass 1 of an 8-bit block, elements [a, b) (j0: a's position in the block's scratch,
 * which holds the map values of the old codes and receives the new moments). */
static inline __attribute__((always_inline)) void block_scalar(const zo_cfg* c, void* const* P, int64_t a, int64_t b, int j0,
                         float am_m, float am_v, float* sm, float* sv, float* mx_m, float* mx_v) {
    const int two = two_moments(c);
    for (int64_t i = a; i < b; i++) {
        int j = j0 + (int)(i - a);
        float m = sm[j] * am_m;
        float v = two ? sv[j] * am_v : 0.0f;
        float p = update1(c, load_master1(c, P, i), load_grad1(P[P_GRAD], c->g_dtype, i), &m, &v);
        store_master1(c, P, i, p);
        sm[j] = m;
        float am = fabsf(m);
        *mx_m = am > *mx_m ? am : *mx_m;
        if (two) {
            sv[j] = v;
            float av = fabsf(v);
            *mx_v = av > *mx_v ? av : *mx_v;
        }
    }
}

static inline __attribute__((always_inline)) void quantize_scalar(const float* s, int n, float inv, const zo_qmap* q, uint8_t* out) {
    for (int j = 0; j < n; j++) out[j] = quantize1(s[j] * inv, q);
}

/* ---------------------------------------------------------------- the vector path (AVX2) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(ZO_SCALAR)
#define ZO_VECTOR 1

static inline __attribute__((always_inline)) __m256i iota8(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }

static inline __attribute__((always_inline)) __m256i fmix32_v(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x85ebca6bu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xc2b2ae35u));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* 8 x u32 (each <= 0xffff) -> 8 x u16 */
static inline __attribute__((always_inline)) __m128i pack16(__m256i x) {
    __m256i p = _mm256_packus_epi32(x, x);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

static inline __attribute__((always_inline)) __m256i nan_to_bf16(__m256 x, __m256i r) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}

/* x rounded to the nearest bf16 (ties to even), in 32-bit lanes (each <= 0xffff) */
static inline __attribute__((always_inline)) __m256i bf16_rne32_v(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return nan_to_bf16(x, r);
}

static inline __attribute__((always_inline)) __m128i bf16_rne_v(__m256 x) { return pack16(bf16_rne32_v(x)); }

/* x stochastically rounded to bf16 by 16 random bits of h, in 32-bit lanes (each <= 0xffff) */
static inline __attribute__((always_inline)) __m256i bf16_sr32_v(__m256 x, __m256i h) {
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(h, _mm256_set1_epi32(0xffff))), 16);
    return nan_to_bf16(x, r);
}

static inline __attribute__((always_inline)) __m128i bf16_sr_v(__m256 x, __m256i h) { return pack16(bf16_sr32_v(x, h)); }

/* 16 bf16 values from two 8-lane halves (bf16_sr32_v's): one pack, one permute, one store */
static inline __attribute__((always_inline)) void store_bf16x16(void* a, int64_t i, __m256i lo, __m256i hi) {
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256((__m256i*)((uint16_t*)a + i), p);
}

static inline __attribute__((always_inline)) __m256 widen_bf16_v(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m256 load_grad_v(const void* g, int dt, int64_t i) {
    if (dt == ZO_F32) return _mm256_loadu_ps((const float*)g + i);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)g + i));
    return dt == ZO_BF16 ? widen_bf16_v(h) : _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) __m256 load_master_v(const zo_cfg* c, void* const* P, int64_t i) {
    if (c->master == MA_F32) return _mm256_loadu_ps((const float*)P[P_MASTER] + i);
    __m256 p = widen_bf16_v(_mm_loadu_si128((const __m128i*)((const uint16_t*)P[P_MASTER] + i)));
    if (c->master == MA_KAHAN)
        p = _mm256_add_ps(p, widen_bf16_v(_mm_loadu_si128((const __m128i*)((const uint16_t*)P[P_COMP] + i))));
    return p;
}

/* bf16 params out of an fp32 master: stored by dense_range, 16 at a time */
static inline __attribute__((always_inline)) int bf16_out_of_f32(const zo_cfg* c) {
    return c->master == MA_F32 && c->out_dtype == ZO_BF16;
}

/* idx: the 8 elements' indices, index_base + i + lane (the stochastic rounding's counter);
 * out_by_caller: bf16 params out of an fp32 master are left to the caller */
static inline __attribute__((always_inline)) void store_master_v(const zo_cfg* c, void* const* P, int64_t i, __m256i idx, __m256 p,
                                                                 const int out_by_caller) {
    __m256 val = p;
    __m128i hi = _mm_setzero_si128();
    if (c->master == MA_F32) {
        _mm256_storeu_ps((float*)P[P_MASTER] + i, p);
    } else {
        if (c->master == MA_KAHAN) {
            hi = bf16_rne_v(p);
            __m256 hf = widen_bf16_v(hi);
            __m128i lo = bf16_rne_v(_mm256_sub_ps(p, hf));
            _mm_storeu_si128((__m128i*)((uint16_t*)P[P_COMP] + i), lo);
            val = _mm256_add_ps(hf, widen_bf16_v(lo));
        } else {
            hi = bf16_sr_v(p, fmix32_v(_mm256_xor_si256(idx, _mm256_set1_epi32((int)c->key_master))));
            val = widen_bf16_v(hi);
        }
        _mm_storeu_si128((__m128i*)((uint16_t*)P[P_MASTER] + i), hi);
    }
    if (out_by_caller && bf16_out_of_f32(c)) return;
    if (c->out_dtype == ZO_BF16)
        _mm_storeu_si128((__m128i*)((uint16_t*)P[P_OUT] + i), c->master == MA_F32 ? bf16_rne_v(val) : hi);
    else if (c->out_dtype == ZO_F16)
        _mm_storeu_si128((__m128i*)((uint16_t*)P[P_OUT] + i), _mm256_cvtps_ph(val, _MM_FROUND_TO_NEAREST_INT));
    else if (c->out_dtype == ZO_F32)
        _mm256_storeu_ps((float*)P[P_OUT] + i, val);
}

/* update1 for 8 lanes: the same operations in the same order */
static inline __attribute__((always_inline)) __m256 update_v(const zo_cfg* c, __m256 p, __m256 g, __m256* m, __m256* v) {
    g = _mm256_mul_ps(g, _mm256_set1_ps(c->gs));
    if (c->kind == K_LION) {
        p = _mm256_mul_ps(p, _mm256_set1_ps(c->decay));
        __m256 u = _mm256_fmadd_ps(_mm256_set1_ps(c->omb1), g, _mm256_mul_ps(*m, _mm256_set1_ps(c->b1)));
        __m256 z = _mm256_setzero_ps();
        __m256 s = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_GT_OQ), _mm256_set1_ps(1.0f)),
                                _mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_LT_OQ), _mm256_set1_ps(-1.0f)));
        p = _mm256_fmadd_ps(_mm256_set1_ps(c->nss), s, p);
        *m = _mm256_fmadd_ps(_mm256_set1_ps(c->omb2), g, _mm256_mul_ps(*m, _mm256_set1_ps(c->b2)));
        return p;
    }
    if (c->kind == K_ADAGRAD) {
        g = _mm256_fmadd_ps(_mm256_set1_ps(c->l2), p, g);
        __m256 s = _mm256_fmadd_ps(g, g, *m);
        *m = s;
        __m256 den = _mm256_add_ps(_mm256_sqrt_ps(s), _mm256_set1_ps(c->eps));
        return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->nss), g), den));
    }
    if (c->decoupled) p = _mm256_mul_ps(p, _mm256_set1_ps(c->decay));
    else g = _mm256_fmadd_ps(_mm256_set1_ps(c->l2), p, g);
    __m256 mi = *m, d = _mm256_sub_ps(g, mi);
    mi = c->lerp_small ? _mm256_fmadd_ps(_mm256_set1_ps(c->w1), d, mi)
                       : _mm256_fnmadd_ps(_mm256_set1_ps(c->omw1), d, g);
    __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c->omb2), g), g,
                                _mm256_mul_ps(*v, _mm256_set1_ps(c->b2)));
    *m = mi;
    *v = vi;
    __m256 root = _mm256_sqrt_ps(vi), r = _mm256_set1_ps(c->rbc2s);
    __m256 q = _mm256_mul_ps(root, r);
    __m256 e = _mm256_fnmadd_ps(q, _mm256_set1_ps(c->bc2s), root);
    q = _mm256_blendv_ps(q, _mm256_fmadd_ps(e, r, q), _mm256_cmp_ps(e, e, _CMP_ORD_Q));
    __m256 den = _mm256_add_ps(q, _mm256_set1_ps(c->eps));
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->nss), mi), den));
}

static inline __attribute__((always_inline)) __m256 load_moment_v(int prec, const void* a, int64_t i) {
    if (prec == MOM_F32) return _mm256_loadu_ps((const float*)a + i);
    return widen_bf16_v(_mm_loadu_si128((const __m128i*)((const uint16_t*)a + i)));
}

static inline __attribute__((always_inline)) __m256i indices_v(const zo_cfg* c, int64_t i) {
    return _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(c->index_base + i)), iota8());
}

/* 8 elements' update. fp32 moments are stored; bf16 ones (*rm, *rv) and bf16 params out of an
 * fp32 master (*ro) come back rounded in 32-bit lanes for the caller to store two halves at a
 * time (store_bf16x16). With the indices carried as a vector, one thread in cache on Zen 3 took
 * 2.56 cycles an element with bf16 moments, 3.05 with 8-lane stores; four halves at a time
 * measured the same as two. */
static inline __attribute__((always_inline)) void dense8(const zo_cfg* c, void* const* P, void* ma, void* va,
                                                         int64_t i, __m256i idx, const int prec, const int two,
                                                         __m256i* rm, __m256i* rv, __m256i* ro) {
    __m256 m = load_moment_v(prec, ma, i);
    __m256 v = two ? load_moment_v(prec, va, i) : _mm256_setzero_ps();
    __m256 p = update_v(c, load_master_v(c, P, i), load_grad_v(P[P_GRAD], c->g_dtype, i), &m, &v);
    store_master_v(c, P, i, idx, p, 1);
    if (bf16_out_of_f32(c)) *ro = bf16_rne32_v(p);
    if (prec == MOM_F32) {
        _mm256_storeu_ps((float*)ma + i, m);
        if (two) _mm256_storeu_ps((float*)va + i, v);
        return;
    }
    /* one hash per element rounds both moments: m takes its low half, v its high */
    __m256i r = fmix32_v(_mm256_xor_si256(idx, _mm256_set1_epi32((int)c->key_m)));
    *rm = bf16_sr32_v(m, r);
    if (two) *rv = bf16_sr32_v(v, _mm256_srli_epi32(r, 16));
}

static inline __attribute__((always_inline)) void dense_range(const zo_cfg* c, void* const* P, int64_t a, int64_t b, int64_t side) {
    const int two = two_moments(c);
    const int prec = side >= 0 ? MOM_F32 : c->moments;
    void* ma = side >= 0 ? (void*)((float*)P[P_M_SIDE] + side - a) : P[P_M];
    void* va = !two ? NULL : side >= 0 ? (void*)((float*)P[P_V_SIDE] + side - a) : P[P_V];
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i idx = indices_v(c, a);
    __m256i m0 = _mm256_setzero_si256(), m1 = m0, v0 = m0, v1 = m0, o0 = m0, o1 = m0;
    int64_t i = a;
    for (; i + 16 <= b; i += 16) { /* two independent halves in flight: 2-5% less time */
        __m256i idx1 = _mm256_add_epi32(idx, eight);
        dense8(c, P, ma, va, i, idx, prec, two, &m0, &v0, &o0);
        dense8(c, P, ma, va, i + 8, idx1, prec, two, &m1, &v1, &o1);
        if (prec == MOM_BF16) {
            store_bf16x16(ma, i, m0, m1);
            if (two) store_bf16x16(va, i, v0, v1);
        }
        if (bf16_out_of_f32(c)) store_bf16x16(P[P_OUT], i, o0, o1);
        idx = _mm256_add_epi32(idx1, eight);
    }
    for (; i + 8 <= b; i += 8) {
        dense8(c, P, ma, va, i, idx, prec, two, &m0, &v0, &o0);
        if (prec == MOM_BF16) {
            _mm_storeu_si128((__m128i*)((uint16_t*)ma + i), pack16(m0));
            if (two) _mm_storeu_si128((__m128i*)((uint16_t*)va + i), pack16(v0));
        }
        if (bf16_out_of_f32(c)) _mm_storeu_si128((__m128i*)((uint16_t*)P[P_OUT] + i), pack16(o0));
        idx = _mm256_add_epi32(idx, eight);
    }
    dense_scalar(c, P, i, b, side >= 0 ? side + (i - a) : -1);
}

static inline __attribute__((always_inline)) __m256 abs_v(__m256 x) {
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
}

/* max as the scalar path computes it: x > acc ? x : acc (vmaxps's own rule, NaN included) */
static inline __attribute__((always_inline)) __m256 max_v(__m256 acc, __m256 x) {
    return _mm256_max_ps(x, acc);
}

static inline __attribute__((always_inline)) void block_range(const zo_cfg* c, void* const* P, int64_t a, int64_t b, int j0,
                        float am_m, float am_v, float* sm, float* sv, float* mx_m, float* mx_v) {
    const int two = two_moments(c);
    __m256 amm = _mm256_set1_ps(am_m), amv = _mm256_set1_ps(am_v);
    __m256 xm = _mm256_setzero_ps(), xv = _mm256_setzero_ps();
    __m256i idx = indices_v(c, a);
    int64_t i = a;
    for (; i + 8 <= b; i += 8, idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8))) {
        int j = j0 + (int)(i - a);
        __m256 m = _mm256_mul_ps(_mm256_loadu_ps(sm + j), amm);
        __m256 v = two ? _mm256_mul_ps(_mm256_loadu_ps(sv + j), amv) : _mm256_setzero_ps();
        __m256 p = update_v(c, load_master_v(c, P, i), load_grad_v(P[P_GRAD], c->g_dtype, i), &m, &v);
        store_master_v(c, P, i, idx, p, 0);
        _mm256_storeu_ps(sm + j, m);
        xm = max_v(xm, abs_v(m));
        if (two) {
            _mm256_storeu_ps(sv + j, v);
            xv = max_v(xv, abs_v(v));
        }
    }
    float lm[8], lv[8];
    _mm256_storeu_ps(lm, xm);
    _mm256_storeu_ps(lv, xv);
    for (int k = 0; k < 8; k++) {
        *mx_m = lm[k] > *mx_m ? lm[k] : *mx_m;
        *mx_v = lv[k] > *mx_v ? lv[k] : *mx_v;
    }
    block_scalar(c, P, i, b, j0 + (int)(i - a), am_m, am_v, sm, sv, mx_m, mx_v);
}

/* The lookup's bucket index (returned) and x's mirrored bits within the bucket (*low). */
static inline __attribute__((always_inline)) __m256i bucket_v(__m256 x, const zo_qmap* q, __m256i* low_out) {
    const __m256i low_mask = _mm256_set1_epi32((int)((1u << q->shift) - 1u));
    const __m256i top = _mm256_set1_epi32((int)(ZO_MAG1 - ZO_MAG0 + (1u << q->shift)));
    __m256i b = _mm256_castps_si256(x);
    __m256i sign = _mm256_srai_epi32(b, 31); /* all ones for negatives */
    __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)ZO_MAG0), mag);
    mag = _mm256_add_epi32(mag, _mm256_set1_epi32((int)((1u << q->shift) - ZO_MAG0)));
    mag = _mm256_andnot_si256(small, mag);
    mag = _mm256_min_epu32(mag, top);
    __m256i low = _mm256_and_si256(mag, low_mask);
    *low_out = _mm256_xor_si256(low, _mm256_and_si256(sign, low_mask)); /* low_mask - low */
    __m256i t = _mm256_srli_epi32(mag, q->shift);
    return _mm256_add_epi32(t, _mm256_and_si256(sign, _mm256_set1_epi32(q->buckets)));
}

/* code = base + (low >= threshold) from a lookup entry */
static inline __attribute__((always_inline)) __m256i code_v(__m256i e, __m256i low) {
    __m256i thr = _mm256_and_si256(e, _mm256_set1_epi32(0xfffff));
    __m256i ge = _mm256_cmpgt_epi32(thr, low); /* thr > low: not past the decision point */
    return _mm256_sub_epi32(_mm256_add_epi32(_mm256_srli_epi32(e, 20), _mm256_set1_epi32(1)),
                            _mm256_and_si256(ge, _mm256_set1_epi32(1)));
}

static inline __attribute__((always_inline)) void store_codes_v(uint8_t* out, __m256i k) {
    __m256i w = _mm256_packus_epi32(k, k);
    __m256i bts = _mm256_packus_epi16(w, w);
    bts = _mm256_permutevar8x32_epi32(bts, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    _mm_storel_epi64((__m128i*)out, _mm256_castsi256_si128(bts));
}

/* A block's codes in three sweeps over L1: bucket indices (vector), the table entries
 * (indexed loads, which GCC packs into vectors: on Zen 3, 100M, 2 threads, vpgatherdd in both
 * lookups took 1.27-1.36x the 8-bit step's time, loads kept scalar 1.28-1.48x), codes (vector).
 * The second sweep reads the indices two to a 64-bit load, as loads bound it: on Zen 3 (100M,
 * 2 threads, 12 A/B runs) the 8-bit step took 0.90-1.02 (median 0.97) of its time with a load
 * per index; one sweep taking the indices out of the vector took 1.13-1.16x (50M). */
static inline __attribute__((always_inline)) void quantize_range(const float* s, int n, float inv, const zo_qmap* q, uint8_t* out) {
    uint32_t t[ZO_BLOCK] __attribute__((aligned(32)));
    uint32_t lows[ZO_BLOCK] __attribute__((aligned(32)));
    __m256 iv = _mm256_set1_ps(inv);
    int n8 = n & ~7, j;
    for (j = 0; j < n8; j += 8) {
        __m256i low;
        __m256i k = bucket_v(_mm256_mul_ps(_mm256_loadu_ps(s + j), iv), q, &low);
        _mm256_store_si256((__m256i*)(t + j), k);
        _mm256_store_si256((__m256i*)(lows + j), low);
    }
    const uint32_t* lut = q->lut;
    for (j = 0; j < n8; j += 8) {
        uint64_t w[4];
        memcpy(w, t + j, sizeof(w));
        _mm256_store_si256((__m256i*)(t + j),
                           _mm256_setr_epi32((int)lut[(uint32_t)w[0]], (int)lut[w[0] >> 32], (int)lut[(uint32_t)w[1]],
                                             (int)lut[w[1] >> 32], (int)lut[(uint32_t)w[2]], (int)lut[w[2] >> 32],
                                             (int)lut[(uint32_t)w[3]], (int)lut[w[3] >> 32]));
    }
    for (j = 0; j < n8; j += 8)
        store_codes_v(out + j, code_v(_mm256_load_si256((const __m256i*)(t + j)),
                                      _mm256_load_si256((const __m256i*)(lows + j))));
    quantize_scalar(s + n8, n - n8, inv, q, out + n8);
}

/* ---------------------------------------------------------------- the AVX-512 path (16 lanes)
 * The AVX2 path's operations, 16 lanes at a time. With VBMI an 8-bit block's lookups (old
 * codes' map values, new codes' decision points) are byte permutes over tables held in
 * registers, and a new code starts from a linear estimate (quantize_z below). Without VBMI old
 * codes become map values by permutes over the map in registers (16-lane gathers cost more on
 * Zen 5) and new codes' lookup entries are scalar loads (the table is 12-23 KiB; a gather was
 * slower there too). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define ZO_VEC_PATH "avx512"

static inline __attribute__((always_inline)) __m512i iota16(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline __attribute__((always_inline)) __m512i fmix32_z(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x85ebca6bu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xc2b2ae35u));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* 16 x u32 rounding results (each <= 0xffff) -> 16 bf16, NaN lanes of x as 0x7fc0 */
static inline __attribute__((always_inline)) __m256i nan_to_bf16_z(__m512 x, __m512i r) {
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0)));
}

static inline __attribute__((always_inline)) __m256i bf16_rne_z(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return nan_to_bf16_z(x, r);
}

static inline __attribute__((always_inline)) __m256i bf16_sr_z(__m512 x, __m512i h) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(h, _mm512_set1_epi32(0xffff))), 16);
    return nan_to_bf16_z(x, r);
}

static inline __attribute__((always_inline)) __m512 widen_bf16_z(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m256i load16_z(const void* a, int64_t i) {
    return _mm256_loadu_si256((const __m256i*)((const uint16_t*)a + i));
}

static inline __attribute__((always_inline)) void store16_z(void* a, int64_t i, __m256i x) {
    _mm256_storeu_si256((__m256i*)((uint16_t*)a + i), x);
}

static inline __attribute__((always_inline)) __m512 load_grad_z(const void* g, int dt, int64_t i) {
    if (dt == ZO_F32) return _mm512_loadu_ps((const float*)g + i);
    __m256i h = load16_z(g, i);
    return dt == ZO_BF16 ? widen_bf16_z(h) : _mm512_cvtph_ps(h);
}

static inline __attribute__((always_inline)) __m512 load_master_z(const zo_cfg* c, void* const* P, int64_t i) {
    if (c->master == MA_F32) return _mm512_loadu_ps((const float*)P[P_MASTER] + i);
    __m512 p = widen_bf16_z(load16_z(P[P_MASTER], i));
    if (c->master == MA_KAHAN) p = _mm512_add_ps(p, widen_bf16_z(load16_z(P[P_COMP], i)));
    return p;
}

static inline __attribute__((always_inline)) __m512i hash_z(int64_t index, uint32_t key) {
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)index), iota16());
    return fmix32_z(_mm512_xor_si512(idx, _mm512_set1_epi32((int)key)));
}

static inline __attribute__((always_inline)) void store_master_z(const zo_cfg* c, void* const* P, int64_t i, __m512 p) {
    __m512 val = p;
    __m256i hi = _mm256_setzero_si256();
    if (c->master == MA_F32) {
        _mm512_storeu_ps((float*)P[P_MASTER] + i, p);
    } else {
        if (c->master == MA_KAHAN) {
            hi = bf16_rne_z(p);
            __m512 hf = widen_bf16_z(hi);
            __m256i lo = bf16_rne_z(_mm512_sub_ps(p, hf));
            store16_z(P[P_COMP], i, lo);
            val = _mm512_add_ps(hf, widen_bf16_z(lo));
        } else {
            hi = bf16_sr_z(p, hash_z(c->index_base + i, c->key_master));
            val = widen_bf16_z(hi);
        }
        store16_z(P[P_MASTER], i, hi);
    }
    if (c->out_dtype == ZO_BF16)
        store16_z(P[P_OUT], i, c->master == MA_F32 ? bf16_rne_z(val) : hi);
    else if (c->out_dtype == ZO_F16)
        store16_z(P[P_OUT], i, _mm512_cvtps_ph(val, _MM_FROUND_TO_NEAREST_INT));
    else if (c->out_dtype == ZO_F32)
        _mm512_storeu_ps((float*)P[P_OUT] + i, val);
}

/* update1 for 16 lanes: the same operations in the same order */
static inline __attribute__((always_inline)) __m512 update_z(const zo_cfg* c, __m512 p, __m512 g, __m512* m, __m512* v) {
    g = _mm512_mul_ps(g, _mm512_set1_ps(c->gs));
    if (c->kind == K_LION) {
        p = _mm512_mul_ps(p, _mm512_set1_ps(c->decay));
        __m512 u = _mm512_fmadd_ps(_mm512_set1_ps(c->omb1), g, _mm512_mul_ps(*m, _mm512_set1_ps(c->b1)));
        __m512 z = _mm512_setzero_ps();
        __m512 s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, z, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
        s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(u, z, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
        p = _mm512_fmadd_ps(_mm512_set1_ps(c->nss), s, p);
        *m = _mm512_fmadd_ps(_mm512_set1_ps(c->omb2), g, _mm512_mul_ps(*m, _mm512_set1_ps(c->b2)));
        return p;
    }
    if (c->kind == K_ADAGRAD) {
        g = _mm512_fmadd_ps(_mm512_set1_ps(c->l2), p, g);
        __m512 s = _mm512_fmadd_ps(g, g, *m);
        *m = s;
        __m512 den = _mm512_add_ps(_mm512_sqrt_ps(s), _mm512_set1_ps(c->eps));
        return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->nss), g), den));
    }
    if (c->decoupled) p = _mm512_mul_ps(p, _mm512_set1_ps(c->decay));
    else g = _mm512_fmadd_ps(_mm512_set1_ps(c->l2), p, g);
    __m512 mi = *m, d = _mm512_sub_ps(g, mi);
    mi = c->lerp_small ? _mm512_fmadd_ps(_mm512_set1_ps(c->w1), d, mi)
                       : _mm512_fnmadd_ps(_mm512_set1_ps(c->omw1), d, g);
    __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c->omb2), g), g,
                                _mm512_mul_ps(*v, _mm512_set1_ps(c->b2)));
    *m = mi;
    *v = vi;
    __m512 root = _mm512_sqrt_ps(vi), r = _mm512_set1_ps(c->rbc2s);
    __m512 q = _mm512_mul_ps(root, r);
    __m512 e = _mm512_fnmadd_ps(q, _mm512_set1_ps(c->bc2s), root);
    q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(e, e, _CMP_ORD_Q), q, _mm512_fmadd_ps(e, r, q));
    __m512 den = _mm512_add_ps(q, _mm512_set1_ps(c->eps));
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->nss), mi), den));
}

static inline __attribute__((always_inline)) __m512 load_moment_z(int prec, const void* a, int64_t i) {
    if (prec == MOM_F32) return _mm512_loadu_ps((const float*)a + i);
    return widen_bf16_z(load16_z(a, i));
}

static inline __attribute__((always_inline)) void store_moment_z(int prec, void* a, int64_t i, __m512 x, __m512i r) {
    if (prec == MOM_F32) _mm512_storeu_ps((float*)a + i, x);
    else store16_z(a, i, bf16_sr_z(x, r));
}

static inline __attribute__((always_inline)) void dense_range_z(const zo_cfg* c, void* const* P, int64_t a, int64_t b, int64_t side) {
    const int two = two_moments(c);
    const int prec = side >= 0 ? MOM_F32 : c->moments;
    void* ma = side >= 0 ? (void*)((float*)P[P_M_SIDE] + side - a) : P[P_M];
    void* va = !two ? NULL : side >= 0 ? (void*)((float*)P[P_V_SIDE] + side - a) : P[P_V];
    int64_t i = a;
    for (; i + 16 <= b; i += 16) {
        __m512 m = load_moment_z(prec, ma, i);
        __m512 v = two ? load_moment_z(prec, va, i) : _mm512_setzero_ps();
        __m512 p = update_z(c, load_master_z(c, P, i), load_grad_z(P[P_GRAD], c->g_dtype, i), &m, &v);
        store_master_z(c, P, i, p);
        __m512i r = prec == MOM_BF16 ? hash_z(c->index_base + i, c->key_m) : _mm512_setzero_si512();
        store_moment_z(prec, ma, i, m, r);
        if (two) store_moment_z(prec, va, i, v, _mm512_srli_epi32(r, 16));
    }
    dense_scalar(c, P, i, b, side >= 0 ? side + (i - a) : -1);
}

/* max as the scalar path computes it: x > acc ? x : acc (vmaxps's own rule, NaN included) */
static inline __attribute__((always_inline)) __m512 max_z(__m512 acc, __m512 x) {
    return _mm512_max_ps(x, acc);
}

/* *mx = max(*mx, lanes of x) by halving (the max is exact: any order gives it) */
static inline __attribute__((always_inline)) void fold_max_z(__m512 x, float* mx) {
    x = max_z(x, _mm512_shuffle_f32x4(x, x, 0x4e));
    x = max_z(x, _mm512_shuffle_f32x4(x, x, 0xb1));
    x = max_z(x, _mm512_permute_ps(x, 0x4e));
    x = max_z(x, _mm512_permute_ps(x, 0xb1));
    float l = _mm512_cvtss_f32(x);
    *mx = l > *mx ? l : *mx;
}

/* Pass 1 of an 8-bit block, elements [a, a + len): the scratch holds the map values of the
 * old codes and receives the new moments; the absmax. */
static inline __attribute__((always_inline)) void block_z(const zo_cfg* c, void* const* P, int64_t a, int len,
                                                          float am_m, float am_v, float* sm, float* sv,
                                                          float* mx_m, float* mx_v) {
    const int two = two_moments(c);
    __m512 amm = _mm512_set1_ps(am_m), amv = _mm512_set1_ps(am_v);
    __m512 xm = _mm512_setzero_ps(), xv = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= len; j += 16) {
        int64_t i = a + j;
        __m512 m = _mm512_mul_ps(_mm512_load_ps(sm + j), amm);
        __m512 v = two ? _mm512_mul_ps(_mm512_load_ps(sv + j), amv) : _mm512_setzero_ps();
        __m512 p = update_z(c, load_master_z(c, P, i), load_grad_z(P[P_GRAD], c->g_dtype, i), &m, &v);
        store_master_z(c, P, i, p);
        _mm512_store_ps(sm + j, m);
        xm = max_z(xm, _mm512_abs_ps(m));
        if (two) {
            _mm512_store_ps(sv + j, v);
            xv = max_z(xv, _mm512_abs_ps(v));
        }
    }
    fold_max_z(xm, mx_m);
    if (two) fold_max_z(xv, mx_v);
    block_scalar(c, P, a + j, a + len, j, am_m, am_v, sm, sv, mx_m, mx_v);
}

#if defined(__AVX512VBMI__)
/* With VBMI a 256-entry table of 32-bit words is held as 4 byte planes of 4 registers each;
 * a lookup of 64 indices is two vpermi2b and a blend per plane, then unpacks to words. The
 * unpacks take byte 16L + 4r + j of a register (128-bit lane L) to word 4L + j of the r-th
 * result, so indices are put in that order first ("lane order"); pack_z does the reverse. */
typedef struct {
    __m512i p[4][4];
} zo_planes_z;

static inline __attribute__((always_inline)) void load_planes_z(zo_planes_z* T, const uint8_t* planes) {
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) T->p[j][k] = _mm512_loadu_si512(planes + 256 * j + 64 * k);
}

/* natural order -> lane order (idx[16L + 4r + j] = 16r + 4L + j), and back */
static inline __attribute__((always_inline)) __m512i to_lane_order_z(void) {
    uint8_t ix[64];
    for (int L = 0; L < 4; L++)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) ix[16 * L + 4 * r + j] = (uint8_t)(16 * r + 4 * L + j);
    return _mm512_loadu_si512(ix);
}

static inline __attribute__((always_inline)) __m512i from_lane_order_z(void) {
    uint8_t ix[64];
    for (int L = 0; L < 4; L++)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) ix[16 * r + 4 * L + j] = (uint8_t)(16 * L + 4 * r + j);
    return _mm512_loadu_si512(ix);
}

/* T[k] for 64 byte indices in lane order -> 4 x 16 words in natural order */
static inline __attribute__((always_inline)) void lookup64_z(const zo_planes_z* T, __m512i k, __m512i out[4]) {
    __mmask64 hi = _mm512_movepi8_mask(k);
    __m512i b[4];
    for (int j = 0; j < 4; j++) {
        __m512i lo_half = _mm512_permutex2var_epi8(T->p[j][0], k, T->p[j][1]);
        __m512i hi_half = _mm512_permutex2var_epi8(T->p[j][2], k, T->p[j][3]);
        b[j] = _mm512_mask_blend_epi8(hi, lo_half, hi_half);
    }
    __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_unpacklo_epi16(w01l, w23l);
    out[1] = _mm512_unpackhi_epi16(w01l, w23l);
    out[2] = _mm512_unpacklo_epi16(w01h, w23h);
    out[3] = _mm512_unpackhi_epi16(w01h, w23h);
}

/* 4 x 16 words in [0, 256) -> 64 bytes in lane order */
static inline __attribute__((always_inline)) __m512i pack_z(const __m512i w[4]) {
    return _mm512_packus_epi16(_mm512_packus_epi32(w[0], w[1]), _mm512_packus_epi32(w[2], w[3]));
}

/* The map values of n codes into the scratch. */
static inline __attribute__((always_inline)) void dequant_z(const zo_qmap* q, const uint8_t* codes, int n, float* s) {
    zo_planes_z T;
    load_planes_z(&T, q->value_planes);
    const __m512i order = to_lane_order_z();
    int j = 0;
    for (; j + 64 <= n; j += 64) {
        __m512i w[4];
        lookup64_z(&T, _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + j)), w);
        for (int r = 0; r < 4; r++) _mm512_store_ps(s + j + 16 * r, _mm512_castsi512_ps(w[r]));
    }
    for (; j < n; j++) s[j] = q->values[codes[j]];
}

/* The lines of x's span of octaves (quant.span_lines) held in 4 registers. */
typedef struct {
    __m512 l[4];
} zo_lines_z;

/* The estimate of 16 values (the code or one below, quant.span_lines), from |x| clamped to
 * [2^-31, 2) (NaN and inf to just below 2): below 2^-31 no decision point lies, and at or
 * above 1 the estimate is 254 or more (255 past the packs' saturation), or negative for a
 * negative x (0 there). `sg`: the map has negative codes. The unsigned map clamps x's bits as
 * signed integers instead, so a negative x (NaN too) reads as 2^-31, whose estimate is 0, and
 * it skips the sign's two steps. */
static inline __attribute__((always_inline)) __m512i estimate_z(const zo_lines_z* Lz, float neg_k, __m512 x, int sg) {
    __m512i b = _mm512_castps_si512(x), mag;
    if (sg) {
        mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
        mag = _mm512_min_epu32(_mm512_max_epu32(mag, _mm512_set1_epi32(0x30000000)), _mm512_set1_epi32(0x3fffffff));
    } else {
        mag = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_set1_epi32(0x30000000)), _mm512_set1_epi32(0x3fffffff));
    }
    __m512 y = _mm512_castsi512_ps(mag);
    __m512i span = _mm512_srli_epi32(mag, 24); /* the low 4 bits: span 0 .. 15 */
    __m512 t1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(span, Lz->l[0]), y, _mm512_permutexvar_ps(span, Lz->l[1]));
    __m512 t2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(span, Lz->l[2]), y, _mm512_permutexvar_ps(span, Lz->l[3]));
    __m512 t = _mm512_min_ps(t1, t2);
    if (sg) t = _mm512_mask_sub_ps(t, _mm512_movepi32_mask(b), _mm512_set1_ps(neg_k), t);
    return _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

/* The codes of 64 values x[r] (16 each), in natural order: the estimate (saturated to
 * [0, 255]), plus one where x reaches the decision point at the estimate (never at 255,
 * whose entry is NaN, nor for a NaN x). */
static inline __attribute__((always_inline)) __m512i codes64_z(const zo_lines_z* Lz, const zo_planes_z* T, float neg_k,
                                                                const __m512 x[4], __m512i natural, int sg) {
    __m512i e[4], t[4];
    for (int r = 0; r < 4; r++) e[r] = estimate_z(Lz, neg_k, x[r], sg);
    __m512i k = pack_z(e);
    lookup64_z(T, k, t);
    __mmask16 up[4];
    for (int r = 0; r < 4; r++) up[r] = _mm512_cmp_ps_mask(x[r], _mm512_castsi512_ps(t[r]), _CMP_GE_OQ);
    __mmask64 ups = _mm512_kunpackd(_mm512_kunpackw(up[3], up[2]), _mm512_kunpackw(up[1], up[0]));
    __m512i codes = _mm512_permutexvar_epi8(natural, k);
    return _mm512_mask_sub_epi8(codes, ups, codes, _mm512_set1_epi8(-1));
}

/* The codes of 64 values s[0 .. 63] * inv. */
static inline __attribute__((always_inline)) void quantize64_z(const float* s, __m512 inv, const zo_lines_z* Lz,
                                                               const zo_planes_z* T, float neg_k, int sg,
                                                               __m512i natural, uint8_t* out) {
    __m512 x[4];
    for (int r = 0; r < 4; r++) x[r] = _mm512_mul_ps(_mm512_load_ps(s + 16 * r), inv);
    _mm512_storeu_si512(out, codes64_z(Lz, T, neg_k, x, natural, sg));
}

static inline __attribute__((always_inline)) int map_signed_z(const zo_qmap* q) { return q->values[0] < 0.0f; }

static inline __attribute__((always_inline)) void load_lines_z(zo_lines_z* Lz, const float* lines) {
    for (int k = 0; k < 4; k++) Lz->l[k] = _mm512_loadu_ps(lines + 16 * k);
}

static inline __attribute__((always_inline)) void quantize_z(const float* s, int n, float inv, const zo_qmap* q, uint8_t* out) {
    zo_planes_z T;
    zo_lines_z Lz;
    load_planes_z(&T, q->thr_planes);
    load_lines_z(&Lz, q->lines);
    const __m512i order = from_lane_order_z();
    const __m512 iv = _mm512_set1_ps(inv);
    int j = 0;
    if (map_signed_z(q))
        for (; j + 64 <= n; j += 64) quantize64_z(s + j, iv, &Lz, &T, q->neg_k, 1, order, out + j);
    else
        for (; j + 64 <= n; j += 64) quantize64_z(s + j, iv, &Lz, &T, q->neg_k, 0, order, out + j);
    quantize_scalar(s + j, n - j, inv, q, out + j);
}
#else
/* A 256-entry float table held in 16 registers (T[k]: entries 16k .. 16k + 15). */
typedef struct {
    __m512 t[16];
} zo_tab_z;

static inline __attribute__((always_inline)) void load_tab_z(zo_tab_z* T, const float* a) {
    for (int k = 0; k < 16; k++) T->t[k] = _mm512_loadu_ps(a + 16 * k);
}

/* T[k] for 16 indices in [0, 256): a two-table permute per 32 entries, then a select by
 * index bits 5, 6, 7 */
static inline __attribute__((always_inline)) __m512 lookup_z(const zo_tab_z* T, __m512i k) {
    __m512 r[8];
    for (int h = 0; h < 8; h++) r[h] = _mm512_permutex2var_ps(T->t[2 * h], k, T->t[2 * h + 1]);
    __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    __mmask16 b7 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(128));
    for (int h = 0; h < 4; h++) r[h] = _mm512_mask_blend_ps(b5, r[2 * h], r[2 * h + 1]);
    r[0] = _mm512_mask_blend_ps(b6, r[0], r[1]);
    r[2] = _mm512_mask_blend_ps(b6, r[2], r[3]);
    return _mm512_mask_blend_ps(b7, r[0], r[2]);
}

/* The map values of n codes into the scratch (the rest of the block by scalar loads). */
static inline __attribute__((always_inline)) void dequant_z(const zo_qmap* q, const uint8_t* codes, int n, float* s) {
    zo_tab_z T;
    load_tab_z(&T, q->values);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_store_ps(s + j, lookup_z(&T, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + j)))));
    for (; j < n; j++) s[j] = q->values[codes[j]];
}

/* The lookup's bucket index (returned) and x's mirrored bits within the bucket (*low). */
static inline __attribute__((always_inline)) __m512i bucket_z(__m512 x, const zo_qmap* q, __m512i* low_out) {
    const __m512i low_mask = _mm512_set1_epi32((int)((1u << q->shift) - 1u));
    const __m512i top = _mm512_set1_epi32((int)(ZO_MAG1 - ZO_MAG0 + (1u << q->shift)));
    __m512i b = _mm512_castps_si512(x);
    __m512i sign = _mm512_srai_epi32(b, 31); /* all ones for negatives */
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    __mmask16 big = _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32((int)ZO_MAG0));
    mag = _mm512_maskz_add_epi32(big, mag, _mm512_set1_epi32((int)((1u << q->shift) - ZO_MAG0)));
    mag = _mm512_min_epu32(mag, top);
    __m512i low = _mm512_and_si512(mag, low_mask);
    *low_out = _mm512_xor_si512(low, _mm512_and_si512(sign, low_mask)); /* low_mask - low */
    __m512i t = _mm512_srli_epi32(mag, q->shift);
    return _mm512_add_epi32(t, _mm512_and_si512(sign, _mm512_set1_epi32(q->buckets)));
}

static inline __attribute__((always_inline)) void quantize_z(const float* s, int n, float inv, const zo_qmap* q, uint8_t* out) {
    uint32_t t[ZO_BLOCK] __attribute__((aligned(64)));
    uint32_t lows[ZO_BLOCK] __attribute__((aligned(64)));
    __m512 iv = _mm512_set1_ps(inv);
    int n16 = n & ~15, j;
    for (j = 0; j < n16; j += 16) {
        __m512i low;
        _mm512_store_si512(t + j, bucket_z(_mm512_mul_ps(_mm512_load_ps(s + j), iv), q, &low));
        _mm512_store_si512(lows + j, low);
    }
    const uint32_t* lut = q->lut;
    for (j = 0; j < n16; j++) t[j] = lut[t[j]];
    for (j = 0; j < n16; j += 16) {
        __m512i e = _mm512_load_si512(t + j);
        __m512i base = _mm512_srli_epi32(e, 20);
        __mmask16 up = _mm512_cmpge_epu32_mask(_mm512_load_si512(lows + j), _mm512_and_si512(e, _mm512_set1_epi32(0xfffff)));
        _mm_storeu_si128((__m128i*)(out + j), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(base, up, base, _mm512_set1_epi32(1))));
    }
    quantize_scalar(s + n16, n - n16, inv, q, out + n16);
}

#endif

/* The rows stream five arrays at once, and each block's compute is long: the hardware
 * prefetchers fall behind (they also stop at page ends). Ask for the block ZO_PREFETCH_BLOCKS
 * ahead: its master and gradient (a KiB each in fp32) and both moments' codes. */
#define ZO_PREFETCH_BLOCKS 8
static inline __attribute__((always_inline)) void prefetch_block_z(const zo_cfg* c, void* const* P, int64_t i, int64_t end) {
    if (i + ZO_BLOCK > end) return;
    const char* p = (const char*)P[P_MASTER] + i * (c->master == MA_F32 ? 4 : 2);
    const char* g = (const char*)P[P_GRAD] + i * (c->g_dtype == ZO_F32 ? 4 : 2);
    for (int b = 0; b < ZO_BLOCK * 4; b += 64) {
        _mm_prefetch(p + b, _MM_HINT_T0);
        _mm_prefetch(g + b, _MM_HINT_T0);
    }
    for (int b = 0; b < ZO_BLOCK; b += 64) {
        _mm_prefetch((const char*)P[P_M] + i + b, _MM_HINT_T0);
        if (P[P_V]) _mm_prefetch((const char*)P[P_V] + i + b, _MM_HINT_T0);
    }
}

static inline __attribute__((always_inline)) void quantized_row_z(const zo_cfg* c, void* const* P, int64_t off, int64_t n,
                                                                  int phase, int64_t blk) {
    float sm[ZO_BLOCK] __attribute__((aligned(64)));
    float sv[ZO_BLOCK] __attribute__((aligned(64)));
    const int two = two_moments(c);
    float* am_m = (float*)P[P_M_ABSMAX];
    float* am_v = (float*)P[P_V_ABSMAX];
    int64_t i = off, end = off + n;
    int len = ZO_BLOCK - phase;
    while (i < end) {
        if (len > end - i) len = (int)(end - i);
        float mx_m = 0.0f, mx_v = 0.0f;
        prefetch_block_z(c, P, i + ZO_PREFETCH_BLOCKS * ZO_BLOCK, end);
        dequant_z(c->qm, (const uint8_t*)P[P_M] + i, len, sm);
        if (two) dequant_z(c->qv, (const uint8_t*)P[P_V] + i, len, sv);
        block_z(c, P, i, len, am_m[blk], two ? am_v[blk] : 0.0f, sm, sv, &mx_m, &mx_v);
        quantize_z(sm, len, mx_m > 0.0f ? 1.0f / mx_m : 0.0f, c->qm, (uint8_t*)P[P_M] + i);
        am_m[blk] = mx_m;
        if (two) {
            quantize_z(sv, len, mx_v > 0.0f ? 1.0f / mx_v : 0.0f, c->qv, (uint8_t*)P[P_V] + i);
            am_v[blk] = mx_v;
        }
        i += len;
        blk++;
        len = ZO_BLOCK;
    }
}

#if defined(__AVX512VBMI__)
/* max(acc, |x|) in one instruction (vrangeps 0x0b: the larger magnitude, sign cleared). Like
 * max_z on |x| it ignores a quiet NaN x (IEEE maxNum), and arithmetic makes no signaling one. */
static inline __attribute__((always_inline)) __m512 absmax_z(__m512 acc, __m512 x) {
    return _mm512_range_ps(acc, x, 0x0b);
}

/* Pass 1 on 64 elements of a whole block (block_z's loop body, four times). */
static inline __attribute__((always_inline)) void update64_z(const zo_cfg* c, void* const* P, int64_t i, __m512 amm,
                                                             __m512 amv, float* sm, float* sv, __m512* xm, __m512* xv) {
    const int two = two_moments(c);
    for (int r = 0; r < 4; r++) {
        __m512 m = _mm512_mul_ps(_mm512_load_ps(sm + 16 * r), amm);
        __m512 v = two ? _mm512_mul_ps(_mm512_load_ps(sv + 16 * r), amv) : _mm512_setzero_ps();
        __m512 p = update_z(c, load_master_z(c, P, i + 16 * r), load_grad_z(P[P_GRAD], c->g_dtype, i + 16 * r), &m, &v);
        store_master_z(c, P, i + 16 * r, p);
        _mm512_store_ps(sm + 16 * r, m);
        *xm = absmax_z(*xm, m);
        if (two) {
            _mm512_store_ps(sv + 16 * r, v);
            *xv = absmax_z(*xv, v);
        }
    }
}

/* Both maps' quantizer tables, held for a row. */
typedef struct {
    zo_planes_z tm, tv;
    zo_lines_z lm, lv;
    __m512i natural;
    float km, kv;
    int sm, sv;
} zo_quant2_z;

/* `n` whole blocks from element a (absmax from blk), two in flight: each step updates 64
 * elements of block k, whose square roots and divisions keep the divider busy, while the
 * shuffle and integer units quantize 64 of block k - 1 (its absmax known by then). One block at
 * a time the two phases alternate and each leaves the other's units idle. */
static inline __attribute__((always_inline)) void pipelined_blocks_z(const zo_cfg* c, void* const* P, int64_t a,
                                                                     int64_t n, int64_t blk, int64_t end) {
    float sm[2][ZO_BLOCK] __attribute__((aligned(64)));
    float sv[2][ZO_BLOCK] __attribute__((aligned(64)));
    const int two = two_moments(c);
    float* am_m = (float*)P[P_M_ABSMAX];
    float* am_v = (float*)P[P_V_ABSMAX];
    uint8_t* codes_m = (uint8_t*)P[P_M];
    uint8_t* codes_v = (uint8_t*)P[P_V];
    zo_quant2_z Q;
    load_planes_z(&Q.tm, c->qm->thr_planes);
    load_lines_z(&Q.lm, c->qm->lines);
    Q.km = c->qm->neg_k;
    Q.sm = map_signed_z(c->qm);
    if (two) {
        load_planes_z(&Q.tv, c->qv->thr_planes);
        load_lines_z(&Q.lv, c->qv->lines);
        Q.kv = c->qv->neg_k;
        Q.sv = map_signed_z(c->qv);
    }
    Q.natural = from_lane_order_z();
    __m512 inv_m = _mm512_setzero_ps(), inv_v = _mm512_setzero_ps();
    for (int64_t k = 0; k <= n; k++) {
        const int cur = (int)(k & 1), prev = cur ^ 1;
        const int64_t i = a + k * ZO_BLOCK, ip = i - ZO_BLOCK;
        const int upd = k < n, quant = k > 0;
        __m512 amm = _mm512_setzero_ps(), amv = _mm512_setzero_ps();
        if (upd) {
            prefetch_block_z(c, P, i + ZO_PREFETCH_BLOCKS * ZO_BLOCK, end);
            dequant_z(c->qm, codes_m + i, ZO_BLOCK, sm[cur]);
            if (two) dequant_z(c->qv, codes_v + i, ZO_BLOCK, sv[cur]);
            amm = _mm512_set1_ps(am_m[blk + k]);
            amv = _mm512_set1_ps(two ? am_v[blk + k] : 0.0f);
        }
        __m512 xm = _mm512_setzero_ps(), xv = _mm512_setzero_ps();
        for (int g = 0; g < ZO_BLOCK; g += 64) {
            if (upd) update64_z(c, P, i + g, amm, amv, sm[cur] + g, sv[cur] + g, &xm, &xv);
            if (quant) {
                quantize64_z(sm[prev] + g, inv_m, &Q.lm, &Q.tm, Q.km, Q.sm, Q.natural, codes_m + ip + g);
                if (two) quantize64_z(sv[prev] + g, inv_v, &Q.lv, &Q.tv, Q.kv, Q.sv, Q.natural, codes_v + ip + g);
            }
        }
        if (upd) {
            float mx_m = 0.0f, mx_v = 0.0f;
            fold_max_z(xm, &mx_m);
            am_m[blk + k] = mx_m;
            inv_m = _mm512_set1_ps(mx_m > 0.0f ? 1.0f / mx_m : 0.0f);
            if (two) {
                fold_max_z(xv, &mx_v);
                am_v[blk + k] = mx_v;
                inv_v = _mm512_set1_ps(mx_v > 0.0f ? 1.0f / mx_v : 0.0f);
            }
        }
    }
}

/* An 8-bit row: a partial first and last block one at a time, the whole ones between
 * pipelined. */
static inline __attribute__((always_inline)) void quantized_row_vbmi(const zo_cfg* c, void* const* P, int64_t off,
                                                                     int64_t n, int phase, int64_t blk) {
    int64_t i = off, end = off + n;
    if (phase > 0) {
        int64_t head = ZO_BLOCK - phase < n ? ZO_BLOCK - phase : n;
        quantized_row_z(c, P, i, head, phase, blk);
        i += head;
        blk++;
    }
    int64_t whole = (end - i) / ZO_BLOCK;
    if (whole > 0) pipelined_blocks_z(c, P, i, whole, blk, end);
    i += whole * ZO_BLOCK;
    blk += whole;
    if (i < end) quantized_row_z(c, P, i, end - i, 0, blk);
}
#define ZO_QUANTIZED quantized_row_vbmi
#else
#define ZO_QUANTIZED quantized_row_z
#endif
#define ZO_DENSE dense_range_z
#define ZO_QUANTIZE quantize_z
#else
#define ZO_VEC_PATH "avx2"
#endif

#else /* the portable path: the scalar reference (or what the compiler makes of it) */
#define dense_range dense_scalar
#define block_range block_scalar
#define quantize_range quantize_scalar
#if defined(ZO_SCALAR)
#define ZO_VEC_PATH "scalar"
#else
#define ZO_VEC_PATH "generic"
#endif
#endif

const char* zo_optim_vec_path(void) { return ZO_VEC_PATH; }

/* ---------------------------------------------------------------- rows and entry points */

/* An 8-bit row: [off, off + n), first element at `phase` in its block, absmax from `blk`.
 * One block at a time: on Zen 3 (AVX2) pipelining whole blocks as the AVX-512 path does
 * (64 elements of block k updated, then 64 of block k - 1 quantized) took 1.06-1.2x the time. */
static inline __attribute__((always_inline)) void quantized_row(const zo_cfg* c, void* const* P, int64_t off, int64_t n, int phase,
                          int64_t blk) {
    float sm[ZO_BLOCK] __attribute__((aligned(64)));
    float sv[ZO_BLOCK] __attribute__((aligned(64)));
    const int two = two_moments(c);
    float* am_m = (float*)P[P_M_ABSMAX];
    float* am_v = (float*)P[P_V_ABSMAX];
    int64_t i = off, end = off + n;
    int len = ZO_BLOCK - phase;
    while (i < end) {
        if (len > end - i) len = (int)(end - i);
        float mx_m = 0.0f, mx_v = 0.0f;
        /* the old codes' map values, by indexed loads (cheaper than gathers on Zen 2/3) */
        const uint8_t* cm = (const uint8_t*)P[P_M] + i;
        for (int j = 0; j < len; j++) sm[j] = c->qm->values[cm[j]];
        if (two) {
            const uint8_t* cv = (const uint8_t*)P[P_V] + i;
            for (int j = 0; j < len; j++) sv[j] = c->qv->values[cv[j]];
        }
        block_range(c, P, i, i + len, 0, am_m[blk], two ? am_v[blk] : 0.0f, sm, sv, &mx_m, &mx_v);
        quantize_range(sm, len, mx_m > 0.0f ? 1.0f / mx_m : 0.0f, c->qm, (uint8_t*)P[P_M] + i);
        am_m[blk] = mx_m;
        if (two) {
            quantize_range(sv, len, mx_v > 0.0f ? 1.0f / mx_v : 0.0f, c->qv, (uint8_t*)P[P_V] + i);
            am_v[blk] = mx_v;
        }
        i += len;
        blk++;
        len = ZO_BLOCK;
    }
}

#ifndef ZO_DENSE
#define ZO_DENSE dense_range
#define ZO_QUANTIZED quantized_row
#define ZO_QUANTIZE quantize_range
#endif

/* One row, its storage as the cfg says. */
static inline __attribute__((always_inline)) void row_stored(const zo_cfg* c, void* const* P, const int64_t* row) {
    int64_t off = row[0], n = row[1], phase = row[2], side = row[3], blk = row[4];
    if (c->moments == MOM_INT8 && phase >= 0) ZO_QUANTIZED(c, P, off, n, (int)phase, blk);
    else ZO_DENSE(c, P, off, off + n, c->moments == MOM_INT8 ? side : -1);
}

/* AdamW's row with low-precision moments, an fp32 master and one of the two usual grad / param
 * dtypes (fp32 grads stepped in place, or bf16 grads in and bf16 params out), all fixed:
 * constants, so their loops keep no dtype branches (AVX2, 100M params, 2 threads: 12-17% less
 * time with bf16 moments, 4-15% with 8-bit ones). */
static inline __attribute__((always_inline)) void row_fixed(zo_cfg* c, void* const* P, const int64_t* row,
                                                            const int moments, const int g_dtype, const int out_dtype) {
    c->moments = moments;
    c->master = MA_F32;
    c->g_dtype = g_dtype;
    c->out_dtype = out_dtype;
    row_stored(c, P, row);
}

/* One row with the kind fixed: the local copies (whose address never escapes) let the
 * compiler keep every scalar in a register and fold those branches away. The other
 * precisions' and dtypes' branches stay (loop-invariant, and fewer copies build faster). */
static inline __attribute__((always_inline)) void row_as(const zo_cfg* cp, void* const* P,
                                                         const int64_t* row, const int kind) {
    zo_cfg c = *cp;
    void* L[NUM_PTRS];
    memcpy(L, P, sizeof(L));
    c.kind = kind;
    if (kind == K_ADAMW && c.master == MA_F32 && c.moments != MOM_F32) {
        const int q = c.moments == MOM_INT8;
        if (c.g_dtype == ZO_F32 && c.out_dtype == ZO_NONE) {
            if (q) row_fixed(&c, L, row, MOM_INT8, ZO_F32, ZO_NONE);
            else row_fixed(&c, L, row, MOM_BF16, ZO_F32, ZO_NONE);
            return;
        }
        if (c.g_dtype == ZO_BF16 && c.out_dtype == ZO_BF16) {
            if (q) row_fixed(&c, L, row, MOM_INT8, ZO_BF16, ZO_BF16);
            else row_fixed(&c, L, row, MOM_BF16, ZO_BF16, ZO_BF16);
            return;
        }
    }
    row_stored(&c, L, row);
}

static void run_row(const zo_cfg* c, void* const* P, const int64_t* row) {
    switch (c->kind) {
        case K_ADAMW: row_as(c, P, row, K_ADAMW); break;
        case K_ADAM: row_as(c, P, row, K_ADAM); break;
        case K_LION: row_as(c, P, row, K_LION); break;
        default: row_as(c, P, row, K_ADAGRAD); break;
    }
}

static int make_cfg(zo_cfg* c, const int32_t* modes, const float* hp, const uint32_t* keys,
                    int64_t index_base, const zo_qmap* qm, const zo_qmap* qv) {
    c->kind = modes[0];
    c->moments = modes[1];
    c->master = modes[2];
    c->g_dtype = modes[3];
    c->out_dtype = modes[4];
    if (c->kind < K_ADAMW || c->kind > K_ADAGRAD) return 1;
    if (c->moments < MOM_F32 || c->moments > MOM_INT8) return 2;
    if (c->master < MA_F32 || c->master > MA_SR) return 3;
    if (c->g_dtype < ZO_F32 || c->g_dtype > ZO_F16) return 4;
    if (c->out_dtype < ZO_NONE || c->out_dtype > ZO_F16) return 5;
    if (c->moments == MOM_INT8 && (!qm || (two_moments(c) && !qv))) return 6;
    if (c->kind == K_ADAGRAD && c->moments != MOM_F32) return 7;
    c->decoupled = c->kind == K_ADAMW || c->kind == K_LION;
    c->decay = hp[0]; c->l2 = hp[1]; c->w1 = hp[2]; c->omw1 = hp[3];
    c->b1 = hp[4]; c->omb1 = hp[5]; c->b2 = hp[6]; c->omb2 = hp[7];
    c->eps = hp[8]; c->nss = hp[9]; c->bc2s = hp[10]; c->rbc2s = hp[11]; c->gs = hp[12];
    c->lerp_small = c->w1 < 0.5f;
    c->key_master = keys[0]; c->key_m = keys[1]; /* keys[2]: reserved */
    c->index_base = index_base;
    c->qm = qm;
    c->qv = qv;
    return 0;
}

/* Rows [row_begin, row_end) of `rows` (int64 x 5: offset, numel, phase, side, block).
 * modes: kind, moments, master, grad dtype, out dtype. Returns 0 or a nonzero code for bad
 * arguments (nothing touched then). Safe on disjoint rows from several threads. */
int zo_optim_rows(void* const* ptrs, const int64_t* rows, int64_t row_begin, int64_t row_end,
                  const int32_t* modes, const float* hp, const uint32_t* keys,
                  int64_t index_base, const zo_qmap* qm, const zo_qmap* qv) {
    zo_cfg c;
    int rc = make_cfg(&c, modes, hp, keys, index_base, qm, qv);
    if (rc) return rc;
    for (int64_t r = row_begin; r < row_end; r++) run_row(&c, ptrs, rows + r * ZO_ROW_FIELDS);
    return 0;
}

/* All rows on `num_threads` OpenMP threads, each claiming the next row when done with one: on a
 * host whose cores are shared, a thread that is descheduled leaves its rows to the others
 * instead of holding up the step (rows are independent, so the bits do not change). */
int zo_optim_omp(void* const* ptrs, const int64_t* rows, int64_t nrows, const int32_t* modes,
                 const float* hp, const uint32_t* keys, int64_t index_base, const zo_qmap* qm,
                 const zo_qmap* qv, int num_threads) {
    zo_cfg c;
    int rc = make_cfg(&c, modes, hp, keys, index_base, qm, qv);
    if (rc) return rc;
#ifdef _OPENMP
    int nt = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t r = 0; r < nrows; r++) run_row(&c, ptrs, rows + r * ZO_ROW_FIELDS);
#else
    (void)num_threads;
    for (int64_t r = 0; r < nrows; r++) run_row(&c, ptrs, rows + r * ZO_ROW_FIELDS);
#endif
    return 0;
}

/* Codes of n values under map q (tests compare the lookup with the binding's rule). */
void zo_optim_quantize(const float* x, int64_t n, const zo_qmap* q, uint8_t* out) {
    for (int64_t i = 0; i < n; i++) out[i] = quantize1(x[i], q);
}

/* How many of the fp32 bit patterns first .. first + count - 1 (mod 2^32) this path's block
 * quantizer codes differently from quantize1, the reference (tests, and the exhaustive check
 * in docs/optimizer_states.md). */
int64_t zo_optim_code_mismatches(const zo_qmap* q, int64_t first, int64_t count, int num_threads) {
    const int64_t chunks = (count + ZO_BLOCK - 1) / ZO_BLOCK;
    int64_t bad = 0;
#ifdef _OPENMP
    int nt = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) reduction(+ : bad)
#else
    (void)num_threads;
#endif
    for (int64_t ch = 0; ch < chunks; ch++) {
        float x[ZO_BLOCK] __attribute__((aligned(64)));
        uint8_t got[ZO_BLOCK];
        int64_t a = ch * ZO_BLOCK;
        int n = count - a < ZO_BLOCK ? (int)(count - a) : ZO_BLOCK;
        for (int j = 0; j < n; j++) x[j] = u2f((uint32_t)(first + a + j));
        ZO_QUANTIZE(x, n, 1.0f, q, got); /* x * 1 is x (a signaling NaN turns quiet: same code) */
        for (int j = 0; j < n; j++) bad += got[j] != quantize1(x[j], q);
    }
    return bad;
}
