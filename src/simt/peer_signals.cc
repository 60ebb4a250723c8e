// The board of peer_signals.h, and simt.h's ScopedPeerLaunch.
//
// The board's own synchronisation (its mutex, the devices' turns) is hidden from
// ThreadSanitizer (HiddenSync) and runs on the OS threads' main contexts, never in a
// kernel thread's fiber, which only counts its flag stores in a relaxed atomic; and fiber
// switches carry no ordering for ThreadSanitizer (fiber.cc). So the only orderings between
// two devices' kernels that ThreadSanitizer sees are the kernels' own acquire loads of
// release-stored flags, and a kernel that reads a peer's memory before its flag is
// reported as a race, whatever order the turns gave. Waiting launches therefore poll the
// count, every 200 us.
#include "peer_signals.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <vector>

#include "sanitizers.h"
#include "simt.h"

namespace simt {
namespace internal {
namespace {

// A device that has not begun its launch while the others wait this long is reported;
// every other deadlock is found as soon as it happens.
constexpr auto kAbsentDeviceTimeout = std::chrono::seconds(60);

struct Member {
  int64_t launches = 0;  // launches begun
  bool running = false;
  bool runs_ahead = false;  // under a ScopedPeerRunAhead: its next launch follows at once
  bool stalled = false;     // every thread of its running block waits for a flag
  uint64_t checked_at = 0;  // the board's generation when it last found its flags unmet
  std::string waits;
  std::optional<std::string> failure;  // the deadlock it is part of
};

struct Group {
  std::vector<Member> members;
  // The member whose kernel runs; -1 when none does. One device of a group runs at a time,
  // until all its threads wait for flags or its launch ends: a device that fails to wait
  // for a peer runs ahead of it and reads what the peer has not yet written, in every
  // run, not only in an unlucky one.
  int holder = -1;
  // The member whose launch ended under a ScopedPeerRunAhead: the turn is kept for its
  // next launch, which begins before any other member resumes; -1 when none.
  int reserved = -1;
};

struct Board {
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t launch_events = 0;  // launches begun and ended
  std::map<uint64_t, Group> groups;
  // Flag stores, counted from kernel threads: relaxed, so that it orders nothing.
  std::atomic<uint64_t> flag_stores{0};

  // Changes whenever some flag may have changed.
  uint64_t generation() const {
    return launch_events + flag_stores.load(std::memory_order_relaxed);
  }
};

Board& TheBoard() {
  static Board* board = new Board;  // never destroyed: launches may run at exit
  return *board;
}

thread_local std::optional<PeerLaunch> current_launch;

// No flag of `group` can change any more: every member that is in a launch waits and has
// looked at its flags since the last change, and every other one has had its launch
// `launch` already (it will not store a flag for it).
bool Deadlocked(const Board& board, const Group& group, int64_t launch) {
  for (const Member& m : group.members) {
    if (m.running ? !(m.stalled && m.checked_at == board.generation()) : m.launches < launch) {
      return false;
    }
  }
  return true;
}

// Some device has not begun launch `launch` while every device that has waits: only a
// device that never comes (another program, a crashed thread) keeps the others waiting.
bool Absent(const Group& group, int64_t launch) {
  bool absent = false;
  for (const Member& m : group.members) {
    if (m.running && !m.stalled) return false;
    absent = absent || (!m.running && m.launches < launch);
  }
  return absent;
}

std::string Report(const Group& group, uint64_t key, int64_t launch) {
  std::string text = "deadlock between the devices of peer group " + std::to_string(key) +
                     ": no flag they wait for can change any more;";
  for (size_t p = 0; p < group.members.size(); ++p) {
    const Member& m = group.members[p];
    text += " device at position " + std::to_string(p);
    if (m.running) {
      text += " waits: " + m.waits + ";";
    } else if (m.launches >= launch) {
      text += " has finished its launch;";
    } else {
      text += " has not begun its launch;";
    }
  }
  return text;
}

}  // namespace

std::optional<PeerLaunch> CurrentPeerLaunch() { return current_launch; }

void FlagStored() { TheBoard().flag_stores.fetch_add(1, std::memory_order_relaxed); }

std::optional<std::string> AwaitFlags(const std::function<bool()>& reached,
                                      const std::string& waits) {
  if (!current_launch) {
    if (reached()) return std::nullopt;
    return "deadlock: " + waits + ", outside any peer launch, so no other device can store it";
  }
  HiddenSync hidden;
  Board& board = TheBoard();
  std::unique_lock<std::mutex> lock(board.mutex);
  Group& group = board.groups[current_launch->group];
  const int position = current_launch->position;
  Member& me = group.members[position];
  if (group.holder == position) group.holder = -1;  // another device may run meanwhile
  board.changed.notify_all();
  auto last_change = std::chrono::steady_clock::now();
  uint64_t last_generation = board.generation();
  for (;;) {
    const uint64_t generation = board.generation();
    if (generation != last_generation) {
      last_generation = generation;
      last_change = std::chrono::steady_clock::now();
    }
    lock.unlock();
    const bool ok = reached();
    lock.lock();
    if (ok) {
      me.stalled = false;
      board.changed.wait(lock, [&] { return group.holder == -1 && group.reserved == -1; });
      group.holder = position;
      return std::nullopt;
    }
    if (me.failure) {
      std::optional<std::string> failure = std::move(me.failure);
      me.failure.reset();
      me.stalled = false;
      return failure;
    }
    me.stalled = true;
    me.waits = waits;
    if (board.generation() != generation) continue;  // a flag changed meanwhile: look again
    me.checked_at = generation;
    const bool absent_too_long =
        Absent(group, me.launches) &&
        std::chrono::steady_clock::now() - last_change > kAbsentDeviceTimeout;
    if (Deadlocked(board, group, me.launches) || absent_too_long) {
      std::string report = Report(group, current_launch->group, me.launches);
      if (absent_too_long) report += " (for 60 s, with no flag changing)";
      for (Member& m : group.members) {
        if (m.running && m.stalled && &m != &me) m.failure = report;
      }
      me.stalled = false;
      board.changed.notify_all();
      return report;
    }
    board.changed.wait_for(lock, std::chrono::microseconds(200));
  }
}

}  // namespace internal

ScopedPeerLaunch::ScopedPeerLaunch(uint64_t group, int position, int size) {
  HiddenSync hidden;
  internal::Board& board = internal::TheBoard();
  std::unique_lock<std::mutex> lock(board.mutex);
  internal::Group& g = board.groups[group];
  if (g.members.size() < static_cast<size_t>(size)) g.members.resize(size);
  internal::Member& m = g.members[position];
  m.launches += 1;
  m.running = true;
  m.stalled = false;
  m.failure.reset();
  internal::current_launch = internal::PeerLaunch{group, position, size};
  board.launch_events += 1;
  board.changed.notify_all();
  // Its kernel runs when no other device of the group runs one, and no other device's
  // next launch has the turn.
  board.changed.wait(
      lock, [&] { return g.holder == -1 && (g.reserved == -1 || g.reserved == position); });
  g.holder = position;
  if (g.reserved == position) g.reserved = -1;
}

ScopedPeerLaunch::~ScopedPeerLaunch() {
  HiddenSync hidden;
  internal::Board& board = internal::TheBoard();
  std::lock_guard<std::mutex> lock(board.mutex);
  internal::Member& m =
      board.groups[internal::current_launch->group].members[internal::current_launch->position];
  m.running = false;
  m.stalled = false;
  m.failure.reset();
  internal::Group& g = board.groups[internal::current_launch->group];
  if (g.holder == internal::current_launch->position) g.holder = -1;
  if (m.runs_ahead) g.reserved = internal::current_launch->position;
  internal::current_launch.reset();
  board.launch_events += 1;  // a launch that ended may complete a deadlock
  board.changed.notify_all();
}

ScopedPeerRunAhead::ScopedPeerRunAhead(uint64_t group, int position)
    : group_(group), position_(position) {
  HiddenSync hidden;
  internal::Board& board = internal::TheBoard();
  std::lock_guard<std::mutex> lock(board.mutex);
  internal::Group& g = board.groups[group];
  if (g.members.size() <= static_cast<size_t>(position)) g.members.resize(position + 1);
  g.members[position].runs_ahead = true;
}

ScopedPeerRunAhead::~ScopedPeerRunAhead() {
  HiddenSync hidden;
  internal::Board& board = internal::TheBoard();
  std::lock_guard<std::mutex> lock(board.mutex);
  internal::Group& g = board.groups[group_];
  g.members[position_].runs_ahead = false;
  if (g.reserved == position_) g.reserved = -1;
  board.changed.notify_all();
}

}  // namespace simt
