/* The 8-bit blocks of the NEON path of _adamw_kernel.c (included there after the per-block passes it matches bit
 * for bit): per block, one loop decodes 4 codes of each moment (NEON has no gather: 4 table loads), updates them
 * and the parameter (the operations of LT_UPDATE_LOOP in its order) and keeps the new moments in scratch with
 * their absmax; a second loop re-encodes them with the bucket encoder (_adamw_codec.h: two loads and a compare
 * per value, where the plain search takes eight dependent steps). A block's last len % 4 elements take the
 * scalar code. Compares and selects stand in for vmaxq_f32, which returns NaN where the C ternary does not. */

#if LT_PATH == LT_NEON
static inline uint32x4_t n4_bf16_rne(uint32x4_t u) {
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), 16);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    return vbslq_u32(nan, vdupq_n_u32(0x7fc0), r);
}

static inline uint32x4_t n4_mix(uint32x4_t x) {
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    x = vmulq_u32(x, vdupq_n_u32(0x7feb352du));
    x = veorq_u32(x, vshrq_n_u32(x, 15));
    x = vmulq_u32(x, vdupq_n_u32(0x846ca68bu));
    return veorq_u32(x, vshrq_n_u32(x, 16));
}

static inline uint32x4_t n4_bf16_stochastic(uint32x4_t u, uint32_t key, int64_t i) {
    static const uint32_t lane[4] = {0, 1, 2, 3};
    const uint32x4_t idx = vaddq_u32(vdupq_n_u32((uint32_t)i), vld1q_u32(lane));
    const uint32x4_t h = veorq_u32(vmulq_u32(idx, vdupq_n_u32(0x9e3779b9u)), vdupq_n_u32(key));
    const uint32x4_t r = vandq_u32(n4_mix(h), vdupq_n_u32(0xffff));
    const uint32x4_t special = vcgeq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    return vbslq_u32(special, n4_bf16_rne(u), vshrq_n_u32(vaddq_u32(u, r), 16));
}

static inline float32x4_t n4_load_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

static inline float32x4_t n4_decode(int w, const uint8_t *q, float am) {
    const float t[4] = {g_code[w][q[0]], g_code[w][q[1]], g_code[w][q[2]], g_code[w][q[3]]};
    return vmulq_n_f32(vld1q_f32(t), am);
}

static inline float32x4_t n4_max(float32x4_t x, float32x4_t y) { return vbslq_f32(vcgtq_f32(x, y), x, y); }

/* 4 elements at i of the update; g16, p16, cp are constants after inlining. */
static inline __attribute__((always_inline)) void n4_update(const lt_args *a, int64_t i, float32x4_t *m,
                                                            float32x4_t *v, int g16, int p16, int cp) {
    const float32x4_t g = vmulq_n_f32(g16 ? n4_load_bf16((const uint16_t *)a->grad + i)
                                          : vld1q_f32((const float *)a->grad + i),
                                      a->grad_scale);
    const float32x4_t mi = vfmaq_f32(*m, vdupq_n_f32(a->w1), vsubq_f32(g, *m));
    const float32x4_t vr = vfmaq_f32(vmulq_n_f32(*v, a->beta2), vmulq_n_f32(g, a->w2), g);
    const float32x4_t vi = n4_max(vmulq_n_f32(vmulq_f32(mi, mi), a->v_floor), vr);
    const float32x4_t denom = vaddq_f32(vdivq_f32(vsqrtq_f32(vi), vdupq_n_f32(a->bc2_sqrt)), vdupq_n_f32(a->eps));
    const float32x4_t p = p16 ? n4_load_bf16(a->p16 + i) : vld1q_f32(a->p32 + i);
    const float32x4_t pn =
        vaddq_f32(vmulq_n_f32(p, a->decay), vdivq_f32(vmulq_n_f32(mi, a->neg_step), denom));
    if (p16) {
        const uint16x4_t b = vmovn_u32(n4_bf16_stochastic(vreinterpretq_u32_f32(pn), a->sr_key, i));
        vst1_u16(a->p16 + i, b);
        if (cp) vst1_u16(a->copy + i, b);
    } else {
        vst1q_f32(a->p32 + i, pn);
        if (cp) vst1_u16(a->copy + i, vmovn_u32(n4_bf16_rne(vreinterpretq_u32_f32(pn))));
    }
    *m = mi;
    *v = vi;
}

/* One 8-bit block at s; sm, sv: scratch for its moments. */
static inline __attribute__((always_inline)) void block8_t(const lt_args *a, int64_t s, int64_t len, float *sm,
                                                           float *sv, int g16, int p16, int cp) {
    const lt_args local = *a; /* a copy the stores cannot alias: scalars and pointers stay in registers */
    a = &local;
    const int64_t blk = s / a->block, nfull = len & ~(int64_t)3;
    const float am = a->mabs[blk], av = a->vabs[blk];
    float32x4_t xam = vdupq_n_f32(0.0f), xav = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < nfull; i += 4) {
        float32x4_t m = n4_decode(0, a->mq + s + i, am), v = n4_decode(1, a->vq + s + i, av);
        n4_update(a, s + i, &m, &v, g16, p16, cp);
        vst1q_f32(sm + i, m);
        vst1q_f32(sv + i, v);
        xam = n4_max(vabsq_f32(m), xam);
        xav = n4_max(v, xav);
    }
    float lm[4], lv[4], inv[2];
    vst1q_f32(lm, xam);
    vst1q_f32(lv, xav);
    tail8(a, s, nfull, len, sm, sv, lm, lv, 4, inv);
    for (int64_t i = 0; i < len; i++) {
        a->mq[s + i] = bkt_encode(0, sm[i] * inv[0]);
        a->vq[s + i] = bkt_encode(1, sv[i] * inv[1]);
    }
}

/* Blocks [b0, b1) of an 8-bit tensor, one at a time; scratch holds one block's m and v. */
static void do_blocks8(const lt_args *a, int64_t b0, int64_t b1, float *scratch) {
    const int g16 = a->grad_bf16 != 0, p16 = a->p16 != NULL, cp = a->copy != NULL;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = b * a->block, len = s + a->block <= a->n ? a->block : a->n - s;
        float *sm = scratch, *sv = scratch + a->block;
        switch (g16 | p16 << 1 | cp << 2) {
        case 0: block8_t(a, s, len, sm, sv, 0, 0, 0); break;
        case 1: block8_t(a, s, len, sm, sv, 1, 0, 0); break;
        case 2: block8_t(a, s, len, sm, sv, 0, 1, 0); break;
        case 3: block8_t(a, s, len, sm, sv, 1, 1, 0); break;
        case 4: block8_t(a, s, len, sm, sv, 0, 0, 1); break;
        case 5: block8_t(a, s, len, sm, sv, 1, 0, 1); break;
        case 6: block8_t(a, s, len, sm, sv, 0, 1, 1); break;
        default: block8_t(a, s, len, sm, sv, 1, 1, 1); break;
        }
    }
}

static int encoder_ok(int w) { return g_bkt[w].ok; }

/* The bucket encoder of the tests' lt_encode: codes of x[0..n); returns how many it wrote. */
static int64_t vec_encode(int w, const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bkt_encode(w, x[i]);
    return n;
}
#endif
