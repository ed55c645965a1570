/* Fused CPU AdamW step for lightning-lazytrain's HybridAdamW.
 *
 * Per block of elements: read the gradient (fp32 or bf16, times the clip coefficient), read the moments (fp32,
 * or 8-bit codes + block absmax), update them, update the parameter (fp32, or bf16 with stochastic rounding),
 * write the optional bf16 streaming copy, re-quantize the moments. Blocks are spread over OpenMP threads. The
 * fp32-state loops are plain arrays the compiler vectorizes (kernel.py's flags per path); 8-bit blocks run one
 * AVX-512 loop (_adamw_fused8.h) around the codec of _adamw_codec.h where the CPU has VBMI, one AVX2 loop
 * (_adamw_avx2.h) or a NEON block loop (_adamw_neon.h), else per-block passes.
 * The arithmetic follows torch.optim.AdamW's single-tensor path operation by operation (fp contraction is off
 * at build time; explicit fmaf only where torch's vectorized lerp and addcmul use one), so fp32 mode matches
 * torch to rounding. Plain C with a ctypes entry point: no torch headers, so building takes about a second.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The code paths (lt_simd_level); kernel.py passes -DLT_PATH=<one of these> with the flags it needs. */
#define LT_SCALAR 0
#define LT_AVX512F 1
#define LT_AVX512VBMI 2
#define LT_AVX2 3
#define LT_NEON 4
#ifndef LT_PATH
#error "build with -DLT_PATH=<path> (kernel.py does)"
#endif
#define LT_HAS_AVX512 (LT_PATH == LT_AVX512F || LT_PATH == LT_AVX512VBMI)
#if LT_HAS_AVX512 || LT_PATH == LT_AVX2
#include <immintrin.h>
#elif LT_PATH == LT_NEON
#include <arm_neon.h>
#endif

typedef struct {
    float *p32;          /* fp32 master, or NULL */
    uint16_t *p16;       /* bf16 master (stochastic rounding), or NULL */
    const void *grad;    /* fp32 or bf16 gradient */
    int32_t grad_bf16;
    int32_t nthreads;
    float *m, *v;        /* fp32 moments, or NULL */
    uint8_t *mq, *vq;    /* 8-bit moment codes, or NULL */
    float *mabs, *vabs;  /* per-block absmax of the 8-bit moments */
    uint16_t *copy;      /* bf16 streaming copy, or NULL */
    int64_t n, block;
    float decay;         /* 1 - lr * weight_decay */
    float w1;            /* 1 - beta1 (lerp weight) */
    float beta2, w2;     /* beta2, 1 - beta2 */
    float neg_step;      /* -lr / (1 - beta1^t) */
    float bc2_sqrt, eps, grad_scale;
    uint32_t sr_key;
    float v_floor;       /* 8-bit states: v >= v_floor * m^2 (reference.v_floor_coef); unused for fp32 states */
} lt_args;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t bf16_rne(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch writes it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Counter-based hash: the noise of element i depends only on (key, i), so results do not depend on threads. */
static inline uint32_t lt_mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

static inline uint16_t bf16_stochastic(float f, uint32_t key, int64_t i) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return bf16_rne(f);
    uint32_t r = lt_mix(((uint32_t)i * 0x9e3779b9u) ^ key) & 0xffffu;
    return (uint16_t)((u + r) >> 16);
}

#include "_adamw_codec.h"

/* The update proper, reading the big arrays in place: streaming all of them side by side keeps the hardware
 * prefetchers on (copying each into scratch first made this pass memory-latency bound, ~3x slower).
 * m, v point at the fp32 states, or at the block's scratch holding decoded 8-bit states. 8-bit v is raised to
 * v_floor * m^2 where quantization put it below (v decodes to 0 far below the block's absmax, m does not):
 * compare-and-select, so a NaN v stays NaN, as in the reference's torch.where and AVX-512's max_ps. */
#define LT_UPDATE_LOOP(LOAD_G, LOAD_P, STORE_P)                                \
    for (int64_t i = 0; i < len; i++) {                                       \
        const float gi = (LOAD_G) * sc;                                       \
        const float mi = fmaf(w1, gi - m[i], m[i]);                           \
        const float vr = fmaf(w2 * gi, gi, v[i] * b2); /* = torch addcmul */  \
        const float vf = mi * mi * vfl;                                       \
        const float vi = floor8 && vf > vr ? vf : vr;                         \
        const float denom = sqrtf(vi) / bc2 + eps;                            \
        const float pi = (LOAD_P) * decay;                                    \
        const float pn = pi + ns * mi / denom;                                \
        STORE_P;                                                              \
        m[i] = mi;                                                            \
        v[i] = vi;                                                            \
    }

/* One range of the update; m, v: fp32 states, or decoded 8-bit states in scratch (updated in place).
 * floor8 is a constant after inlining: the fp32-state loops stay torch's operations, nothing more. */
static inline __attribute__((always_inline)) void update_range_t(const lt_args *a, int64_t s, int64_t len,
                                                                 float *restrict m, float *restrict v,
                                                                 const int floor8) {
    const float decay = a->decay, w1 = a->w1, b2 = a->beta2, w2 = a->w2, vfl = a->v_floor;
    const float ns = a->neg_step, bc2 = a->bc2_sqrt, eps = a->eps, sc = a->grad_scale;
    const float *restrict g32 = (const float *)a->grad + s;
    const uint16_t *restrict g16 = (const uint16_t *)a->grad + s;
    uint16_t *restrict cp = a->copy ? a->copy + s : NULL;
    if (a->p32) {
        float *restrict p = a->p32 + s;
        if (a->grad_bf16 && cp) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), p[i], (p[i] = pn, cp[i] = bf16_rne(pn)))
        } else if (a->grad_bf16) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), p[i], p[i] = pn)
        } else if (cp) {
            LT_UPDATE_LOOP(g32[i], p[i], (p[i] = pn, cp[i] = bf16_rne(pn)))
        } else {
            LT_UPDATE_LOOP(g32[i], p[i], p[i] = pn)
        }
    } else {
        uint16_t *restrict p = a->p16 + s;
        const uint32_t key = a->sr_key;
        if (a->grad_bf16) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), u2f((uint32_t)p[i] << 16),
                           p[i] = bf16_stochastic(pn, key, s + i))
        } else {
            LT_UPDATE_LOOP(g32[i], u2f((uint32_t)p[i] << 16), p[i] = bf16_stochastic(pn, key, s + i))
        }
        if (cp) memcpy(cp, p, (size_t)len * 2);
    }
}

static void update_range(const lt_args *a, int64_t s, int64_t len, float *restrict m, float *restrict v) {
    if (a->mq)
        update_range_t(a, s, len, m, v, 1);
    else
        update_range_t(a, s, len, m, v, 0);
}

/* One block in passes: decode 8-bit moments into scratch, update, absmax and re-encode (fp32 states: update). */
static void do_block(const lt_args *a, int64_t s, int64_t len, float *restrict sm, float *restrict sv) {
    const int64_t blk = s / a->block;
    float *restrict m = a->mq ? sm : a->m + s;
    float *restrict v = a->mq ? sv : a->v + s;
    if (a->mq) {
        const float am = a->mabs[blk], av = a->vabs[blk];
        const uint8_t *mq = a->mq + s, *vq = a->vq + s;
        int64_t i = 0;
#if LT_PATH == LT_AVX512VBMI
        for (; i + 64 <= len; i += 64) {
            __m512 dm[4], dv[4];
            dec64(0, mq + i, am, dm);
            dec64(1, vq + i, av, dv);
            for (int k = 0; k < 4; k++) {
                _mm512_storeu_ps(m + i + 16 * k, dm[k]);
                _mm512_storeu_ps(v + i + 16 * k, dv[k]);
            }
        }
#endif
        for (; i < len; i++) {
            m[i] = g_code[0][mq[i]] * am;
            v[i] = g_code[1][vq[i]] * av;
        }
    }
    update_range(a, s, len, m, v);
    if (a->mq) {
        float am = 0.0f, av = 0.0f;
        int64_t i0 = 0;
#if LT_HAS_AVX512
        __m512 xam = _mm512_setzero_ps(), xav = _mm512_setzero_ps();
        for (; i0 + 16 <= len; i0 += 16) {
            xam = _mm512_max_ps(xam, _mm512_abs_ps(_mm512_loadu_ps(m + i0)));
            xav = _mm512_max_ps(xav, _mm512_loadu_ps(v + i0));
        }
        am = _mm512_reduce_max_ps(xam);
        av = _mm512_reduce_max_ps(xav);
#endif
        for (int64_t i = i0; i < len; i++) {
            const float x = fabsf(m[i]);
            am = x > am ? x : am;
            av = v[i] > av ? v[i] : av;
        }
        a->mabs[blk] = am;
        a->vabs[blk] = av;
        const float im = am > 0.0f ? 1.0f / am : 0.0f, iv = av > 0.0f ? 1.0f / av : 0.0f;
        uint8_t *mq = a->mq + s, *vq = a->vq + s;
        i0 = 0;
#if LT_HAS_AVX512
        if (g_enc[0].ok && g_enc[1].ok)
            for (; i0 + 64 <= len; i0 += 64) {
                enc64(0, m + i0, im, mq + i0);
                enc64(1, v + i0, iv, vq + i0);
            }
#endif
        for (int64_t i = i0; i < len; i++) {
            mq[i] = encode(0, m[i] * im);
            vq[i] = encode(1, v[i] * iv);
        }
    }
}

#if LT_PATH == LT_AVX2 || LT_PATH == LT_NEON
/* The scalar end of the vector loops' 8-bit block at s: folds the lanes[0..nl) of its new absmax, decodes,
 * updates and folds elements i0..len into its scratch sm, sv (i0: the loop's last full step), stores the absmax
 * and returns their reciprocals in inv (0 for 0). */
static void tail8(const lt_args *a, int64_t s, int64_t i0, int64_t len, float *sm, float *sv, const float *lanes_m,
                  const float *lanes_v, int nl, float inv[2]) {
    const int64_t blk = s / a->block;
    float nm = 0.0f, nv = 0.0f;
    for (int k = 0; k < nl; k++) {
        nm = lanes_m[k] > nm ? lanes_m[k] : nm;
        nv = lanes_v[k] > nv ? lanes_v[k] : nv;
    }
    for (int64_t i = i0; i < len; i++) {
        sm[i] = g_code[0][a->mq[s + i]] * a->mabs[blk];
        sv[i] = g_code[1][a->vq[s + i]] * a->vabs[blk];
    }
    update_range(a, s + i0, len - i0, sm + i0, sv + i0);
    for (int64_t i = i0; i < len; i++) {
        const float x = fabsf(sm[i]);
        nm = x > nm ? x : nm;
        nv = sv[i] > nv ? sv[i] : nv;
    }
    a->mabs[blk] = nm;
    a->vabs[blk] = nv;
    inv[0] = nm > 0.0f ? 1.0f / nm : 0.0f;
    inv[1] = nv > 0.0f ? 1.0f / nv : 0.0f;
}
#endif

/* Each vector path defines encoder_ok (its fast encoder accepted map w), vec_encode (codes of x[0..n) by it, as
 * many as its step allows; returns how many) and, but for AVX512F, do_blocks8 (blocks [b0, b1) of an 8-bit
 * tensor, scratch: two blocks' m and v). */
#include "_adamw_fused8.h"
#include "_adamw_avx2.h"
#include "_adamw_neon.h"
#define LT_BLOCKS8 (LT_PATH == LT_AVX512VBMI || LT_PATH == LT_AVX2 || LT_PATH == LT_NEON)
#if LT_PATH == LT_SCALAR /* no fast encoder */
#define encoder_ok(w) 0
#define vec_encode(w, x, out, n) 0
#endif

/* Whether the path's fast encoder accepted both maps (else every path encodes with the plain search). */
int lt_fast_encoder(void) { return encoder_ok(0) && encoder_ok(1); }

/* Codes of x[0..n) (already divided by their absmax): the path's encoder, exposed for the tests. */
void lt_encode(int which, const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = encoder_ok(which) ? vec_encode(which, x, out, n) : 0; i < n; i++) out[i] = encode(which, x[i]);
}

/* Blocks per work item of the shared queue: big enough that the 8-bit pipeline's one extra drain per item and
 * the queue's atomic are noise, small enough that a thread sharing its core with the training loop (the main
 * thread launching GPU work) only finishes fewer items instead of holding back the whole team, as equal static
 * shares would: measured there at the speed of the slowed thread. */
#define LT_ITEM_BLOCKS 8

/* Which code path this build runs: LT_AVX512VBMI (fused 8-bit loop, vector codec), LT_AVX512F (vector absmax
 * and encoder), LT_AVX2 (8-bit loop, cell encoder), LT_NEON (8-bit block loop, bucket encoder), LT_SCALAR (C the
 * compiler vectorizes). */
int lt_simd_level(void) { return LT_PATH; }

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int lt_adamw_step(const lt_args *a) {
    const int64_t bs = a->block;
    const int64_t nblk = (a->n + bs - 1) / bs;
    const int64_t nitems = (nblk + LT_ITEM_BLOCKS - 1) / LT_ITEM_BLOCKS;
    int nt = a->nthreads > 0 ? a->nthreads : 1;
    if (nitems < nt) nt = (int)(nitems > 0 ? nitems : 1);
    int failed = 0;
    const int fused = LT_BLOCKS8 && a->mq && lt_fast_encoder();
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *scratch = (float *)aligned_alloc(64, (size_t)(((bs * (fused ? 16 : 8) + 63) / 64) * 64));
        failed = !scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nitems; item++) {
            const int64_t b0 = item * LT_ITEM_BLOCKS;
            const int64_t b1 = b0 + LT_ITEM_BLOCKS < nblk ? b0 + LT_ITEM_BLOCKS : nblk;
            if (!scratch) continue;
#if LT_BLOCKS8
            if (fused) {
                do_blocks8(a, b0, b1, scratch);
                continue;
            }
#endif
            for (int64_t b = b0; b < b1; b++) {
                const int64_t s = b * bs, len = (s + bs <= a->n) ? bs : a->n - s;
                do_block(a, s, len, scratch, scratch + bs);
            }
        }
        free(scratch);
    }
    return failed;
}
