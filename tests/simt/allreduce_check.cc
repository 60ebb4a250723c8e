// The one-kernel all-reduce (src/cuda/allreduce.cu) on emulated devices: one OS thread per
// device, with buffers of its own (exactly their size) and the group's workspaces, set up
// by the handlers' own code (peer_workspaces.cc). A case is a sequence of calls in which
// each call's residual_out is the next one's residual (a decoder's residual stream), then
// the whole recorded sequence launched again with the same arguments, as a CUDA graph
// replays it: the epochs live on the device, so the replay must give the same bits.
//
// Each device's thread runs its whole share of a case, every call and the replay, without
// waiting for its peers between calls, as a GPU's stream does not wait for its peers'
// streams: a device may be in call k + 1 while a peer is still in call k. And the group's
// turn goes to a device's next call before any peer resumes (simt::ScopedPeerRunAhead), so
// it is the kernel's double buffering and epochs alone that keep the calls apart, and
// ThreadSanitizer sees no ordering between calls that a join would have added. Once every
// thread has joined, every device's outputs of every call must equal, bit for bit, the CPU
// kernel's on the fixed-order sum ((x_0 + x_1) + ...) + residual, the spec's statement.
//
// The check proves it can see the order: in cases of float32 partials that cancel, the
// expected bits must differ from those of the reversed fold and of the fold that starts at
// each device's own partial, else it fails. Every launch must have the grid the set-up
// allows (a block per row a device normalises, at most one per multiprocessor and
// kMaxAllReduceBlocks), and cases whose rows exceed each cap must exist. A device launched
// with another grid than its peers must be reported as a deadlock.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check_options.h"
#include "cuda_kernels.h"
#include "peer_allreduce.h"
#include "peer_workspaces.h"
#include "rms_norm_fp8.h"
#include "simt.h"

namespace fp8norm {

namespace {

struct AllReduceCase {
  int devices;
  int64_t rows;
  int64_t hidden;
  FloatType input;
  AllReduceMethod method;
  int calls = 2;
  int64_t group_size = 0;  // 0: one scale per row
  FloatType scale = FloatType::kF32;
  OutFormat out = OutFormat::kE4M3FN;
  float static_scale = 0.0f;  // a calibrated scale when nonzero
  bool power_of_two = false;
  int different_grid_device = -1;  // a device launched with one row fewer: a deadlock
  bool cancel = false;             // partials that cancel (FillCancelling), on 3 or more devices
  int multiprocessors = 0;         // the devices' multiprocessors when nonzero: the grid's cap
};

struct Buffer {
  std::vector<unsigned char> bytes;
  explicit Buffer(size_t n = 0) : bytes(n, 0xa5) {}
  unsigned char* data() { return bytes.data(); }
  const unsigned char* data() const { return bytes.data(); }
  size_t size() const { return bytes.size(); }
};

uint64_t Mix(uint64_t s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

float Unit(uint64_t s) { return static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f; }

// Values spread over a few decades, so that the fixed order of the sum matters.
void FillRandom(Buffer& b, FloatType type, size_t count, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < count; ++i) {
    s = Mix(s);
    const float scale = (s & 7) == 0 ? 64.0f : ((s & 7) == 1 ? 1.0f / 64 : 1.0f);
    StoreAs(type, b.data(), static_cast<int64_t>(i), 4.0f * Unit(s) * scale);
  }
}

// Device 0's partial and device 1's nearly cancel; every other device's is small. Adding a
// small partial to a large one rounds most of it away, so the fixed order (the large ones
// first, then the small ones to their small sum) and any other order round differently.
// Spread magnitudes alone rarely show an order: bfloat16 or float16 partials of a few
// devices mostly add up exactly in float32.
void FillCancelling(Buffer& b, FloatType type, size_t count, int device, uint64_t seed) {
  uint64_t large = seed * 0x9e3779b97f4a7c15ull + 1;
  uint64_t small = (seed * 131 + static_cast<uint64_t>(device) + 1) * 0xbf58476d1ce4e5b9ull + 1;
  for (size_t i = 0; i < count; ++i) {
    large = Mix(large);
    small = Mix(small);
    const float l = 4096.0f * Unit(large), s = 4.0f * Unit(small);
    StoreAs(type, b.data(), static_cast<int64_t>(i), device == 0 ? l : (device == 1 ? s - l : s));
  }
}

float LoadValue(FloatType type, const unsigned char* p, size_t i) {
  if (type == FloatType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  if (type == FloatType::kF16) {
    F16 h;
    std::memcpy(&h, p + 2 * i, 2);
    return ToFloat(h);
  }
  BF16 b;
  std::memcpy(&b, p + 2 * i, 2);
  return ToFloat(b);
}

const char* MethodName(AllReduceMethod m) {
  return m == AllReduceMethod::kTwoShot ? "two_shot" : "one_shot";
}

struct Outputs {
  Buffer y, scales, residual_out;
};

struct DeviceCall {
  Buffer partial, y, scales, residual_out;
  AllReduceArgs args{};
};

// What one device's thread saw: the status and failure text of each launch, pass after
// pass, and its outputs as the first pass left them (the replay overwrites them).
struct DeviceRun {
  std::vector<cudaError_t> status;
  std::vector<std::string> failure;
  std::vector<Outputs> first_pass;
};

// Device d's whole share of a case: every call of every pass, one after another, never
// waiting for a peer between calls. A failed launch does not end the sequence: its peers'
// later launches then find this device's too, so a wait none can meet is reported as a
// deadlock at once instead of waiting for a device that never comes.
void RunDevice(int d, const std::vector<std::vector<std::unique_ptr<DeviceCall>>>& calls,
               int passes, const PeerGroup& group, size_t residual_bytes, const Buffer& gamma,
               const Buffer& static_scale, DeviceRun* run) {
  cudaSetDevice(d);
  simt::ScopedPeerRunAhead run_ahead(group.key, d);
  for (int pass = 0; pass < passes; ++pass) {
    for (const auto& call : calls) {
      DeviceCall& c = *call[d];
      simt::ScopedBuffers buffers;
      buffers.Add("x", c.partial.data(), c.partial.size());
      buffers.Add("residual", c.args.norm.residual, residual_bytes);
      buffers.Add("gamma", gamma.data(), gamma.size());
      if (static_scale.size() > 0) {
        buffers.Add("static_scale", static_scale.data(), static_scale.size());
      }
      buffers.Add("y", c.y.data(), c.y.size());
      buffers.Add("scales", c.scales.data(), c.scales.size());
      buffers.Add("residual_out", c.residual_out.data(), c.residual_out.size());
      const cudaError_t status = LaunchAllReduceNorm(nullptr, c.args, group.key, group.max_blocks);
      run->status.push_back(status);
      run->failure.push_back(status == cudaSuccess ? "" : cudaGetErrorString(cudaGetLastError()));
    }
    if (pass == 0 && passes > 1) {
      for (const auto& call : calls) {
        run->first_pass.push_back({call[d]->y, call[d]->scales, call[d]->residual_out});
      }
    }
  }
}

// What a case showed beyond its own verdict, for the checks over all cases.
struct CaseResult {
  bool ok = true;
  bool order_seen = false;            // another order of the fold changes its expected bits
  bool capped_by_processors = false;  // its rows per device exceed the multiprocessors
  bool capped_by_most = false;        // ... or kMaxAllReduceBlocks
};

int64_t next_call_site = 1;

CaseResult RunAllReduceCase(const AllReduceCase& c) {
  CaseResult result;
  const int n = c.devices;
  const size_t elements = static_cast<size_t>(c.rows * c.hidden);
  const size_t in_bytes = FloatTypeBytes(c.input);
  const int64_t groups = c.group_size > 0 ? c.hidden / c.group_size : 1;
  const bool fp4 = c.out == OutFormat::kE2M1;
  const bool two_shot = c.method == AllReduceMethod::kTwoShot;
  char name_text[240];
  std::snprintf(
      name_text, sizeof(name_text),
      "all-reduce %s n=%d %lldx%lld %s group=%lld scale=%d static=%g fp4=%d calls=%d%s%s",
      MethodName(c.method), n, static_cast<long long>(c.rows), static_cast<long long>(c.hidden),
      c.input == FloatType::kF32 ? "f32" : (c.input == FloatType::kF16 ? "f16" : "bf16"),
      static_cast<long long>(c.group_size), static_cast<int>(c.scale), c.static_scale, fp4, c.calls,
      c.cancel ? " cancelling" : "", c.different_grid_device >= 0 ? " different grid" : "");
  std::string name = name_text;
  if (c.multiprocessors > 0) name += " multiprocessors=" + std::to_string(c.multiprocessors);
  NameCase(name);
  // A case's first lines of failure are enough to tell what broke.
  int failures = 0;
  const auto fail = [&](const std::string& what) {
    result.ok = false;
    if (++failures <= 3) std::printf("FAIL %s: %s\n", name.c_str(), what.c_str());
  };

  simt::DeviceLimits limits;
  if (c.multiprocessors > 0) limits.multiprocessors = c.multiprocessors;
  simt::SetDeviceLimits(limits);
  const int64_t call_site = next_call_site++;
  std::vector<int64_t> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  std::string what;
  const PeerWorkspaceLayout layout = LayOutPeerWorkspace(c.rows, c.hidden, c.method);
  if (SetUpPeerGroups(call_site, devices, n, layout, &what) != cudaSuccess) {
    fail("set-up: " + what);
    return result;
  }
  int position = -1;
  const PeerGroup* group = FindPeerGroup(call_site, devices, layout, 0, &position);
  if (group == nullptr || position != 0) {
    fail("the set-up's group is not found");
    return result;
  }

  Buffer gamma(c.hidden * 4);
  FillRandom(gamma, FloatType::kF32, c.hidden, 7);
  Buffer static_scale(c.static_scale != 0.0f ? 4 : 0);
  if (c.static_scale != 0.0f) std::memcpy(static_scale.data(), &c.static_scale, 4);
  Buffer first_residual(elements * in_bytes);
  FillRandom(first_residual, c.input, elements, 11);
  const size_t y_bytes = fp4 ? elements / 2 : elements;
  const size_t scale_bytes = static_cast<size_t>(c.rows * groups) * FloatTypeBytes(c.scale);

  const auto norm_args = [&](const void* x, const void* residual, void* y, void* scales,
                             void* residual_out, FloatType x_type) {
    RmsNormFp8Args a{};
    a.x = x;
    a.residual = residual;
    a.gamma = gamma.data();
    a.y = y;
    a.scales = scales;
    a.residual_out = residual_out;
    a.static_scale =
        c.static_scale != 0.0f ? reinterpret_cast<const float*>(static_scale.data()) : nullptr;
    a.rows = c.rows;
    a.hidden = c.hidden;
    a.group_size = c.group_size > 0 ? c.group_size : c.hidden;
    a.input_type = x_type;
    a.residual_type = c.input;
    a.gamma_type = FloatType::kF32;
    a.scale_type = c.scale;
    a.out_format = c.out;
    a.y_packed = fp4;
    a.constants = RowConstants{1e-6f, 0.0f, INFINITY, c.power_of_two};
    return a;
  };
  // The CPU kernel on `sum`, plus `residual`.
  const auto cpu = [&](Buffer& sum, const Buffer& residual) {
    Outputs out{Buffer(y_bytes), Buffer(scale_bytes), Buffer(elements * in_bytes)};
    RmsNormFp8Cpu(norm_args(sum.data(), residual.data(), out.y.data(), out.scales.data(),
                            out.residual_out.data(), FloatType::kF32),
                  [](int64_t count, const std::function<void(int64_t)>& f) {
                    for (int64_t i = 0; i < count; ++i) f(i);
                  });
    return out;
  };
  // Whether two calls' outputs differ in rows [first, end).
  const auto rows_differ = [&](const Outputs& a, const Outputs& b, int64_t first, int64_t end) {
    const std::pair<const Buffer*, const Buffer*> pairs[] = {
        {&a.y, &b.y}, {&a.scales, &b.scales}, {&a.residual_out, &b.residual_out}};
    for (const auto& [x, z] : pairs) {
      const size_t row_bytes = x->size() / c.rows;
      if (std::memcmp(x->data() + first * row_bytes, z->data() + first * row_bytes,
                      (end - first) * row_bytes) != 0) {
        return true;
      }
    }
    return false;
  };

  // calls[k][d]: device d's buffers and arguments of call k; the residual of call k is
  // device d's residual_out of call k - 1.
  std::vector<std::vector<std::unique_ptr<DeviceCall>>> calls(c.calls);
  std::vector<Outputs> want(c.calls);
  // The orders the cases that cancel must tell from the fixed one: the reversed fold, and
  // for each position p > 0 the fold from p's own partial (p, p + 1, ..., wrapping), in
  // the rows device p sums.
  bool reversed_seen = false;
  std::vector<bool> rotated_seen(n, false);
  for (int k = 0; k < c.calls; ++k) {
    for (int d = 0; d < n; ++d) {
      auto call = std::make_unique<DeviceCall>();
      call->partial = Buffer(elements * in_bytes);
      const uint64_t seed = 1000 * k + d + 1;
      if (c.cancel) {
        FillCancelling(call->partial, c.input, elements, d, 1000 * k + 1);
      } else {
        FillRandom(call->partial, c.input, elements, seed);
      }
      call->y = Buffer(y_bytes);
      call->scales = Buffer(scale_bytes);
      call->residual_out = Buffer(elements * in_bytes);
      const void* device_residual =
          k == 0 ? first_residual.data() : calls[k - 1][d]->residual_out.data();
      AllReduceArgs& a = call->args;
      a.norm =
          norm_args(group->workspaces[d] + group->layout.reduced, device_residual, call->y.data(),
                    call->scales.data(), call->residual_out.data(), FloatType::kF32);
      a.partial = call->partial.data();
      a.partial_type = c.input;
      a.y = call->y.data();
      a.scales = call->scales.data();
      a.residual_out = call->residual_out.data();
      a.y_row_bytes = YByte(a.norm, c.hidden);
      a.scale_row_bytes = groups * static_cast<int64_t>(FloatTypeBytes(c.scale));
      a.residual_row_bytes = c.hidden * static_cast<int64_t>(in_bytes);
      for (int p = 0; p < n; ++p) a.workspaces[p] = group->workspaces[p];
      a.layout = group->layout;
      a.num_devices = n;
      a.position = d;
      a.method = c.method;
      if (d == c.different_grid_device) a.norm.rows -= 1;
      calls[k].push_back(std::move(call));
    }
    // The fold of the partials of the devices at positions `order`, in that order.
    const auto fold = [&](const std::vector<int>& order) {
      Buffer sum(elements * 4);
      for (size_t i = 0; i < elements; ++i) {
        float h = LoadValue(c.input, calls[k][order[0]]->partial.data(), i);
        for (size_t j = 1; j < order.size(); ++j) {
          h += LoadValue(c.input, calls[k][order[j]]->partial.data(), i);
        }
        StoreAs(FloatType::kF32, sum.data(), static_cast<int64_t>(i), h);
      }
      return sum;
    };
    const Buffer& residual = k == 0 ? first_residual : want[k - 1].residual_out;
    std::vector<int> order(n);
    for (int d = 0; d < n; ++d) order[d] = d;
    Buffer sum = fold(order);
    want[k] = cpu(sum, residual);
    if (c.cancel) {
      std::vector<int> reversed(order.rbegin(), order.rend());
      Buffer reversed_sum = fold(reversed);
      reversed_seen = reversed_seen || rows_differ(cpu(reversed_sum, residual), want[k], 0, c.rows);
      for (int p = 1; p < n; ++p) {
        std::vector<int> rotated(n);
        for (int j = 0; j < n; ++j) rotated[j] = (p + j) % n;
        Buffer rotated_sum = fold(rotated);
        const int64_t first = two_shot ? SliceBegin(c.rows, n, p) : 0;
        const int64_t end = two_shot ? SliceBegin(c.rows, n, p + 1) : c.rows;
        rotated_seen[p] =
            rotated_seen[p] || rows_differ(cpu(rotated_sum, residual), want[k], first, end);
      }
    }
  }
  if (c.cancel) {
    result.order_seen = n >= 3 && reversed_seen;
    for (int p = 1; p < n; ++p) result.order_seen = result.order_seen && rotated_seen[p];
    if (!result.order_seen) {
      fail(
          "the reversed fold or a fold from a device's own partial gives the fixed order's "
          "bits: the case cannot see the order");
    }
  }

  // The sequence, then its replay; a case of one call (the largest payloads) runs once.
  const int passes = c.calls > 1 ? 2 : 1;
  simt::TakeLaunches();
  std::vector<DeviceRun> runs(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    threads.emplace_back(RunDevice, d, std::cref(calls), passes, std::cref(*group),
                         first_residual.size(), std::cref(gamma), std::cref(static_scale),
                         &runs[d]);
  }
  for (std::thread& thread : threads) thread.join();
  const std::vector<simt::LaunchRecord> launches = simt::TakeLaunches();
  ReleasePeerGroups(call_site);

  if (c.different_grid_device >= 0) {
    // Every device that waited fails with the report, none hangs.
    for (const DeviceRun& run : runs) {
      for (const std::string& f : run.failure) {
        if (f.find("deadlock between the devices") != std::string::npos) return result;
      }
    }
    fail("no deadlock reported (device 0: " + runs[0].failure[0] + ")");
    return result;
  }

  for (int pass = 0; pass < passes; ++pass) {
    for (int d = 0; d < n; ++d) {
      for (int k = 0; k < c.calls; ++k) {
        const DeviceRun& run = runs[d];
        const char* replayed = pass ? "replayed " : "";
        if (run.status[pass * c.calls + k] != cudaSuccess) {
          fail(std::string(replayed) + "call " + std::to_string(k) + " of device " +
               std::to_string(d) + ": " + run.failure[pass * c.calls + k]);
          continue;
        }
        const Outputs& got = pass == 0 && passes > 1 ? run.first_pass[k]
                                                     : Outputs{calls[k][d]->y, calls[k][d]->scales,
                                                               calls[k][d]->residual_out};
        const struct {
          const char* what;
          const Buffer& got;
          const Buffer& want;
        } outputs[] = {{"y", got.y, want[k].y},
                       {"scales", got.scales, want[k].scales},
                       {"residual_out", got.residual_out, want[k].residual_out}};
        for (const auto& o : outputs) {
          if (o.got.bytes == o.want.bytes) continue;
          size_t i = 0;
          while (o.got.bytes[i] == o.want.bytes[i]) ++i;
          fail(std::string(replayed) + o.what + " of device " + std::to_string(d) + ", call " +
               std::to_string(k) + ", differs first at byte " + std::to_string(i));
        }
      }
    }
  }
  // The grid: a block per row the device normalises, at most one per multiprocessor and
  // kMaxAllReduceBlocks, on every device alike. Checked after the launches' statuses, so
  // that a grid that deadlocks is reported as the deadlock first.
  const int64_t own_rows = two_shot ? (c.rows + n - 1) / n : c.rows;
  const int64_t cap = std::min<int64_t>(kMaxAllReduceBlocks, limits.multiprocessors);
  const unsigned want_blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(own_rows, cap)));
  result.capped_by_processors =
      limits.multiprocessors < kMaxAllReduceBlocks && own_rows > limits.multiprocessors;
  result.capped_by_most = own_rows > kMaxAllReduceBlocks;
  size_t recorded = 0;
  for (const simt::LaunchRecord& r : launches) {
    if (r.kernel != "allreduce_norm") continue;
    ++recorded;
    if (r.blocks != want_blocks) {
      fail("a launch of " + std::to_string(r.blocks) + " blocks, where " +
           std::to_string(own_rows) + " rows per device and a cap of " + std::to_string(cap) +
           " (the multiprocessors, kMaxAllReduceBlocks) make " + std::to_string(want_blocks));
      break;
    }
  }
  if (recorded != static_cast<size_t>(n * c.calls * passes)) {
    fail(std::to_string(recorded) + " launches recorded, " + std::to_string(n * c.calls * passes) +
         " made");
  }

  if (failures > 3) std::printf("  ... and %d more failures of %s\n", failures - 3, name.c_str());
  return result;
}

// For both methods, float32 partials that cancel on 3 devices (slices of several rows
// under two-shot), of `hidden` elements; and rows beyond a cap of multiprocessors: one
// block striding over every row, and two-shot slices wider than two.
void AddOrderAndCapCases(std::vector<AllReduceCase>* cases, int64_t hidden, int64_t rows) {
  for (const AllReduceMethod m : {AllReduceMethod::kOneShot, AllReduceMethod::kTwoShot}) {
    AllReduceCase order{3, rows, hidden, FloatType::kF32, m, 2};
    order.cancel = true;
    cases->push_back(order);
  }
  AllReduceCase one_block{2, rows, hidden, FloatType::kBF16, AllReduceMethod::kOneShot, 3};
  one_block.multiprocessors = 1;
  cases->push_back(one_block);
  AllReduceCase capped{3, rows + 4, hidden, FloatType::kF32, AllReduceMethod::kTwoShot, 2};
  capped.cancel = true;
  capped.multiprocessors = 2;
  cases->push_back(capped);
}

}  // namespace

int CheckAllReduce(bool quick) {
  simt::SetDeviceLimits(simt::DeviceLimits{});  // an H100's, whatever the cases before set
  std::vector<AllReduceCase> cases;
  // First, as what most mutants of the fold and the grid fail first.
  AddOrderAndCapCases(&cases, quick ? 64 : 1024, quick ? 5 : 9);
  const AllReduceMethod methods[] = {AllReduceMethod::kOneShot, AllReduceMethod::kTwoShot};
  const FloatType inputs[] = {FloatType::kBF16, FloatType::kF16, FloatType::kF32};
  if (quick) {
    // For ThreadSanitizer: the protocol at each group size, both methods, a grid that
    // strides, and a slice of one row.
    for (const int n : {2, 4, 8}) {
      for (const AllReduceMethod m : methods) {
        cases.push_back({n, n == 2 ? 67 : 9, 64, FloatType::kBF16, m, 3});
      }
    }
  } else {
    // Each shape with one method, alternating, so that every group size, row count and
    // hidden size meets both.
    int k = 0;
    for (const int n : {2, 4, 8}) {
      for (const int64_t rows : {1, 5, 37, 130}) {
        for (const int64_t hidden : {1024, 2048, 4096, 8192}) {
          if (rows * hidden * n > 8 * 130 * 2048) continue;  // the emulation's time
          AllReduceCase c{n, rows, hidden, inputs[k % 3], methods[(k + rows) % 2]};
          c.calls = k % 4 == 0 ? 3 : 2;
          if (k % 5 == 1) c.group_size = 128;
          if (k % 7 == 2 && c.group_size == 0) c.static_scale = 0.05f;
          if (k % 9 == 4 && c.static_scale == 0.0f) {
            c.group_size = 32;
            c.scale = FloatType::kE8M0;
            c.power_of_two = true;
          }
          cases.push_back(c);
          ++k;
        }
      }
    }
    // The largest payloads the tests take (512 rows of 8192 on two devices, 512 of 1024
    // on eight), a row that does not divide in vectors, FP4 rows, and 25 consecutive calls.
    cases.push_back({2, 512, 8192, FloatType::kBF16, AllReduceMethod::kOneShot, 1});
    cases.push_back({2, 512, 8192, FloatType::kBF16, AllReduceMethod::kTwoShot, 1});
    cases.push_back({8, 512, 1024, FloatType::kF16, AllReduceMethod::kTwoShot, 1});
    cases.push_back({4, 7, 1030, FloatType::kBF16, AllReduceMethod::kTwoShot, 2});
    AllReduceCase nvfp4{4,
                        9,
                        1024,
                        FloatType::kBF16,
                        AllReduceMethod::kTwoShot,
                        2,
                        16,
                        FloatType::kE4M3,
                        OutFormat::kE2M1};
    cases.push_back(nvfp4);
    AllReduceCase mxfp4{2,
                        9,
                        1024,
                        FloatType::kF32,
                        AllReduceMethod::kOneShot,
                        2,
                        32,
                        FloatType::kE8M0,
                        OutFormat::kE2M1};
    mxfp4.power_of_two = true;
    cases.push_back(mxfp4);
    cases.push_back({8, 3, 1024, FloatType::kBF16, AllReduceMethod::kOneShot, 25});
    cases.push_back({8, 9, 1024, FloatType::kBF16, AllReduceMethod::kTwoShot, 25});
    AllReduceCase wide{8, 16, 1024, FloatType::kF32, AllReduceMethod::kTwoShot, 2};
    wide.cancel = true;
    cases.push_back(wide);
  }
  // One device launched with a grid of one block fewer than its peers'.
  AllReduceCase different{2, 5, 64, FloatType::kBF16, AllReduceMethod::kOneShot, 1};
  different.different_grid_device = 1;
  cases.push_back(different);
  different.devices = 4;
  different.method = AllReduceMethod::kTwoShot;
  different.rows = 13;
  different.different_grid_device = 2;
  cases.push_back(different);

  int failures = 0;
  bool order_seen[2] = {false, false};
  bool capped_by_processors = false, capped_by_most = false;
  int run = 0;
  for (const AllReduceCase& c : cases) {
    if (stop_at_failure && failures > 0) return failures;
    if (!shard.Takes()) continue;
    ++run;
    const CaseResult r = RunAllReduceCase(c);
    failures += r.ok ? 0 : 1;
    order_seen[c.method == AllReduceMethod::kTwoShot] |= r.order_seen;
    capped_by_processors |= r.capped_by_processors;
    capped_by_most |= r.capped_by_most;
  }
  simt::SetDeviceLimits(simt::DeviceLimits{});
  // Checks of the order and of the grid prove something only where a case can fail them. A
  // shard names what its cases did not show (kernel_check.cc's --shard).
  const bool sharded = shard.count > 1;
  const char* verdict = sharded ? "UNSEEN" : "FAIL";
  for (const AllReduceMethod m : methods) {
    if (!order_seen[m == AllReduceMethod::kTwoShot]) {
      std::printf("%s all-reduce %s: no case can tell the fixed order from another\n", verdict,
                  MethodName(m));
      failures += sharded ? 0 : 1;
    }
  }
  if (!capped_by_processors || !capped_by_most) {
    std::printf("%s all-reduce: no case has more rows per device than %s\n", verdict,
                capped_by_processors ? "kMaxAllReduceBlocks" : "the multiprocessors");
    failures += sharded ? 0 : 1;
  }
  if (sharded) {
    std::printf("%d of %zu all-reduce cases (shard %d/%d), %d failed\n", run, cases.size(),
                shard.index, shard.count, failures);
  } else {
    std::printf("%zu all-reduce cases, %d failed\n", cases.size(), failures);
  }
  return failures;
}

}  // namespace fp8norm
