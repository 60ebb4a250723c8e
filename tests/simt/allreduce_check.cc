// The one-kernel all-reduce (src/cuda/allreduce.cu) on emulated devices: one OS thread per
// device, each launching its share of every call with buffers of its own (exactly their
// size) and the group's workspaces, set up by the handlers' own code (peer_workspaces.cc).
// Every device's outputs must equal, bit for bit, the CPU kernel's on the fixed-order sum
// ((x_0 + x_1) + ...) + residual, the spec's statement. A case is a sequence of calls in
// which each call's residual_out is the next one's residual (a decoder's residual stream),
// then the whole recorded sequence launched again with the same arguments, as a CUDA
// graph replays it: the epochs live on the device, so the replay must give the same bits.
// A device launched with another grid than its peers must be reported as a deadlock.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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
};

struct Buffer {
  std::vector<unsigned char> bytes;
  explicit Buffer(size_t n = 0) : bytes(n, 0xa5) {}
  unsigned char* data() { return bytes.data(); }
  size_t size() const { return bytes.size(); }
};

uint64_t Mix(uint64_t s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

// Values spread over a few decades, so that the fixed order of the sum matters.
void FillRandom(Buffer& b, FloatType type, size_t count, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < count; ++i) {
    s = Mix(s);
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
    const float scale = (s & 7) == 0 ? 64.0f : ((s & 7) == 1 ? 1.0f / 64 : 1.0f);
    StoreAs(type, b.data(), static_cast<int64_t>(i), 4.0f * u * scale);
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

struct DeviceCall {
  Buffer partial, y, scales, residual_out;
  AllReduceArgs args{};
};

// One call on every device at once; the statuses and failure texts, per device.
void LaunchOnAll(std::vector<DeviceCall*>& calls, const PeerGroup& group,
                 std::vector<cudaError_t>* status, std::vector<std::string>* failure,
                 const Buffer& residual, const Buffer& gamma, const Buffer& static_scale) {
  const int n = static_cast<int>(calls.size());
  status->assign(n, cudaSuccess);
  failure->assign(n, "");
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    threads.emplace_back([&, d] {
      cudaSetDevice(d);
      DeviceCall& c = *calls[d];
      simt::ScopedBuffers buffers;
      buffers.Add("x", c.partial.data(), c.partial.size());
      buffers.Add("residual", c.args.norm.residual, residual.size());
      buffers.Add("gamma", gamma.bytes.data(), gamma.size());
      if (static_scale.size() > 0) {
        buffers.Add("static_scale", static_scale.bytes.data(), static_scale.size());
      }
      buffers.Add("y", c.y.data(), c.y.size());
      buffers.Add("scales", c.scales.data(), c.scales.size());
      buffers.Add("residual_out", c.residual_out.data(), c.residual_out.size());
      (*status)[d] = LaunchAllReduceNorm(nullptr, c.args, group.key, group.max_blocks);
      if ((*status)[d] != cudaSuccess) (*failure)[d] = cudaGetErrorString(cudaGetLastError());
    });
  }
  for (std::thread& t : threads) t.join();
}

int64_t next_call_site = 1;

// False when the case failed.
bool RunAllReduceCase(const AllReduceCase& c) {
  const int n = c.devices;
  const size_t elements = static_cast<size_t>(c.rows * c.hidden);
  const size_t in_bytes = FloatTypeBytes(c.input);
  const int64_t groups = c.group_size > 0 ? c.hidden / c.group_size : 1;
  const bool fp4 = c.out == OutFormat::kE2M1;
  char name_text[200];
  std::snprintf(name_text, sizeof(name_text),
                "all-reduce %s n=%d %lldx%lld %s group=%lld scale=%d static=%g fp4=%d calls=%d%s",
                MethodName(c.method), n, static_cast<long long>(c.rows),
                static_cast<long long>(c.hidden),
                c.input == FloatType::kF32 ? "f32" : (c.input == FloatType::kF16 ? "f16" : "bf16"),
                static_cast<long long>(c.group_size), static_cast<int>(c.scale), c.static_scale,
                fp4, c.calls, c.different_grid_device >= 0 ? " different grid" : "");
  const std::string name = name_text;

  const int64_t call_site = next_call_site++;
  std::vector<int64_t> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  std::string what;
  if (SetUpPeerGroups(call_site, devices, n, LayOutPeerWorkspace(c.rows, c.hidden, c.method),
                      &what) != cudaSuccess) {
    std::printf("FAIL %s: set-up: %s\n", name.c_str(), what.c_str());
    return false;
  }
  int position = -1;
  const PeerWorkspaceLayout layout = LayOutPeerWorkspace(c.rows, c.hidden, c.method);
  const PeerGroup* group = FindPeerGroup(call_site, devices, layout, 0, &position);
  if (group == nullptr || position != 0) {
    std::printf("FAIL %s: the set-up's group is not found\n", name.c_str());
    return false;
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

  // calls[k][d]: device d's buffers and arguments of call k; the residual of call k is
  // device d's residual_out of call k - 1.
  std::vector<std::vector<std::unique_ptr<DeviceCall>>> calls(c.calls);
  std::vector<Buffer> want_y, want_scales, want_residual;
  want_y.reserve(c.calls);
  want_scales.reserve(c.calls);
  want_residual.reserve(c.calls);  // `residual` points into it
  const Buffer* residual = &first_residual;
  for (int k = 0; k < c.calls; ++k) {
    Buffer sum(elements * 4);
    for (int d = 0; d < n; ++d) {
      auto call = std::make_unique<DeviceCall>();
      call->partial = Buffer(elements * in_bytes);
      FillRandom(call->partial, c.input, elements, 1000 * k + d + 1);
      call->y = Buffer(y_bytes);
      call->scales = Buffer(scale_bytes);
      call->residual_out = Buffer(elements * in_bytes);
      for (size_t i = 0; i < elements; ++i) {
        const float x = LoadValue(c.input, call->partial.data(), i);
        const float h = d == 0 ? x : LoadValue(FloatType::kF32, sum.data(), i) + x;
        StoreAs(FloatType::kF32, sum.data(), static_cast<int64_t>(i), h);
      }
      const void* device_residual =
          k == 0 ? first_residual.bytes.data() : calls[k - 1][d]->residual_out.data();
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
    // The CPU kernel on the fixed-order sum, plus the residual.
    want_y.emplace_back(y_bytes);
    want_scales.emplace_back(scale_bytes);
    want_residual.emplace_back(elements * in_bytes);
    const RmsNormFp8Args cpu =
        norm_args(sum.data(), residual->bytes.data(), want_y.back().data(),
                  want_scales.back().data(), want_residual.back().data(), FloatType::kF32);
    RmsNormFp8Cpu(cpu, [](int64_t count, const std::function<void(int64_t)>& f) {
      for (int64_t i = 0; i < count; ++i) f(i);
    });
    residual = &want_residual.back();
  }

  bool ok = true;
  // The sequence, then its replay; a case of one call (the largest payloads) runs once.
  const int passes = c.calls > 1 ? 2 : 1;
  for (int pass = 0; pass < passes && ok; ++pass) {
    for (int k = 0; k < c.calls && ok; ++k) {
      std::vector<DeviceCall*> devices_calls;
      for (auto& call : calls[k]) devices_calls.push_back(call.get());
      std::vector<cudaError_t> status;
      std::vector<std::string> failure;
      LaunchOnAll(devices_calls, *group, &status, &failure, first_residual, gamma, static_scale);
      if (c.different_grid_device >= 0) {
        // Every device that waited fails with the report, none hangs.
        bool reported = false;
        for (int d = 0; d < n; ++d) {
          reported =
              reported || failure[d].find("deadlock between the devices") != std::string::npos;
        }
        if (!reported) {
          std::printf("FAIL %s: no deadlock reported (device 0: %s)\n", name.c_str(),
                      failure[0].c_str());
          ok = false;
        }
        ReleasePeerGroups(call_site);
        return ok;
      }
      for (int d = 0; d < n && ok; ++d) {
        if (status[d] != cudaSuccess) {
          std::printf("FAIL %s: device %d, call %d: %s\n", name.c_str(), d, k, failure[d].c_str());
          ok = false;
          break;
        }
        const struct {
          const char* what;
          const Buffer& got;
          const Buffer& want;
        } outputs[] = {{"y", calls[k][d]->y, want_y[k]},
                       {"scales", calls[k][d]->scales, want_scales[k]},
                       {"residual_out", calls[k][d]->residual_out, want_residual[k]}};
        for (const auto& o : outputs) {
          if (o.got.bytes == o.want.bytes) continue;
          size_t i = 0;
          while (o.got.bytes[i] == o.want.bytes[i]) ++i;
          std::printf("FAIL %s: %s%s of device %d, call %d, differs first at byte %zu\n",
                      name.c_str(), pass ? "replayed " : "", o.what, d, k, i);
          ok = false;
        }
      }
    }
  }
  ReleasePeerGroups(call_site);
  return ok;
}

}  // namespace

int CheckAllReduce(bool quick) {
  simt::SetDeviceLimits(simt::DeviceLimits{});  // an H100's, whatever the cases before set
  std::vector<AllReduceCase> cases;
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
  for (const AllReduceCase& c : cases) failures += RunAllReduceCase(c) ? 0 : 1;
  std::printf("%zu all-reduce cases, %d failed\n", cases.size(), failures);
  return failures;
}

}  // namespace fp8norm
