// kernel_check's options that its parts read (kernel_check.cc sets them from the command line).
#pragma once

#include <string>

namespace fp8norm {

// --name-cases: NameCase prints each case's name on stderr before the case runs.
void NameCase(const std::string& name);
extern bool name_cases;
// --stop-at-failure: no case after the first that fails.
extern bool stop_at_failure;

// --shard K/N: the run takes every N-th unit of work (a case, or a check of its own),
// starting at the K-th, counting across all the checks in the order they run.
struct Shard {
  int index = 0;
  int count = 1;
  int next = 0;
  bool Takes();  // whether the next unit is this shard's
};
extern Shard shard;

// The checks kernel_check.cc runs beside its own cases, each from its own file.
int CheckEmulator();                      // emulator_check.cc
int CheckIndexing();                      // index_check.cc
int CheckAllReduce(bool quick);           // allreduce_check.cc
int CheckBackward(bool quick);            // training_check.cc
int CheckColumnwise(bool quick);          // training_check.cc
int CheckQuantizeWeight(bool quick);      // quantize_weight_check.cc
int CheckQuantizeGradient(bool quick);    // quantize_gradient_check.cc
int CheckPerRowGlobalScales(bool quick);  // per_row_check.cc

}  // namespace fp8norm
