// Decoding over an e4m3 KV cache (`flash_attention_with_kvcache` on (values, scales) caches):
// the decode tile (kernel_traits.h, 64 query rows, one consumer warpgroup) with two more
// warpgroups, the converter, between the TMA producer and the consumer.
//
//   producer (WG0, one thread)  TMA: Q as always; each K/V block of the cache in e4m3, with the
//                               run of scales its rows use, into a ring of kNumSlots staging
//                               slots (K(n), V(n), K(n-1), V(n-1), ...)
//   converter (WG2-3, 256 threads) per slot: waits for its bytes and for the consumer's release
//                               of the 16-bit K or V stage, writes value * scale of every element
//                               there (the cache's layout: one scale per `scale_block` slots and
//                               kv head), arrives on k_full / v_full and frees the slot
//   consumer (WG1)              unchanged: the 16-bit decode tile's mainloop over k/v stages
//
// The converted tile holds exactly what `(values.astype(float32) * scale).astype(q.dtype)` holds
// (fp32 product, one rounding), so the output is bit for bit the 16-bit decode kernel's over the
// dequantized cache: the consumer is the same code on the same blocks. The cache is read once,
// in e4m3: half the bytes of a 16-bit cache and no dequantized copy.
//
// Why converter warpgroups and not the consumer: per 128-key d128 block (K and V, 32 KB of e4m3)
// the conversion is ~1.7k warp instructions per tensor, ~0.6-0.9 us on four warps, against
// ~1.2 us to stream the block at a 132th of the chip's bandwidth; the consumer's GEMMs and
// softmax would serialise with it; warpgroups of their own overlap both, and two of them split
// each block (measured below, Fp8CacheTraits).
#pragma once
#include "common/cute_config.h"
#include <cstdint>
#include <type_traits>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_fwd/barriers.h"
#include "flash_fwd/fp8/tail_split.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/kernel_traits.h"
#include "flash_fwd/producer.h"

namespace jax_fa3::fwd {

using namespace cute;

// Shared memory (16-bit decode tile, 2 K/V stages): Q + O + 2 * (K + V) + kNumSlots e4m3 blocks.
//   d64 : 8K + 8K + 2*2*20K + 4*10K = 136 KB      d96 : 12K + 2*2*27K + 4*13.5K = 174 KB
//   d128: 16K + 16K + 2*2*32K + 4*16K = 224 KB
// d192 and d256 would fit one slot (K and V in turn through it, the TMA latency exposed):
// not built; their FP8 caches are dequantized per call (jax_fa3/kvcache.py).
template <int kHeadDim_, typename Element_>
struct Fp8CacheTraits : KernelTraits<kHeadDim_, Element_, true, BlockN<kHeadDim_>::value, 64, 2> {
  using Base = KernelTraits<kHeadDim_, Element_, true, BlockN<kHeadDim_>::value, 64, 2>;
  using typename Base::Element;
  using Base::kBlockN, Base::kHeadDim, Base::kStages;
  using ElementCache = cutlass::float_e4m3_t;
  static_assert(kHeadDim <= 128, "the e4m3 cache's decode kernel is built for d <= 128");
  static constexpr bool kFp8Cache = true;
  // The converter: warpgroups 2 and 3, splitting each block's pieces. With the scales delivered
  // with the slot (producer.h), one warpgroup bounds the step: d128 GQA 32:4 on an H100
  // (2026-12-07, benchmarks/RESULTS.md), one / two warpgroups, us per step: b1 32k 36.8 / 29.3,
  // b8 128k 797.9 / 548. Three would leave the consumer fewer than its 240 registers.
  static constexpr int kConverterWarpGroup = 2;
  static constexpr int kNumConverterWarpGroups = 2;
  static constexpr int kNumConverterThreads = 128 * kNumConverterWarpGroups;
  static constexpr int kNumThreads = 128 * (2 + kNumConverterWarpGroups);  // producer, consumer
  // setmaxnreg: the 512 threads hold 128 registers each at entry (__launch_bounds__); the
  // producer gives back to 24, the converter to 120, the consumer raises to 240:
  // 128 * (24 + 240) + 256 * 120 = 64512 <= 512 * 128. A raise past what the others gave back
  // would wait forever; the pool is what the CTA holds at entry, not the SM's 65536 (640 threads
  // hold 640 * 96).
  static constexpr int kConverterRegs = 120;
  static constexpr int kEntryRegs = 65536 / kNumThreads / 8 * 8;
  static_assert(kConverterRegs < kEntryRegs &&
                    128 * (Base::kProducerRegs + Base::kConsumerRegs) +
                            kNumConverterThreads * kConverterRegs <= kNumThreads * kEntryRegs,
                "the setmaxnreg budgets exceed the registers the CTA holds at entry");
  // e4m3 bytes of one K or V block; the slots are plain (keys, d) rows: a half-warp's 8-byte
  // reads cover one 128-byte row (d128), so they are free of bank conflicts.
  static constexpr int kSlotBytes = kBlockN * kHeadDim;
  static constexpr int kNumSlots = 4;
  // Each slot's scales come with its bytes, under the same barrier (producer.h,
  // load_cache_slot): the run of scales its rows use, at most kBlockN. The converter used to
  // load them itself from global memory, one block ahead; that load's latency, not the
  // conversion, then set a block's time (~2.7 us per 128-key block on an H100 with one or two
  // converter warpgroups, 2026-12-07).
  static constexpr int kScaleBox = kBlockN;
  static constexpr uint32_t kTmaBytesSlot = kSlotBytes;
  using SmemLayoutSlot = Layout<Shape<Int<kBlockN>, Int<kHeadDim>, Int<kNumSlots>>,
                                Stride<Int<kHeadDim>, _1, Int<kSlotBytes>>>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<typename Base::SmemLayoutQ>, 1024> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<typename Base::SmemLayoutK>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<typename Base::SmemLayoutV>, 1024> v;
    alignas(1024) cute::array_aligned<Element, Base::kOBufferElems, 1024> o;
    alignas(128) cute::array_aligned<ElementCache, kNumSlots * kSlotBytes, 128> slots;
    alignas(128) float slot_scales[kNumSlots][kScaleBox];
    JAX_FA3_FWD_PIPELINE_BARRIERS(kStages)
    uint64_t slot_full[kNumSlots];   // 2 + tx: the producer's TMA of a block, its scales' cp.asyncs
    uint64_t slot_empty[kNumSlots];  // 1: the converter's thread 0, once all its threads read it
  };
  __device__ __forceinline__ static Element* o_smem(SharedStorage& ss) {
    if constexpr (Base::kEarlyQRelease) {
      return ss.o.data();
    } else {
      return ss.q.data();
    }
  }
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimitBytes, "shared memory over the 227 KB per-block limit");
};

// Two floats -> one 32-bit pair of Element (bf16 or fp16), round to nearest even: lo in bits 0..15.
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t pair;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  } else {
    static_assert(std::is_same_v<Element, cutlass::half_t>, "a 16-bit query type");
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  }
  return pair;
}

// Converts one slot (an e4m3 (kBlockN, d) block) into 16-bit stage `stage` of `dst` (the K or V
// stages, SmemLayoutK == SmemLayoutV), each key row times its scale. Thread t takes 8-element
// pieces t, t + 128, ... of the block in row-major order: 8 bytes in, one 16-byte store out
// (8 consecutive d of a row are one 16-byte unit of the swizzled layout). `scale_of(row)` is the
// scale of key row `row` of the block.
template <class Traits, class ScaleOf>
__device__ __forceinline__ void convert_slot(const uint8_t* slot,
                                             typename Traits::Element* dst_stages, int stage,
                                             int thread, ScaleOf&& scale_of) {
  using Element = typename Traits::Element;
  constexpr int kPiecesPerRow = Traits::kHeadDim / 8;
  constexpr int kPieces = Traits::kBlockN * kPiecesPerRow;
  constexpr int kThreads = Traits::kNumConverterThreads;
  Tensor s_dst = make_tensor(make_smem_ptr(dst_stages), typename Traits::SmemLayoutK{});
  // Unrolled whole (16 pieces a thread at d128), so every load of the block is in flight before
  // the first conversion needs one.
#pragma unroll
  for (int i = 0; i < (kPieces + kThreads - 1) / kThreads; ++i) {
    const int piece = thread + i * kThreads;
    if (kPieces % kThreads != 0 && piece >= kPieces) break;
    const int row = piece / kPiecesPerRow;
    const int col = 8 * (piece % kPiecesPerRow);
    const uint2 bytes = *reinterpret_cast<const uint2*>(slot + row * Traits::kHeadDim + col);
    const float scale = scale_of(row);
    uint32_t out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = j < 2 ? bytes.x : bytes.y;
      const uint16_t pair = static_cast<uint16_t>(word >> (16 * (j % 2)));
      uint32_t halves;  // two fp16: e4m3 -> f16 is exact
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
      float lo, hi;
      asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
          : "=f"(lo), "=f"(hi) : "r"(halves));
      out[j] = pack_pair<Element>(lo * scale, hi * scale);
    }
    *reinterpret_cast<uint4*>(&s_dst(row, col, stage)) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// The converter warpgroups: walk the work items and K/V blocks exactly as the producer and the
// consumer do (n_max - 1 down to n_min; K then V), so the slot ring and the stage ring advance
// alike on all three sides.
template <class Traits>
__device__ __forceinline__ void run_cache_converter(KernelParams<Traits> const& p,
                                                    typename Traits::SharedStorage& ss,
                                                    int thread) {
  const FlashFwdScalars& sc = p.s;
  const int scale_block = p.scale_block;
  PipelineState<Traits::kStages> kv;
  PipelineState<Traits::kNumSlots> slot;
  for (int index = blockIdx.x; index < num_work_items<false>(p.scheduler); index += gridDim.x) {
    const ItemBlocks work =
        item_blocks<false, true>(p.scheduler, index, Traits::kBlockM, Traits::kBlockN, sc);
    const BlockRange range = work.piece.visit;
    for (int n_block = range.n_max - 1; n_block >= range.n_min; --n_block) {
      const int first_row = block_first_slot<Traits>(sc, n_block) % scale_block;
      auto convert = [&](uint64_t* full, uint64_t* empty, typename Traits::Element* stages) {
        mbar_wait(&ss.slot_full[slot.stage], slot.phase);
        mbar_wait(empty, kv.phase ^ 1);
        const float* scales = ss.slot_scales[slot.stage];
        convert_slot<Traits>(reinterpret_cast<const uint8_t*>(ss.slots.data()) +
                                 slot.stage * Traits::kSlotBytes,
                             stages, kv.stage, thread,
                             [&](int row) { return scales[(first_row + row) / scale_block]; });
        // Generic-proxy stores, read by wgmma (async proxy) once the consumer saw `full`: every
        // thread fences its own, the warpgroups meet, one thread arrives for all (as many
        // arrivals as threads on each of two mbarriers per tensor and block were as many
        // shared-memory atomics).
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(kBarrierConverter, Traits::kNumConverterThreads);
        if (thread == 0) {
          mbar_arrive(full);
          mbar_arrive(&ss.slot_empty[slot.stage]);
        }
        slot.advance();
      };
      convert(&ss.k_full[kv.stage], &ss.k_empty[kv.stage], ss.k.data());
      convert(&ss.v_full[kv.stage], &ss.v_empty[kv.stage], ss.v.data());
      kv.advance();
    }
  }
}

}  // namespace jax_fa3::fwd
