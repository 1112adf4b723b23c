// Paged decode attention: the kernel bodies passed to mx.fast.metal_kernel.
//
// MLX writes each kernel's signature from its inputs and outputs, so this file holds only
// bodies, one per `// @kernel NAME` section; paged_attention.h is their shared header.
// Template parameters: T (q/cache/out dtype), HD (head_dim), BS (block size),
// G (query heads per kv head), NSG (simdgroups per threadgroup). The partition size is not a
// template value (it would name a new kernel as contexts grow): the split kernel derives it
// from its grid and the table width. Context lengths are clamped to the table's width
// (max_blocks * BS), so inconsistent metadata never reads past a sequence's table row.
//
// Quantized KV cache: kernel `KIND_quant` (KIND = paged_attention or paged_attention_partitioned)
// is KIND's body after `PA_QUANT_VIEWS` (paged_attention.h), with inputs k_data, k_scales,
// k_biases, v_data, v_scales, v_biases in place of k_cache, v_cache and template values BITS
// (4 or 8) and GS (values per scale/bias group) besides; each lane dequantizes its dims of a
// row in registers as it reads them. The merge pass is shared.

// @kernel paged_attention
// Single pass: one threadgroup per (kv head, sequence) covers the whole context.
// launch: grid (32 * NSG, num_kv_heads, num_seqs), threadgroup (32 * NSG, 1, 1)
// inputs:  q            [num_seqs, num_heads, HD] T
//          k_cache      [num_blocks, num_kv_heads, BS, HD] T
//          v_cache      [num_blocks, num_kv_heads, BS, HD] T
//          block_tables [num_seqs, max_blocks] int32
//          context_lens [num_seqs] int32
//          scale        [] float32
// output:  out          [num_seqs, num_heads, HD] T
const int kvh = threadgroup_position_in_grid.y;
const int seq = threadgroup_position_in_grid.z;
const int num_kv_heads = threadgroups_per_grid.y;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;

threadgroup float tg_q[G * HD];
threadgroup int tg_blocks[2 * PA_CHUNK_BLOCKS(BS)];
threadgroup float tg_stats[2 * NSG * G];
threadgroup float tg_o[2 * NSG * HD];

const int max_blocks = block_tables_shape[1];
const int ctx = clamp(context_lens[seq], 0, max_blocks * BS);

PAState<G, HD / 32> st;
pa_attend<T, HD, BS, G, NSG>(
    st, q, k_cache, v_cache, block_tables, max_blocks, num_kv_heads, scale,
    seq, kvh, 0, ctx, sg, lane, tid, tg_q, tg_blocks);
float M[G];
float L[G];
pa_merge_stats<G, HD / 32, NSG>(st, tg_stats, sg, lane, M, L);

device T* o = out + ((size_t)seq * num_kv_heads + kvh) * G * HD;
for (int g = 0; g < G; g++) {
  const float x = pa_reduce_head<HD, G, NSG>(st, g, M[g], tg_o, sg, lane, tid);
  if (tid < HD) {
    o[g * HD + tid] = static_cast<T>(L[g] > 0.0f ? x / L[g] : 0.0f);
  }
}

// @kernel paged_attention_partitioned
// First pass of the split (flash-decoding) path: threadgroup (partition, kv head, sequence)
// covers tokens [partition * PART, (partition + 1) * PART) of the context, PART being the table
// width split evenly over the partitions, rounded up to whole blocks; it writes its
// unnormalised output with its max and sum (log2 domain) for paged_attention_merge.
// launch: grid (32 * NSG * num_partitions, num_kv_heads, num_seqs), threadgroup (32 * NSG, 1, 1)
// inputs:  q            [num_seqs, num_heads, HD] T
//          k_cache      [num_blocks, num_kv_heads, BS, HD] T
//          v_cache      [num_blocks, num_kv_heads, BS, HD] T
//          block_tables [num_seqs, max_blocks] int32
//          context_lens [num_seqs] int32
//          scale        [] float32
// outputs: part_out     [num_seqs, num_heads, num_partitions, HD] float32
//          part_max     [num_seqs, num_heads, num_partitions] float32
//          part_sum     [num_seqs, num_heads, num_partitions] float32
const int part = threadgroup_position_in_grid.x;
const int kvh = threadgroup_position_in_grid.y;
const int seq = threadgroup_position_in_grid.z;
const int num_parts = threadgroups_per_grid.x;
const int num_kv_heads = threadgroups_per_grid.y;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;

const int max_blocks = block_tables_shape[1];
const int part_tokens = ((max_blocks * BS + num_parts - 1) / num_parts + BS - 1) / BS * BS;
const int tok_begin = part * part_tokens;
const int tok_end = min(clamp(context_lens[seq], 0, max_blocks * BS), tok_begin + part_tokens);
const size_t row0 = ((size_t)seq * num_kv_heads + kvh) * G * num_parts + part;

if (tok_begin >= tok_end) {
  // Past this sequence's end: an empty partial that the merge weighs by exp(-huge) = 0.
  for (int g = 0; g < G; g++) {
    const size_t r = row0 + (size_t)g * num_parts;
    if (tid < HD) {
      part_out[r * HD + tid] = 0.0f;
    }
    if (tid == 0) {
      part_max[r] = PA_FINITE_MIN;
      part_sum[r] = 0.0f;
    }
  }
  return;
}

threadgroup float tg_q[G * HD];
threadgroup int tg_blocks[2 * PA_CHUNK_BLOCKS(BS)];
threadgroup float tg_stats[2 * NSG * G];
threadgroup float tg_o[2 * NSG * HD];

PAState<G, HD / 32> st;
pa_attend<T, HD, BS, G, NSG>(
    st, q, k_cache, v_cache, block_tables, max_blocks, num_kv_heads, scale,
    seq, kvh, tok_begin, tok_end, sg, lane, tid, tg_q, tg_blocks);
float M[G];
float L[G];
pa_merge_stats<G, HD / 32, NSG>(st, tg_stats, sg, lane, M, L);

for (int g = 0; g < G; g++) {
  const float x = pa_reduce_head<HD, G, NSG>(st, g, M[g], tg_o, sg, lane, tid);
  const size_t r = row0 + (size_t)g * num_parts;
  if (tid < HD) {
    part_out[r * HD + tid] = x;
  }
  if (tid == 0) {
    part_max[r] = M[g];
    part_sum[r] = L[g];
  }
}

// @kernel paged_attention_merge
// Second pass of the split path: one simdgroup per (head, sequence) rescales the partitions'
// partial outputs to their common max (log2 domain) and normalises. Lanes take partitions 32
// at a time.
// launch: grid (32, num_heads, num_seqs), threadgroup (32, 1, 1)
// inputs:  part_out [num_seqs, num_heads, num_partitions, HD] float32
//          part_max [num_seqs, num_heads, num_partitions] float32
//          part_sum [num_seqs, num_heads, num_partitions] float32
// output:  out      [num_seqs, num_heads, HD] T
constexpr int DPL = HD / 32;
const int head = threadgroup_position_in_grid.y;
const int seq = threadgroup_position_in_grid.z;
const int num_heads = threadgroups_per_grid.y;
const int num_parts = part_max_shape[2];
const int lane = thread_index_in_simdgroup;
const size_t r = ((size_t)seq * num_heads + head) * num_parts;

float gmax = PA_FINITE_MIN;
for (int p0 = 0; p0 < num_parts; p0 += 32) {
  gmax = max(gmax, simd_max(p0 + lane < num_parts ? part_max[r + p0 + lane] : PA_FINITE_MIN));
}

float total = 0.0f;
float acc[DPL];
for (int i = 0; i < DPL; i++) {
  acc[i] = 0.0f;
}
for (int p0 = 0; p0 < num_parts; p0 += 32) {
  const bool mine = p0 + lane < num_parts;
  const float w = mine ? fast::exp2(part_max[r + p0 + lane] - gmax) : 0.0f;  // partition weight
  total += simd_sum(mine ? w * part_sum[r + p0 + lane] : 0.0f);
  for (int p = p0; p < min(p0 + 32, num_parts); p++) {
    const float wp = simd_shuffle(w, (ushort)(p - p0));
    if (wp == 0.0f) {
      continue;  // an empty partition (past the sequence's end): nothing to read
    }
    const device float* po = part_out + (r + p) * HD + lane * DPL;
    for (int i = 0; i < DPL; i++) {
      acc[i] += wp * po[i];
    }
  }
}
device T* o = out + ((size_t)seq * num_heads + head) * HD + lane * DPL;
for (int i = 0; i < DPL; i++) {
  o[i] = static_cast<T>(total > 0.0f ? acc[i] / total : 0.0f);
}
