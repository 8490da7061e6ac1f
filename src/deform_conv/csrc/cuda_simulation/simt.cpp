// The simulation's scheduler (see simt.h): blocks one after another, each thread of a block a fiber
// (ucontext), switched only where a warp shuffle makes lanes wait for each other. And cuda/host.h's functions as the
// simulation defines them (cuda/host.cpp defines them on a GPU).
#include "simt.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "../cuda/host.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define DC_SIM_ASAN 1
#endif

namespace deform_conv {
namespace sim {

thread_local const ThreadState* current_thread = nullptr;

Options& options() {
  static Options value;
  return value;
}

namespace {

// CUDA's limits for a launch (compute capability 5.0 and later; one-dimensional grids and blocks).
constexpr int64_t kMaxThreadsPerBlock = 1024;
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;
constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;  // room for sanitizer-instrumented frames

struct Statistics {
  int64_t launches = 0, blocks = 0, threads = 0, shuffles = 0, int32_launches = 0, int64_launches = 0;
};
Statistics statistics;
// Launches since the last configure: with the seed, what orders a launch's blocks (so that a shuffled run repeats
// whatever ran before it in the process).
uint64_t launches_since_configure = 0;

enum class Wait { running, shuffle, done };

struct Fiber {
  ucontext_t context{};
  ThreadState state;
  Wait wait = Wait::running;
  std::array<unsigned char, 8> value{};  // a shuffle's operand, then its result
  int bytes = 0, delta = 0;
};

// A fiber's stack, with a guard page below it: an overflow faults instead of corrupting a neighbour.
class Stack {
 public:
  Stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_ = kStackBytes + page;
    void* memory = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(memory != MAP_FAILED, "CUDA simulation: cannot map a fiber stack");
    TORCH_CHECK(mprotect(memory, page, PROT_NONE) == 0, "CUDA simulation: cannot protect a fiber stack's guard page");
    base_ = static_cast<char*>(memory);
    page_ = page;
  }
  ~Stack() { munmap(base_, size_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  char* bottom() const { return base_ + page_; }
  size_t size() const { return kStackBytes; }

 private:
  char* base_ = nullptr;
  size_t size_ = 0, page_ = 0;
};

// The block being run on this host thread.
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler{};
  const std::function<void()>* body = nullptr;
  int running = -1;
#ifdef DC_SIM_ASAN
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

thread_local Block* current_block = nullptr;
thread_local std::vector<std::unique_ptr<Stack>> stacks;

// Switches from the running fiber to the scheduler; `finished`: the fiber will never be resumed.
void switch_to_scheduler(Fiber& fiber, bool finished) {
  Block& block = *current_block;
#ifdef DC_SIM_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake_stack, block.scheduler_stack_bottom,
                                 block.scheduler_stack_size);
#endif
  swapcontext(&fiber.context, &block.scheduler);
#ifdef DC_SIM_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
  (void)finished;
}

void fiber_main() {
#ifdef DC_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &current_block->scheduler_stack_bottom,
                                  &current_block->scheduler_stack_size);
#endif
  Block& block = *current_block;
  (*block.body)();
  Fiber& fiber = block.fibers[block.running];
  fiber.wait = Wait::done;
  switch_to_scheduler(fiber, /*finished=*/true);
}

void resume(Block& block, int index) {
  Fiber& fiber = block.fibers[index];
  block.running = index;
  current_thread = &fiber.state;
#ifdef DC_SIM_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, stacks[index]->bottom(), stacks[index]->size());
#endif
  swapcontext(&block.scheduler, &fiber.context);
#ifdef DC_SIM_ASAN
  // (The stack we come back from is the fiber's: the scheduler's own bounds were recorded when a fiber started.)
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
  current_thread = nullptr;
  block.running = -1;
}

// Completes the shuffles every lane of a warp waits at; false if no warp could proceed.
bool complete_shuffles(Block& block, int64_t block_index) {
  bool progressed = false;
  const int threads = static_cast<int>(block.fibers.size());
  for (int first = 0; first < threads; first += kWarpSize) {
    const int lanes = std::min(kWarpSize, threads - first);
    int waiting = 0;
    for (int l = 0; l < lanes; ++l) waiting += block.fibers[first + l].wait == Wait::shuffle;
    if (waiting == 0) continue;
    const Fiber& lead = block.fibers[first];
    const int warp = first / kWarpSize;
    TORCH_CHECK(lanes == kWarpSize, "CUDA simulation: block ", block_index, " warp ", warp, ": a shuffle in a partial warp of ",
                lanes, " threads (the block size is not a multiple of 32)");
    TORCH_CHECK(waiting == kWarpSize, "CUDA simulation: block ", block_index, " warp ", warp, ": ", waiting,
                " of 32 lanes reached a full-warp shuffle, the others exited (undefined on a GPU)");
    for (int l = 0; l < lanes; ++l) {
      const Fiber& f = block.fibers[first + l];
      TORCH_CHECK(f.bytes == lead.bytes && f.delta == lead.delta, "CUDA simulation: block ", block_index, " warp ", warp,
                  ": lanes at different shuffles (lane 0: xor ", lead.delta, " of ", lead.bytes, " bytes; lane ", l,
                  ": xor ", f.delta, " of ", f.bytes, " bytes)");
    }
    TORCH_CHECK(lead.delta > 0 && lead.delta < kWarpSize, "CUDA simulation: shuffle lane mask ", lead.delta,
                " outside 1..31");
    std::array<std::array<unsigned char, 8>, kWarpSize> values;
    for (int l = 0; l < lanes; ++l) values[l] = block.fibers[first + l].value;
    for (int l = 0; l < lanes; ++l) {
      Fiber& f = block.fibers[first + l];
      f.value = values[l ^ lead.delta];
      f.wait = Wait::running;
    }
    ++statistics.shuffles;
    progressed = true;
  }
  return progressed;
}

}  // namespace

// Runs on a fiber's stack, where nothing may throw (an exception cannot unwind past the fiber's entry): the
// value size is checked at compile time (simt.h), and a shuffle outside a kernel cannot happen on a fiber.
void exchange_xor(void* value, int bytes, int delta) {
  // Outside a kernel there is no fiber: this throws on the host stack.
  TORCH_CHECK(current_block != nullptr && current_block->running >= 0, "CUDA simulation: a shuffle outside a kernel");
  Fiber& fiber = current_block->fibers[current_block->running];
  std::memcpy(fiber.value.data(), value, bytes);
  fiber.bytes = bytes;
  fiber.delta = delta;
  fiber.wait = Wait::shuffle;
  switch_to_scheduler(fiber, /*finished=*/false);
  std::memcpy(value, fiber.value.data(), bytes);
}

void restart_block_orders() { launches_since_configure = 0; }

std::vector<int64_t> counts() {
  const Statistics& s = statistics;
  return {s.launches, s.blocks, s.threads, s.shuffles, s.int32_launches, s.int64_launches};
}

void run_grid(int64_t blocks, int64_t threads, const std::function<void()>& body) {
  TORCH_CHECK(threads >= 1 && threads <= kMaxThreadsPerBlock, "CUDA simulation: ", threads,
              " threads per block; CUDA allows 1 to ", kMaxThreadsPerBlock);
  TORCH_CHECK(blocks >= 1 && blocks <= kMaxGridX, "CUDA simulation: a grid of ", blocks, " blocks; CUDA allows 1 to ",
              kMaxGridX);
  TORCH_CHECK(current_block == nullptr, "CUDA simulation: a launch from inside a kernel");
  ++statistics.launches;
  statistics.blocks += blocks;
  statistics.threads += blocks * threads;
  while (static_cast<int64_t>(stacks.size()) < threads) stacks.push_back(std::make_unique<Stack>());

  std::vector<int64_t> block_order(blocks);
  std::iota(block_order.begin(), block_order.end(), 0);
  const int warps = static_cast<int>((threads + kWarpSize - 1) / kWarpSize);
  std::vector<int> warp_order(warps);
  std::iota(warp_order.begin(), warp_order.end(), 0);
  std::seed_seq seeds{options().seed, ++launches_since_configure};
  std::mt19937_64 random(seeds);
  if (options().shuffle_blocks) std::shuffle(block_order.begin(), block_order.end(), random);

  Block block;
  block.body = &body;
  block.fibers.resize(threads);
  current_block = &block;
  struct Reset {
    ~Reset() { current_block = nullptr; current_thread = nullptr; }
  } reset;
  for (const int64_t b : block_order) {
    for (int t = 0; t < threads; ++t) {
      Fiber& f = block.fibers[t];
      f.state.thread = dim3{static_cast<unsigned>(t), 1, 1};
      f.state.block = dim3{static_cast<unsigned>(b), 1, 1};
      f.state.block_dim = dim3{static_cast<unsigned>(threads), 1, 1};
      f.state.grid_dim = dim3{static_cast<unsigned>(blocks), 1, 1};
      f.wait = Wait::running;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stacks[t]->bottom();
      f.context.uc_stack.ss_size = stacks[t]->size();
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_main, 0);
    }
    if (options().shuffle_blocks) std::shuffle(warp_order.begin(), warp_order.end(), random);
    while (true) {
      bool live = false;
      for (const int w : warp_order) {
        for (int t = w * kWarpSize; t < std::min<int64_t>(threads, (w + 1) * kWarpSize); ++t) {
          if (block.fibers[t].wait == Wait::running) resume(block, t);
          live = live || block.fibers[t].wait != Wait::done;
        }
      }
      if (!live) break;
      TORCH_CHECK(complete_shuffles(block, b), "CUDA simulation: block ", b, " cannot proceed");
    }
  }
}

}  // namespace sim

namespace cuda {

Stream current_stream() { return nullptr; }  // the simulation runs each launch at once

void check_launch() {}  // run_grid has checked the launch, and raised

int64_t int32_index_limit() { return sim::options().int32_limit; }

void note_index_bits(int bits) {
  ++(bits == 32 ? sim::statistics.int32_launches : sim::statistics.int64_launches);
}

int64_t budget_bytes(int64_t gpu_budget) {
  return sim::options().budget_bytes > 0 ? sim::options().budget_bytes : gpu_budget;
}

int64_t grid_blocks(int64_t blocks) {
  return sim::options().max_blocks > 0 ? std::min(blocks, sim::options().max_blocks) : blocks;
}

bool level_checks_on_device() { return sim::options().level_checks; }

}  // namespace cuda
}  // namespace deform_conv
