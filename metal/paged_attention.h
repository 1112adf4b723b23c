// Paged decode attention: shared device code for the kernel bodies in paged_attention.metal.
//
// One threadgroup handles one (sequence, kv head[, partition]). Its NSG simdgroups take the
// context's tokens round-robin; within a simdgroup the 32 lanes split head_dim, so a K or V row
// is one coalesced read. Each row is read once and used for all G query heads sharing the kv
// head (grouped-query attention). Softmax and accumulators are fp32 and online (running max).

#include <metal_stdlib>
using namespace metal;

// -FLT_MAX: a finite "minus infinity", so exp(m_old - m_new) never computes inf - inf.
#define PA_FINITE_MIN (-3.4028234663852886e38f)
// Tokens whose block ids are staged in threadgroup memory at a time.
#define PA_CHUNK_TOKENS 256

// Block-table entries staged per chunk: whole blocks, at least one.
#define PA_CHUNK_BLOCKS(BS) ((BS) >= PA_CHUNK_TOKENS ? 1 : PA_CHUNK_TOKENS / (BS))

// Per-simdgroup online-softmax state; each lane owns DPL = head_dim / 32 output dims.
template <int G, int DPL>
struct PAState {
  float m[G];         // running max of the scores
  float l[G];         // running sum of exp(score - m)
  float acc[G][DPL];  // running sum of exp(score - m) * v
};

// Attend to tokens [tok_begin, tok_end) of one sequence for the G query heads of kv head `kvh`,
// leaving each simdgroup's partial state in `st`. Every thread of the threadgroup must call it.
// Table is `const device int32_t*`, or `const constant int32_t*` when MLX passes a table of
// fewer than 8 entries in the constant address space.
template <typename T, int HD, int BS, int G, int NSG, typename Table>
inline void pa_attend(
    thread PAState<G, HD / 32>& st,
    const device T* q,                    // [num_seqs, num_kv_heads * G, HD]
    const device T* k_cache,              // [num_blocks, num_kv_heads, BS, HD]
    const device T* v_cache,              // [num_blocks, num_kv_heads, BS, HD]
    Table block_tables,                   // [num_seqs, max_blocks] int32
    int max_blocks,
    int num_kv_heads,
    float scale,
    int seq,
    int kvh,
    int tok_begin,                        // a multiple of BS
    int tok_end,
    uint sg,                              // simdgroup index in the threadgroup
    uint lane,                            // thread index in the simdgroup
    uint tid,                             // thread index in the threadgroup
    threadgroup float* tg_q,              // [G, HD] scaled queries
    threadgroup int* tg_blocks) {         // [PA_CHUNK_BLOCKS(BS)] physical block ids
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int DPL = HD / 32;
  constexpr int NT = NSG * 32;
  constexpr int CB = PA_CHUNK_BLOCKS(BS);
  constexpr int CT = CB * BS;

  // Stage the G query heads once per threadgroup, pre-scaled, so each query is read once.
  const device T* qg = q + ((size_t)seq * num_kv_heads + kvh) * G * HD;
  for (int i = tid; i < G * HD; i += NT) {
    tg_q[i] = scale * static_cast<float>(qg[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float qr[G][DPL];
  for (int g = 0; g < G; g++) {
    st.m[g] = PA_FINITE_MIN;
    st.l[g] = 0.0f;
    for (int i = 0; i < DPL; i++) {
      qr[g][i] = tg_q[g * HD + lane * DPL + i];
      st.acc[g][i] = 0.0f;
    }
  }

  const Table table = block_tables + (size_t)seq * max_blocks;
  const size_t block_stride = (size_t)num_kv_heads * BS * HD;  // elements per physical block
  const size_t head_offset = (size_t)kvh * BS * HD + lane * DPL;

  for (int c0 = tok_begin; c0 < tok_end; c0 += CT) {
    // Stage this chunk's block ids: each table entry is read once per threadgroup.
    const int b0 = c0 / BS;
    for (int i = tid; i < CB; i += NT) {
      tg_blocks[i] = (b0 + i) * BS < tok_end ? table[b0 + i] : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int c1 = min(c0 + CT, tok_end);
    for (int t = c0 + (int)sg; t < c1; t += NSG) {
      const size_t row = (size_t)tg_blocks[t / BS - b0] * block_stride + head_offset +
          (size_t)(t % BS) * HD;
      float k[DPL];
      for (int i = 0; i < DPL; i++) {
        k[i] = static_cast<float>(k_cache[row + i]);
      }
      float s[G];
      for (int g = 0; g < G; g++) {
        float d = 0.0f;
        for (int i = 0; i < DPL; i++) {
          d += qr[g][i] * k[i];
        }
        s[g] = simd_sum(d);
      }
      float v[DPL];
      for (int i = 0; i < DPL; i++) {
        v[i] = static_cast<float>(v_cache[row + i]);
      }
      for (int g = 0; g < G; g++) {
        const float m_new = max(st.m[g], s[g]);
        const float corr = exp(st.m[g] - m_new);  // rescales what was summed under the old max
        const float p = exp(s[g] - m_new);
        st.l[g] = st.l[g] * corr + p;
        for (int i = 0; i < DPL; i++) {
          st.acc[g][i] = st.acc[g][i] * corr + p * v[i];
        }
        st.m[g] = m_new;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_blocks is refilled by the next chunk
  }
}

// Combine the simdgroups' (max, sum): M[g] is the threadgroup max, L[g] the sum rescaled to it.
template <int G, int DPL, int NSG>
inline void pa_merge_stats(
    thread PAState<G, DPL>& st,
    threadgroup float* tg_stats,  // [2, NSG, G]: maxes then sums
    uint sg,
    uint lane,
    thread float* M,              // [G]
    thread float* L) {            // [G]
  if (lane == 0) {
    for (int g = 0; g < G; g++) {
      tg_stats[sg * G + g] = st.m[g];
      tg_stats[(NSG + sg) * G + g] = st.l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int g = 0; g < G; g++) {
    float mx = PA_FINITE_MIN;
    for (int s = 0; s < NSG; s++) {
      mx = max(mx, tg_stats[s * G + g]);
    }
    float sum = 0.0f;
    for (int s = 0; s < NSG; s++) {
      sum += tg_stats[(NSG + s) * G + g] * exp(tg_stats[s * G + g] - mx);
    }
    M[g] = mx;
    L[g] = sum;
  }
}

// Sum head g's accumulators over the simdgroups, rescaled to max Mg. Returns output dim `tid`
// (meaningful for tid < HD). Every thread of the threadgroup must call it.
template <int HD, int G, int NSG>
inline float pa_reduce_head(
    thread PAState<G, HD / 32>& st,
    int g,
    float Mg,
    threadgroup float* tg_o,  // [NSG, HD]
    uint sg,
    uint lane,
    uint tid) {
  static_assert(NSG * 32 >= HD, "one thread per output dim");
  constexpr int DPL = HD / 32;
  const float f = exp(st.m[g] - Mg);
  for (int i = 0; i < DPL; i++) {
    tg_o[sg * HD + lane * DPL + i] = st.acc[g][i] * f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float o = 0.0f;
  if (tid < HD) {
    for (int s = 0; s < NSG; s++) {
      o += tg_o[s * HD + tid];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_o is reused for the next head
  return o;
}
