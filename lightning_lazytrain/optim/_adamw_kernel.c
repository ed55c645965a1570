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
static uint8_t g_lut[2][65536];

/* Tables: index 0 = signed map (first moment), 1 = unsigned map (second moment). */
void lt_set_tables(const float *code_s, const uint8_t *lut_s, const float *thr_s, const float *code_u,
                   const uint8_t *lut_u, const float *thr_u) {
    memcpy(g_code[0], code_s, sizeof(g_code[0]));
    memcpy(g_code[1], code_u, sizeof(g_code[1]));
    memcpy(g_thr[0], thr_s, sizeof(g_thr[0]));
    memcpy(g_thr[1], thr_u, sizeof(g_thr[1]));
    memcpy(g_lut[0], lut_s, sizeof(g_lut[0]));
    memcpy(g_lut[1], lut_u, sizeof(g_lut[1]));
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

static inline uint8_t encode(int which, float x) {
    uint8_t c = g_lut[which][f2u(x) >> 16];
    return (uint8_t)(c + (x > g_thr[which][c]));
}

static void do_block(const lt_args *a, int64_t s, int64_t len, float *restrict g, float *restrict m,
                     float *restrict v, float *restrict p) {
    const int64_t blk = s / a->block;
    if (a->grad_bf16) {
        const uint16_t *gr = (const uint16_t *)a->grad + s;
        for (int64_t i = 0; i < len; i++) g[i] = u2f((uint32_t)gr[i] << 16);
    } else {
        memcpy(g, (const float *)a->grad + s, (size_t)len * 4);
    }
    if (a->grad_scale != 1.0f) {
        const float sc = a->grad_scale;
        for (int64_t i = 0; i < len; i++) g[i] *= sc;
    }
    if (a->mq) {
        const float am = a->mabs[blk], av = a->vabs[blk];
        const uint8_t *mq = a->mq + s, *vq = a->vq + s;
        for (int64_t i = 0; i < len; i++) {
            m[i] = g_code[0][mq[i]] * am;
            v[i] = g_code[1][vq[i]] * av;
        }
    } else {
        memcpy(m, a->m + s, (size_t)len * 4);
        memcpy(v, a->v + s, (size_t)len * 4);
    }
    if (a->p32) {
        memcpy(p, a->p32 + s, (size_t)len * 4);
    } else {
        const uint16_t *ph = a->p16 + s;
        for (int64_t i = 0; i < len; i++) p[i] = u2f((uint32_t)ph[i] << 16);
    }
    const float decay = a->decay, w1 = a->w1, b2 = a->beta2, w2 = a->w2;
    const float ns = a->neg_step, bc2 = a->bc2_sqrt, eps = a->eps;
    for (int64_t i = 0; i < len; i++) {
        const float gi = g[i];
        const float mi = fmaf(w1, gi - m[i], m[i]);
        const float vi = fmaf(w2 * gi, gi, v[i] * b2); /* torch's addcmul is this fma */
        const float denom = sqrtf(vi) / bc2 + eps;
        const float pi = p[i] * decay;
        p[i] = pi + ns * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
    if (a->p32) {
        memcpy(a->p32 + s, p, (size_t)len * 4);
        if (a->copy) {
            uint16_t *c = a->copy + s;
            for (int64_t i = 0; i < len; i++) c[i] = bf16_rne(p[i]);
        }
    } else {
        uint16_t *ph = a->p16 + s;
        const uint32_t key = a->sr_key;
        for (int64_t i = 0; i < len; i++) ph[i] = bf16_stochastic(p[i], key, s + i);
        if (a->copy) memcpy(a->copy + s, ph, (size_t)len * 2);
    }
    if (a->mq) {
        float am = 0.0f, av = 0.0f;
        for (int64_t i = 0; i < len; i++) {
            const float x = fabsf(m[i]);
            am = x > am ? x : am;
            av = v[i] > av ? v[i] : av;
        }
        a->mabs[blk] = am;
        a->vabs[blk] = av;
        const float im = am > 0.0f ? 1.0f / am : 0.0f, iv = av > 0.0f ? 1.0f / av : 0.0f;
        uint8_t *mq = a->mq + s, *vq = a->vq + s;
        for (int64_t i = 0; i < len; i++) {
            mq[i] = encode(0, m[i] * im);
            vq[i] = encode(1, v[i] * iv);
        }
    } else {
        memcpy(a->m + s, m, (size_t)len * 4);
        memcpy(a->v + s, v, (size_t)len * 4);
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
        float *scratch = (float *)aligned_alloc(64, (size_t)(((bs * 16 + 63) / 64) * 64));
        if (!scratch) {
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            if (!scratch) continue;
            const int64_t s = b * bs;
            const int64_t len = (s + bs <= a->n) ? bs : a->n - s;
            do_block(a, s, len, scratch, scratch + bs, scratch + 2 * bs, scratch + 3 * bs);
        }
        free(scratch);
    }
    return failed;
}
