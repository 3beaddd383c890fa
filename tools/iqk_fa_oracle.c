// ggml_flash_attn_ext on ik's CPU backend for the inputs tools/iqk_fa_oracle.py writes (header: Dk, Dv, queries,
// cache length, heads, threads, first query's position; the scale; q f32, k f16, v f16), with the causal f16 mask
// llama.cpp builds (query t sees keys 0..first + t); writes the result ([Dv, heads, queries], float32).
#include "ggml.h"
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
int main(int argc, char ** argv) {
    FILE * f = fopen(argv[1], "rb");
    int hdr[7]; float scale;
    fread(hdr, sizeof(int), 7, f); fread(&scale, sizeof(float), 1, f);
    int dk = hdr[0], dv = hdr[1], nq = hdr[2], nkv = hdr[3], nh = hdr[4], nth = hdr[5], first = hdr[6];
    struct ggml_init_params ip = { (size_t)512*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, dk, nq, nh);
    struct ggml_tensor * k = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, dk, nkv, nh);
    struct ggml_tensor * v = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, dv, nkv, nh);
    int nqp = GGML_PAD(nq, GGML_KQ_MASK_PAD);
    struct ggml_tensor * m = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, nkv, nqp);
    fread(q->data, 1, ggml_nbytes(q), f);
    fread(k->data, 1, ggml_nbytes(k), f);
    fread(v->data, 1, ggml_nbytes(v), f);
    fclose(f);
    ggml_fp16_t * md = (ggml_fp16_t *)m->data;
    for (int t = 0; t < nqp; ++t) for (int s = 0; s < nkv; ++s)
        md[t*nkv + s] = ggml_fp32_to_fp16((t < nq && s <= first + t) ? 0.0f : -INFINITY);
    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, 0.0f);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, nth);
    FILE * g = fopen(argv[2], "wb");
    fwrite(out->data, 1, ggml_nbytes(out), g);
    fclose(g);
    return 0;
}
