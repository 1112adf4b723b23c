// Paged decode attention: the kernel bodies passed to mx.fast.metal_kernel.
//
// MLX writes each kernel's signature from its inputs and outputs, so this file holds only
// bodies, one per `// @kernel NAME` section; paged_attention.h is their shared header.
// Template parameters: T (q/cache/out dtype), HD (head_dim), BS (block size),
// G (query heads per kv head), NSG (simdgroups per threadgroup), HAS_SINKS (0 or 1: read the
// `sinks` input; single pass and merge only). A sliding window is the runtime input `window`
// (one variant for every window size). The partition size is not a template value (it would
// name a new kernel as contexts grow): the split kernel derives it from its grid and the
// table width. Context lengths are clamped to the table's width
// (max_blocks * BS; the real width: the wrapper pads small tables with rows, never columns), so
// inconsistent metadata never reads past a sequence's table row.
//
// Quantized KV cache: kernel `KIND_quant` (KIND = paged_attention or paged_attention_partitioned)
// is KIND's body after `PA_QUANT_VIEWS` (paged_attention.h), with inputs k_data, k_scales,
// k_biases, v_data, v_scales, v_biases in place of k_cache, v_cache and template values BITS
// (4 or 8) and GS (values per scale/bias group) besides; each lane dequantizes its dims of a
// row in registers as it reads them. The merge pass is shared; its NSG is its own
// (MERGE_SIMDGROUPS in attention/metal.py).

// @kernel paged_attention
// Single pass: one threadgroup per (kv head, sequence) covers the whole context.
// launch: grid (32 * NSG, num_kv_heads, num_seqs), threadgroup (32 * NSG, 1, 1)
// inputs:  q            [num_seqs, num_heads, HD] T
//          k_cache      [num_blocks, num_kv_heads, BS, HD] T
//          v_cache      [num_blocks, num_kv_heads, BS, HD] T
//          block_tables [num_seqs, max_blocks] int32
//          context_lens [num_seqs] int32
//          scale        [] float32
//          window       [] int32: sliding window (0: none)
//          sinks        [>= num_heads] float32: per-head sink logits (read when HAS_SINKS)
// output:  out          [num_seqs, num_heads, HD] T
const int kvh = threadgroup_position_in_grid.y;
const int seq = threadgroup_position_in_grid.z;
const int num_kv_heads = threadgroups_per_grid.y;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;

constexpr int HS = pa_head_splits(G, pa_lane_dims(HD));  // head groups (1 unless registers bound)
constexpr int GH = pa_heads_per_simdgroup(G, pa_lane_dims(HD));
// queries [G, HD], then outputs [2, STATES, HD]; declared float4 because pa_dot reads it as
// float4 (a float array is only 4-byte aligned). PA_QO_FLOATS is a multiple of 4 (HD is of 32).
threadgroup float4 tg_qo4[PA_QO_FLOATS(G, HD, NSG) / 4];
threadgroup float* tg_qo = (threadgroup float*)tg_qo4;
threadgroup int tg_blocks[2 * PA_CHUNK_BLOCKS(BS)];
threadgroup float tg_stats[2 * PA_STATES(HD, NSG) * GH];

const int max_blocks = block_tables_shape[1];
const int ctx = clamp(PA_UNIFORM(context_lens[seq], lane), 0, max_blocks * BS);
// A window starts the loop at the first block it overlaps: only ~window rows are read.
const int win = HAS_WINDOW ? PA_UNIFORM(window, lane) : 0;  // no window: never read
const int lo = win > 0 ? max(0, ctx - win) : 0;

PAState<GH, pa_lane_dims(HD)> st;
pa_attend<T, HD, BS, G, NSG>(
    st, q, k_cache, v_cache, block_tables, max_blocks, num_kv_heads, PA_UNIFORM(scale, lane),
    seq, kvh, lo / BS * BS, ctx, lo, sg, lane, tid, tg_qo, tg_blocks);
pa_publish_stats<G, HD, NSG>(st, tg_stats, sg, lane);

device T* o = out + ((size_t)seq * num_kv_heads + kvh) * G * HD;
for (int j = 0; j < GH; j++) {
  const threadgroup float* half_o = pa_stage_slot<HD, G, NSG>(st, j, tg_stats, tg_qo, sg, lane);
  for (int i = tid; i < HS * HD; i += 32 * NSG) {  // (head group, dim) pairs
    const int g = (i / HD) * GH + j;
    if (g < G) {
      float M, L;
      pa_slot_stats<G, HD, NSG>(tg_stats, i / HD, j, M, L);
      const float x = pa_slot_output<HD, G, NSG>(half_o, i / HD, i % HD);
      // The sink joins the denominator only (log2 domain, rescaled to the max M).
      const float den =
          HAS_SINKS ? L + fast::exp2(PA_LOG2E * sinks[kvh * G + g] - M) : L;
      o[g * HD + i % HD] = static_cast<T>(L > 0.0f ? x / den : 0.0f);
    }
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
//          window       [] int32: sliding window (0: none); partitions wholly before it are empty
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
const int ctx = clamp(PA_UNIFORM(context_lens[seq], lane), 0, max_blocks * BS);
const int win = HAS_WINDOW ? PA_UNIFORM(window, lane) : 0;  // no window: never read
const int lo = win > 0 ? max(0, ctx - win) : 0;  // first position in the window
// This partition's tokens, from the first block the window overlaps.
const int tok_begin = max(part * part_tokens, lo / BS * BS);
const int tok_end = min(ctx, part * part_tokens + part_tokens);
const size_t row0 = ((size_t)seq * num_kv_heads + kvh) * G * num_parts + part;

if (tok_begin >= tok_end) {
  // Past this sequence's end or wholly before its window: an empty partial (sum 0), which the
  // merge gives weight 0.
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

constexpr int HS = pa_head_splits(G, pa_lane_dims(HD));  // head groups (1 unless registers bound)
constexpr int GH = pa_heads_per_simdgroup(G, pa_lane_dims(HD));
// queries [G, HD], then outputs [2, STATES, HD]; declared float4 because pa_dot reads it as
// float4 (a float array is only 4-byte aligned). PA_QO_FLOATS is a multiple of 4 (HD is of 32).
threadgroup float4 tg_qo4[PA_QO_FLOATS(G, HD, NSG) / 4];
threadgroup float* tg_qo = (threadgroup float*)tg_qo4;
threadgroup int tg_blocks[2 * PA_CHUNK_BLOCKS(BS)];
threadgroup float tg_stats[2 * PA_STATES(HD, NSG) * GH];

PAState<GH, pa_lane_dims(HD)> st;
pa_attend<T, HD, BS, G, NSG>(
    st, q, k_cache, v_cache, block_tables, max_blocks, num_kv_heads, PA_UNIFORM(scale, lane),
    seq, kvh, tok_begin, tok_end, lo, sg, lane, tid, tg_qo, tg_blocks);
pa_publish_stats<G, HD, NSG>(st, tg_stats, sg, lane);

for (int j = 0; j < GH; j++) {
  const threadgroup float* half_o = pa_stage_slot<HD, G, NSG>(st, j, tg_stats, tg_qo, sg, lane);
  for (int i = tid; i < HS * HD; i += 32 * NSG) {  // (head group, dim) pairs
    const int g = (i / HD) * GH + j;
    if (g < G) {
      const size_t r = row0 + (size_t)g * num_parts;
      float M, L;
      pa_slot_stats<G, HD, NSG>(tg_stats, i / HD, j, M, L);
      part_out[r * HD + i % HD] = pa_slot_output<HD, G, NSG>(half_o, i / HD, i % HD);
      if (i % HD == 0) {
        part_max[r] = M;
        part_sum[r] = L;
      }
    }
  }
}

// @kernel paged_attention_merge
// Second pass of the split path: one threadgroup of NSG simdgroups per (head, sequence).
// Simdgroup s folds partitions s, s + NSG, s + 2 NSG, ... (32 at a time, one per lane) into
// its own running (max, sum, output) in fp32, log2 domain; after one barrier, thread d sums
// output dim d over the simdgroups, each rescaled to their common max, and normalises.
// launch: grid (32 * NSG, num_heads, num_seqs), threadgroup (32 * NSG, 1, 1)
// inputs:  part_out [num_seqs, num_heads, num_partitions, HD] float32
//          part_max [num_seqs, num_heads, num_partitions] float32
//          part_sum [num_seqs, num_heads, num_partitions] float32
//          sinks    [>= num_heads] float32: per-head sink logits (read when HAS_SINKS), folded
//                   once into the merged sum
// output:  out      [num_seqs, num_heads, HD] T
constexpr int DPL = HD / 32;
const int head = threadgroup_position_in_grid.y;
const int seq = threadgroup_position_in_grid.z;
const int num_heads = threadgroups_per_grid.y;
const int num_parts = part_max_shape[2];
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const size_t r = ((size_t)seq * num_heads + head) * num_parts;

threadgroup float tg_stats[2 * NSG];  // each simdgroup's max, then its sum
threadgroup float tg_acc[NSG * HD];   // each simdgroup's unnormalised output

float m = PA_FINITE_MIN;  // this simdgroup's running max, sum and output
float l = 0.0f;
float acc[DPL];
for (int i = 0; i < DPL; i++) {
  acc[i] = 0.0f;
}
for (int p0 = sg; p0 < num_parts; p0 += 32 * NSG) {
  const int p = p0 + (int)lane * NSG;  // this lane's partition
  const bool mine = p < num_parts;
  const float pm = mine ? part_max[r + p] : PA_FINITE_MIN;
  const float ps = mine ? part_sum[r + p] : 0.0f;
  const float m_new = max(m, simd_max(pm));
  const float corr = fast::exp2(m - m_new);  // uniform: rescales what the old max summed
  l *= corr;
  for (int i = 0; i < DPL; i++) {
    acc[i] *= corr;
  }
  m = m_new;
  // An empty partition (past the sequence's end) has sum 0: weight 0, nothing to read.
  const float w = ps > 0.0f ? fast::exp2(pm - m) : 0.0f;
  l += simd_sum(w * ps);
  for (int j = 0; j < 32 && p0 + j * NSG < num_parts; j++) {
    const float wp = simd_shuffle(w, (ushort)j);
    if (wp == 0.0f) {
      continue;
    }
    const device float* po = part_out + (r + p0 + j * NSG) * HD + lane * DPL;
    for (int i = 0; i < DPL; i++) {
      acc[i] += wp * po[i];
    }
  }
}
if (lane == 0) {
  tg_stats[sg] = m;
  tg_stats[NSG + sg] = l;
}
for (int i = 0; i < DPL; i++) {
  tg_acc[sg * HD + lane * DPL + i] = acc[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float gmax = PA_FINITE_MIN;
for (int s = 0; s < NSG; s++) {
  gmax = max(gmax, tg_stats[s]);
}
device T* o = out + ((size_t)seq * num_heads + head) * HD;
// exp2(sink - gmax): the sink's share of the denominator at the common max (0 without sinks).
const float sink_w = HAS_SINKS ? fast::exp2(PA_LOG2E * sinks[head] - gmax) : 0.0f;
for (int d = tid; d < HD; d += 32 * NSG) {
  float total = 0.0f;
  float x = 0.0f;
  for (int s = 0; s < NSG; s++) {
    const float f = fast::exp2(tg_stats[s] - gmax);  // simdgroup s's share at the common max
    total += f * tg_stats[NSG + s];
    x += f * tg_acc[s * HD + d];
  }
  o[d] = static_cast<T>(total > 0.0f ? x / (total + sink_w) : 0.0f);
}
