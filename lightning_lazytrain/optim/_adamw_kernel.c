/* Fused CPU AdamW step for lightning-lazytrain's HybridAdamW.
 *
 * One pass per block of elements: read the gradient (fp32 or bf16, times the clip coefficient), read the moments
 * (fp32, or 8-bit codes + block absmax), update them, update the parameter (fp32, or bf16 with stochastic
 * rounding), write the optional bf16 streaming copy, re-quantize the moments. Blocks are spread over OpenMP
 * threads; the inner loops are plain arrays so the compiler vectorizes them (-O3 -march=native).
 * The arithmetic follows torch.optim.AdamW's single-tensor path operation by operation (fp contraction is off
 * at build time; explicit fmaf only where torch's vectorized lerp and addcmul use one), so fp32 mode matches torch to rounding.
 * Plain C with a ctypes entry point: no torch headers, so building takes about a second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
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
} lt_args;

static float g_code[2][256], g_thr[2][256];
/* Thresholds regrouped by binary-search level: level j (step 128 >> j) holds thr[k * 2 * step + step - 1] for
 * k < 2^j. The AVX-512 encoder keeps each level in registers and looks it up with permutes: gathers were 60% of
 * the 8-bit step on Zen 4. */
static float g_lev[2][8][128] __attribute__((aligned(64)));

/* Tables: index 0 = signed map (first moment), 1 = unsigned map (second moment); thr[255] must be +inf. */
void lt_set_tables(const float *code_s, const float *thr_s, const float *code_u, const float *thr_u) {
    memcpy(g_code[0], code_s, sizeof(g_code[0]));
    memcpy(g_code[1], code_u, sizeof(g_code[1]));
    memcpy(g_thr[0], thr_s, sizeof(g_thr[0]));
    memcpy(g_thr[1], thr_u, sizeof(g_thr[1]));
    for (int w = 0; w < 2; w++)
        for (int j = 0; j < 8; j++) {
            const int step = 128 >> j;
            for (int k = 0; k < (1 << j); k++) g_lev[w][j][k] = g_thr[w][k * 2 * step + step - 1];
        }
}

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

/* Nearest code = number of decision thresholds strictly below x (ties go to the lower code). */
static inline uint8_t encode(int which, float x) {
    int c = 0;
    for (int step = 128; step > 0; step >>= 1) c += (x > g_thr[which][c + step - 1]) ? step : 0;
    return (uint8_t)c;
}

#ifdef __AVX512F__
static inline __m512 lev_lookup(const float *t, int j, __m512i k) {
    if (j <= 4) return _mm512_permutexvar_ps(k, _mm512_load_ps(t));
    const __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    const __m512 lo = _mm512_permutex2var_ps(_mm512_load_ps(t), k, _mm512_load_ps(t + 16));
    if (j == 5) return lo;
    const __m512 hi = _mm512_permutex2var_ps(_mm512_load_ps(t + 32), k, _mm512_load_ps(t + 48));
    const __m512 r = _mm512_mask_blend_ps(b5, lo, hi);
    if (j == 6) return r;
    const __m512 lo2 = _mm512_permutex2var_ps(_mm512_load_ps(t + 64), k, _mm512_load_ps(t + 80));
    const __m512 hi2 = _mm512_permutex2var_ps(_mm512_load_ps(t + 96), k, _mm512_load_ps(t + 112));
    const __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    return _mm512_mask_blend_ps(b6, r, _mm512_mask_blend_ps(b5, lo2, hi2));
}

static inline __m128i encode16(int w, __m512 x) {
    __m512i c = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) { /* unrolled: j is a constant, so lev_lookup's branches fold away */
        const __m512i k = _mm512_srli_epi32(c, 8 - j);
        const __m512 t = j == 0 ? _mm512_set1_ps(g_lev[w][0][0]) : lev_lookup(g_lev[w][j], j, k);
        const __mmask16 up = _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ);
        c = _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(128 >> j));
    }
    return _mm512_cvtepi32_epi8(c);
}
#endif

/* The update proper, reading the big arrays in place: streaming all of them side by side keeps the hardware
 * prefetchers on (copying each into scratch first made this pass memory-latency bound, ~3x slower).
 * m, v point at the fp32 states, or at the block's scratch holding decoded 8-bit states. */
#define LT_UPDATE_LOOP(LOAD_G, LOAD_P, STORE_P)                                \
    for (int64_t i = 0; i < len; i++) {                                       \
        const float gi = (LOAD_G) * sc;                                       \
        const float mi = fmaf(w1, gi - m[i], m[i]);                           \
        const float vi = fmaf(w2 * gi, gi, v[i] * b2); /* = torch addcmul */  \
        const float denom = sqrtf(vi) / bc2 + eps;                            \
        const float pi = (LOAD_P) * decay;                                    \
        const float pn = pi + ns * mi / denom;                                \
        STORE_P;                                                              \
        m[i] = mi;                                                            \
        v[i] = vi;                                                            \
    }

static void do_block(const lt_args *a, int64_t s, int64_t len, float *restrict sm, float *restrict sv) {
    const int64_t blk = s / a->block;
    float *restrict m = a->mq ? sm : a->m + s;
    float *restrict v = a->mq ? sv : a->v + s;
    if (a->mq) {
        const float am = a->mabs[blk], av = a->vabs[blk];
        const uint8_t *mq = a->mq + s, *vq = a->vq + s;
        for (int64_t i = 0; i < len; i++) {
            m[i] = g_code[0][mq[i]] * am;
            v[i] = g_code[1][vq[i]] * av;
        }
    }
    const float decay = a->decay, w1 = a->w1, b2 = a->beta2, w2 = a->w2;
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
    if (a->mq) {
        float am = 0.0f, av = 0.0f;
        int64_t i0 = 0;
#ifdef __AVX512F__
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
#ifdef __AVX512F__
        const __m512 vim = _mm512_set1_ps(im), viv = _mm512_set1_ps(iv);
        for (; i0 + 16 <= len; i0 += 16) {
            _mm_storeu_si128((__m128i *)(mq + i0), encode16(0, _mm512_mul_ps(_mm512_loadu_ps(m + i0), vim)));
            _mm_storeu_si128((__m128i *)(vq + i0), encode16(1, _mm512_mul_ps(_mm512_loadu_ps(v + i0), viv)));
        }
#endif
        for (int64_t i = i0; i < len; i++) {
            mq[i] = encode(0, m[i] * im);
            vq[i] = encode(1, v[i] * iv);
        }
    }
}

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int lt_adamw_step(const lt_args *a) {
    const int64_t bs = a->block;
    const int64_t nblk = (a->n + bs - 1) / bs;
    int nt = a->nthreads > 0 ? a->nthreads : 1;
    if (nblk < nt) nt = (int)(nblk > 0 ? nblk : 1);
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *scratch = (float *)aligned_alloc(64, (size_t)(((bs * 8 + 63) / 64) * 64));
        if (!scratch) {
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            if (!scratch) continue;
            const int64_t s = b * bs;
            const int64_t len = (s + bs <= a->n) ? bs : a->n - s;
            do_block(a, s, len, scratch, scratch + bs);
        }
        free(scratch);
    }
    return failed;
}
