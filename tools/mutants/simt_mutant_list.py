"""The planted bugs of the SIMT mutation check (tools/mutants/simt_mutants.py): each a
text of src/cuda or src/cpu replaced, which kernel_check must catch."""

from __future__ import annotations

import dataclasses

# The one-kernel all-reduce's files: its kernel, its workspaces' set-up and their layout.
ALLREDUCE_FILES = ("cuda/allreduce.cu", "cuda/peer_workspaces.cc", "cuda/peer_allreduce.h")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    race: bool = False  # a missing ordering ThreadSanitizer should report
    # Only ThreadSanitizer can see it: the bits stay right, because one device runs at a
    # time until all its block's threads wait. Caught only by a race report, with --tsan.
    tsan_only: bool = False
    count: int = 1  # the occurrences of `old`, every one replaced

    @property
    def scope(self) -> list[str]:
        """kernel_check's arguments for the part of it the mutated file reaches: the
        all-reduce's files only its own checks, every other file the rest."""
        return ["--only-allreduce"] if self.file in ALLREDUCE_FILES else ["--no-allreduce"]


# Mutant.file is relative to src/: the mutation check copies src/cuda and src/cpu.
MUTANTS = [
    Mutant(
        "FP4 rows: y's row offset counted in elements, not packed bytes",
        "cuda/row_blocks.cuh",
        "static_cast<uint8_t*>(a.y) + YByte(a, offset)};",
        "static_cast<uint8_t*>(a.y) + offset};",
    ),
    Mutant(
        "shared groups, FP4: a pair's codes stored at the element's index",
        "cuda/block_shared_rows.cuh",
        "StoreFp4<2>(y, j / 2, pair, s, a.y_packed);",
        "StoreFp4<2>(y, j, pair, s, a.y_packed);",
    ),
    Mutant(
        "register groups, FP4: the group's scale stored from every lane",
        "cuda/register_row.cuh",
        "if (index(k) % lanes == 0) StoreScale(a, row * groups + index(k) / lanes, s.scale);\n"
        "        StoreFp4",
        "StoreScale(a, row * groups + index(k) / lanes + index(k) % lanes, s.scale);\n"
        "        StoreFp4",
    ),
    Mutant(
        "block reduction: the barrier after the partial writes removed",
        "cuda/row_blocks.cuh",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  if (warp == 0) {",
        "  if (lane == 0) partial[warp] = v;\n  if (warp == 0) {",
        race=True,
    ),
    Mutant(
        "block reduction: the barrier before the result is read removed",
        "cuda/row_blocks.cuh",
        "    if (lane == 0) *result = w;\n  }\n  __syncthreads();\n",
        "    if (lane == 0) *result = w;\n  }\n",
        race=True,
    ),
    Mutant(
        "shared row cache: index off by one",
        "cuda/block_shared_rows.cuh",
        "      if (cache != nullptr) cache[k * num_vecs + i] = h[k];",
        "      if (cache != nullptr) cache[k * num_vecs + i + 1] = h[k];",
    ),
    Mutant(
        "the max reduction's partial slots shared with the sum reduction's result slot",
        "cuda/block_shared_rows.cuh",
        "scratch.max_partial, &scratch.max_result",
        "reinterpret_cast<uint32_t*>(&scratch.sum_result), &scratch.max_result",
        race=True,
        count=2,  # the FP8 per-row scale's reduction and NVFP4's per-row global scale's
    ),
    Mutant(
        "warp sum: the shuffle offset loop stops one step early",
        "cuda/row_blocks.cuh",
        "  for (int offset = kWarp / 2; offset > 0; offset /= 2) {\n    const SumOfSquares",
        "  for (int offset = kWarp / 2; offset > 1; offset /= 2) {\n    const SumOfSquares",
    ),
    Mutant(
        "launch plan: the vectorised path chosen for a misaligned x",
        "cuda/cuda_launch_plan.h",
        "AlignedTo(a.x, kVectorBytes) &&",
        "",
    ),
    Mutant(
        "quantise sweep: a row's last vector skipped",
        "cuda/block_shared_rows.cuh",
        "i < num_vecs; i += blockDim.x) {\n    float normed[kVec];",
        "i < num_vecs - 1; i += blockDim.x) {\n    float normed[kVec];",
    ),
    Mutant(
        "grid-stride loop: rows strided by the block size instead of the grid size",
        "cuda/block_shared.cu",
        "row < a.rows; row += gridDim.x) {\n    float* const row_cache",
        "row < a.rows; row += blockDim.x) {\n    float* const row_cache",
    ),
    Mutant(
        "device setup: the dynamic shared memory attribute left at its default",
        "cuda/block_shared.cu",
        "static_cast<int>(most_dynamic)",
        "0",
    ),
    Mutant(
        "row reduction: the barrier after the partial writes removed",
        "cuda/register_row.cuh",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  const int first",
        "  if (lane == 0) partial[warp] = v;\n  const int first",
        race=True,
    ),
    Mutant(
        "row reduction: every row reads the first row's partials",
        "cuda/register_row.cuh",
        "const int first = warp - warp % warps_per_row;",
        "const int first = 0;",
    ),
    Mutant(
        "warp_rows: the threads of a row past the last one skip the reductions",
        "cuda/register_rows.cu",
        "    RegisterRow<TIn, kVecs>(a, first + block_row, a.rows, lane, threads_per_row, "
        "scratch);",
        "    if (first + block_row < a.rows)\n"
        "      RegisterRow<TIn, kVecs>(a, first + block_row, a.rows, lane, threads_per_row, "
        "scratch);",
    ),
    Mutant(
        "register row: one vector past the row held",
        "cuda/register_row.cuh",
        "lane + int64_t{k} * threads_per_row < num_vecs",
        "lane + int64_t{k} * threads_per_row <= num_vecs",
    ),
    Mutant(
        "register row: no barrier in place of the abs-max reduction a group scale skips",
        "cuda/register_row.cuh",
        "  } else if (warps_per_row > 1) {\n    __syncthreads();\n  }",
        "  }",
        race=True,
    ),
    Mutant(
        "register groups: the shuffle loop stops one step early",
        "cuda/register_row.cuh",
        "for (int offset = lanes / 2; offset > 0; offset /= 2)",
        "for (int offset = lanes / 2; offset > 1; offset /= 2)",
    ),
    Mutant(
        "shared groups: a group's last element left unquantised",
        "cuda/block_shared_rows.cuh",
        "j < (g + 1) * group; ++j) {\n      const float normed[1]",
        "j < (g + 1) * group - 1; ++j) {\n      const float normed[1]",
    ),
    Mutant(
        "all-reduce, two-shot: peers' results copied without waiting for their flags",
        "cuda/allreduce.cu",
        "    MeetPeers(a, 1, epoch);\n",
        "    __syncthreads();\n",
        race=True,
    ),
    Mutant(
        "all-reduce: a block's epoch never stored, so every call takes the first call's flags",
        "cuda/allreduce.cu",
        "  if (threadIdx.x == 0) StoreGlobal(epochs + blockIdx.x, epoch);\n",
        "",
    ),
    Mutant(
        "all-reduce: a peer's partial read before its flag (the wait takes the last call's)",
        "cuda/allreduce.cu",
        "while (!FlagReached(LoadAcquireSystem(flag), epoch)) FlagWaitPoint(flag, epoch);",
        "while (!FlagReached(LoadAcquireSystem(flag), epoch - 1)) FlagWaitPoint(flag, epoch - 1);",
    ),
    Mutant(
        "all-reduce: device 1 launched with one block more than its peers (a deadlock)",
        "cuda/allreduce.cu",
        "AllReduceBlocks(args.norm.rows, args.num_devices, args.method, max_blocks),",
        "AllReduceBlocks(args.norm.rows, args.num_devices, args.method, max_blocks) +\n"
        "                          (args.position == 1),",
    ),
    Mutant(
        "all-reduce, two-shot: the last row of each device's slice left out",
        "cuda/allreduce.cu",
        "? SliceBegin(rows, a.num_devices, a.position + 1)\n",
        "? SliceBegin(rows, a.num_devices, a.position + 1) - 1\n",
    ),
    Mutant(
        "all-reduce: the partials not double-buffered (parity fixed at 0)",
        "cuda/allreduce.cu",
        "a.layout.partials + parity * a.layout.partial_bytes",
        "a.layout.partials",
        count=2,
    ),
    Mutant(
        "all-reduce: the workspaces not zeroed by the set-up",
        "cuda/peer_workspaces.cc",
        "      err = cudaMemsetAsync(g->workspaces[p], 0, g->layout.total, stream);\n",
        "",
    ),
    Mutant(
        "all-reduce: the flags stored and loaded relaxed, not release and acquire",
        "cuda/allreduce.cu",
        "    StoreReleaseSystem(FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position),"
        " epoch);\n"
        "    const uint32_t* flag = FlagOf(a, a.workspaces[a.position], stage, blockIdx.x, p);\n"
        "    while (!FlagReached(LoadAcquireSystem(flag), epoch))",
        "    simt::StoreRelaxed(FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position), epoch,\n"
        "                       __LINE__);\n"
        "    const uint32_t* flag = FlagOf(a, a.workspaces[a.position], stage, blockIdx.x, p);\n"
        "    while (!FlagReached(simt::LoadRelaxed(flag, __LINE__), epoch))",
        race=True,
        tsan_only=True,
    ),
    Mutant(
        "all-reduce: a block flags its peers before all its threads have copied",
        "cuda/allreduce.cu",
        "uint32_t epoch) {\n  __syncthreads();\n  const int p",
        "uint32_t epoch) {\n  const int p",
        race=True,
        tsan_only=True,
    ),
    Mutant(
        "all-reduce: the flag stored in the peer's slot, not this device's",
        "cuda/allreduce.cu",
        "FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position), epoch);",
        "FlagOf(a, a.workspaces[p], stage, blockIdx.x, p), epoch);",
    ),
    Mutant(
        "all-reduce: the partials folded in reverse order",
        "cuda/allreduce.cu",
        "PartialOf(a, 0, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, q, parity)",
        "PartialOf(a, a.num_devices - 1, parity) + row * hidden * in_bytes, a.partial_type,"
        " i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, a.num_devices - 1 - q, parity)",
    ),
    Mutant(
        "all-reduce: the fold starts at the device's own partial",
        "cuda/allreduce.cu",
        "PartialOf(a, 0, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, q, parity)",
        "PartialOf(a, a.position, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, (a.position + q) % a.num_devices, parity)",
    ),
    Mutant(
        "all-reduce: the fold reads the next device's partial in place of each peer's",
        "cuda/allreduce.cu",
        "LoadAny<kVec>(PartialOf(a, q, parity)",
        "LoadAny<kVec>(PartialOf(a, (q + 1) % a.num_devices, parity)",
    ),
    Mutant(
        "all-reduce, two-shot: a slice's outputs copied from the next device's results",
        "cuda/allreduce.cu",
        "a.workspaces[q] + a.layout.results",
        "a.workspaces[(q + 1) % a.num_devices] + a.layout.results",
    ),
    Mutant(
        "all-reduce: the grid not capped at max_blocks",
        "cuda/peer_allreduce.h",
        "own < max_blocks ? (own > 0 ? own : 1) : max_blocks",
        "own > 0 ? own : 1",
    ),
    Mutant(
        "all-reduce: the group's block cap not lowered to its multiprocessors",
        "cuda/peer_workspaces.cc",
        "    g->max_blocks = std::min(g->max_blocks,"
        " static_cast<unsigned>(std::max(1, multiprocessors)));\n",
        "",
    ),
    Mutant(
        "CUDA row offset truncated to 32 bits",
        "cuda/row_blocks.cuh",
        "  const int64_t offset = row * a.hidden;",
        "  const int64_t offset = int32_t(row * a.hidden);",
    ),
    Mutant(
        "CPU row offset truncated to 32 bits",
        "cpu/cpu_rows.inc",
        "    const int64_t offset = row * n;",
        "    const int64_t offset = int32_t(row * n);",
    ),
    Mutant(
        "backward: a row's first term dropped from c",
        "cuda/backward.cu",
        "      Add(c, ProductTerm(ag, u));",
        "      if (j != 0) Add(c, ProductTerm(ag, u));",
    ),
    Mutant(
        "backward: dgamma sums the first row group twice",
        "cuda/backward.cu",
        "for (int g = 1; g < kDgammaRowGroups; ++g)",
        "for (int g = 0; g < kDgammaRowGroups; ++g)",
    ),
    Mutant(
        "backward: dgamma leaves the last row group out",
        "cuda/backward.cu",
        "for (int g = 1; g < kDgammaRowGroups; ++g)",
        "for (int g = 1; g < kDgammaRowGroups - 1; ++g)",
    ),
    Mutant(
        "backward: the rows' grid stops after its 65535 blocks instead of striding on",
        "cuda/backward.cu",
        "row < a.rows; row += gridDim.x) {",
        "row < a.rows; row += a.rows) {",
    ),
    Mutant(
        "backward: a row's parts merged without waiting for every thread's",
        "cuda/backward.cu",
        "    __syncthreads();  // every part written before any is merged",
        "",
        race=True,
    ),
    Mutant(
        "backward: the residual's gradient d_residual_out dropped from dh",
        "cuda/backward.cu",
        "        dx = PlusResidualGradient(dx, ",
        "        dx = PlusResidualGradient(dx, 0.0f * ",
    ),
    Mutant(
        "columnwise: a block's codes taken from the rows one below its own",
        "cuda/columnwise.cu",
        "row0 + i);\n    writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden",
        "row0 + i);\n    writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, "
        "((row0 + i + 1) % a.rows) * a.hidden",
    ),
    Mutant(
        "columnwise: a block's scale blind to a row that is not finite",
        "cuda/columnwise.cu",
        "    finite = finite && !IsNan(r);",
        "    finite = true;",
        count=2,  # the plain blocks' and the Hadamard-transformed blocks'
    ),
    Mutant(
        "both layouts: the columns read r before every row of the block has stored it",
        "cuda/columnwise.cu",
        "    __syncthreads();\n    for (int64_t column = threadIdx.x;",
        "    for (int64_t column = threadIdx.x;",
        race=True,
    ),
    Mutant(
        "both layouts: a block's last row left out of its rows' pass",
        "cuda/columnwise.cu",
        "RegisterRow<TIn, kVecs>(a, first + block_row, row_end, lane",
        "RegisterRow<TIn, kVecs>(a, first + block_row, row_end - 1, lane",
    ),
    Mutant(
        "columnwise Hadamard: the butterfly's last stage skipped (two transforms of half a block)",
        "cuda/columnwise.cu",
        "const uint32_t amax = HadamardColumnBlock<D>(a, t, 1);",
        "const uint32_t amax = max(HadamardColumnBlock<D / 2>(a, t, 1),\n"
        "                                HadamardColumnBlock<D / 2>(a, t + D / 2, 1));",
    ),
    Mutant(
        "columnwise Hadamard: the sign of a block's first row flipped",
        "cuda/columnwise.cu",
        "const uint32_t amax = HadamardColumnBlock<D>(a, t, 1);",
        "t[0] = -t[0];\n  const uint32_t amax = HadamardColumnBlock<D>(a, t, 1);",
    ),
    Mutant(
        "columnwise Hadamard: the block's scale from the abs-max of n, not of M n",
        "cuda/columnwise.cu",
        "const uint32_t amax = HadamardColumnBlock<D>(a, t, 1);",
        "uint32_t amax = 0;\n  for (int i = 0; i < D; ++i) amax = max(amax, AbsBits(t[i]));\n"
        "  HadamardColumnBlock<D>(a, t, 1);",
    ),
    Mutant(
        "static scale's amax: a row's amax stored at the next row's place",
        "cuda/row_blocks.cuh",
        "StoreGlobal(a.amax + row, SavedAmax(sum_sq, amax), site);",
        "StoreGlobal(a.amax + (row + 1) % a.rows, SavedAmax(sum_sq, amax), site);",
    ),
    Mutant(
        "register rows: a static scale's amax left unreduced across the row's threads",
        "cuda/register_row.cuh",
        "(PerRowScale(a) && (a.static_scale == nullptr || a.amax != nullptr)) ||",
        "(PerRowScale(a) && a.static_scale == nullptr) ||",
    ),
    Mutant(
        "weight tiles' codes: a tile's scale taken from the next tile along F",
        "cuda/quantize_weight.cu",
        "const int64_t tile = i / a.block * TileColumns(a) + j / a.block;",
        "const int64_t tile = i / a.block * TileColumns(a) + (j / a.block + 1) % TileColumns(a);",
    ),
    Mutant(
        "weight tiles' scales: a tile's scale stored at the tile below's place",
        "cuda/quantize_weight.cu",
        "StoreGlobal(a.scales + tile, WeightTileScaleCode(a.nvfp4, amax, gs));",
        "StoreGlobal(a.scales + (tile + tile_columns) % tiles,"
        " WeightTileScaleCode(a.nvfp4, amax, gs));",
    ),
    Mutant(
        "weight tiles' scales: a partial tile's abs-max read past F, from the next row",
        "cuda/quantize_weight.cu",
        "      if (j < a.cols) {\n",
        "      if (true) {\n",
    ),
    Mutant(
        "FP8 weight columns: a column's scale stored at the next column's place",
        "cuda/quantize_weight.cu",
        "StoreGlobal(reinterpret_cast<float*>(a.scales) + j, s.scale);",
        "StoreGlobal(reinterpret_cast<float*>(a.scales) + (j + 1) % a.cols, s.scale);",
    ),
    Mutant(
        "FP8 weight blocks: a block's abs-max over one row fewer",
        "cuda/quantize_weight.cu",
        "    for (int64_t i = 0; i < a.block; ++i) {\n      amax = max(",
        "    for (int64_t i = 0; i < a.block - 1; ++i) {\n      amax = max(",
    ),
    Mutant(
        "per-row global scales: a row's global scale stored at its neighbour's place",
        "cuda/row_blocks.cuh",
        "StoreGlobal(a.global_scales + row, gs, site);",
        "StoreGlobal(a.global_scales + (row + 1) % a.rows, gs, site);",
    ),
    Mutant(
        "register rows: a row's global scale from each warp's own part of the row",
        "cuda/register_row.cuh",
        "(a.static_scale == nullptr || a.amax != nullptr)) || PerRowGlobalScales(a);",
        "(a.static_scale == nullptr || a.amax != nullptr));",
    ),
    Mutant(
        "shared groups: a row's global scale from each thread's own elements",
        "cuda/block_shared_rows.cuh",
        "    amax = BlockReduce(\n        amax, 0u,",
        "    amax = amax + 0 * BlockReduce(\n        amax, 0u,",
    ),
    Mutant(
        "columnwise: a column's global scale taken from its neighbour",
        "cuda/columnwise.cu",
        "LoadGlobal(column_gs + column)",
        "LoadGlobal(column_gs + (column + 1) % a.hidden)",
    ),
    Mutant(
        "column global scales: the last row left out of a column's abs-max",
        "cuda/columnwise.cu",
        "for (int64_t row = 0; row < a.rows; ++row) {\n    const float r = "
        "LoadGlobal(a.inverse_rms",
        "for (int64_t row = 0; row < a.rows - 1; ++row) {\n    const float r = "
        "LoadGlobal(a.inverse_rms",
    ),
    Mutant(
        "launch plan: both layouts in one launch with per-column global scales",
        "cuda/cuda_launch_plan.h",
        "variant != KernelVariant::kWarpRows || a.columns.global_scales_t != nullptr) {",
        "variant != KernelVariant::kWarpRows) {",
    ),
    Mutant(
        "gradient quantiser: stochastic rounding that rounds to nearest",
        "cuda/quantize_gradient.cu",
        "scale, a.stochastic, BitsAt(",
        "scale, false, BitsAt(",
        count=3,
    ),
    Mutant(
        "gradient quantiser: the Hadamard butterfly's last stage skipped",
        "cuda/quantize_gradient.cu",
        "  if (a.hadamard) HadamardOfBlock(v, 1, a.block, a.hadamard_mask);",
        "  if (a.hadamard) {\n"
        "    for (int i = 0; i < a.block; ++i) v[i] *= HadamardSign(a.hadamard_mask, i);\n"
        "    for (int span = 1; span < a.block / 2; span *= 2) {\n"
        "      for (int i = 0; i < a.block; ++i) {\n"
        "        if (i & span) continue;\n"
        "        const float x = v[i], y = v[i + span];\n"
        "        v[i] = x + y;\n"
        "        v[i + span] = x - y;\n"
        "      }\n"
        "    }\n"
        "  }",
    ),
    Mutant(
        "gradient quantiser: a packed byte's odd code stored without waiting for its even one",
        "cuda/quantize_gradient.cu",
        "    if (!a.codes_packed) continue;\n    __syncthreads();",
        "    if (!a.codes_packed) continue;",
        race=True,
    ),
]
