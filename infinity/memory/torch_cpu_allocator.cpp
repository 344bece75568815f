// torch's CPU allocator, with its large blocks asked of glibc as plain malloc (see torch_cpu_allocator.py).
//
// c10's default CPU allocator asks posix_memalign for 64-byte alignment. glibc before 2.38 serves an aligned
// request by asking its heap for the size plus the alignment plus a minimum chunk, so a freed block is never
// reused by the next request of the same size: the heap grows past holes of exactly that size. This allocator
// asks malloc for the size plus 80 bytes, aligns the pointer it hands out to 64 bytes and keeps a mark and malloc's
// own pointer in the 16 bytes before it, so a freed block fits the next request of the same size. Blocks below
// the threshold, and every block allocated before it was installed, stay c10's.
//
// Memory only: no policy here. Which processes install it, and when, is decided in Python.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr std::size_t kAlignment = 64;  // c10's gAlignment
constexpr std::size_t kHeader = 2 * sizeof(std::uintptr_t);  // a mark, then malloc's pointer, below the block
constexpr std::uintptr_t kMark = 0x696e66696e697479ULL;  // "infinity"

c10::DeleterFnPtr c10_raw_deleter = nullptr;  // the allocator's below this one: blocks that are not ours

// Ours where the two words below the block hold the mark and a pointer at most kAlignment + kHeader below it.
// Below a block of c10's lie glibc's chunk header (the previous chunk's size or last bytes, then this chunk's
// size with its flag bits): never a pointer just below the block.
bool is_ours(void* data) {
  auto at = reinterpret_cast<std::uintptr_t>(data);
  if (data == nullptr || at % kAlignment != 0) {
    return false;
  }
  auto words = static_cast<std::uintptr_t*>(data);
  return words[-2] == kMark && words[-1] < at && at - words[-1] <= kAlignment + kHeader;
}

// The deleter of every block it hands out, and its raw deleter: code that takes raw blocks from torch's CPU
// allocator frees them through the allocator it finds then, which may not be the one that gave them (oneDNN's
// scratch buffers), so a block that is not ours goes to c10's deleter.
void free_block(void* data) {
  if (!is_ours(data)) {
    if (data != nullptr) {
      c10_raw_deleter(data);
    }
    return;
  }
  c10::profiledCPUMemoryReporter().Delete(data);
  auto words = static_cast<std::uintptr_t*>(data);
  void* base = reinterpret_cast<void*>(words[-1]);
  words[-2] = 0;  // a freed block is never taken for ours again
  std::free(base);
}

class MallocBackedCpuAllocator final : public c10::Allocator {
 public:
  MallocBackedCpuAllocator(c10::Allocator* below, std::size_t threshold) : below_(below), threshold_(threshold) {}

  c10::DataPtr allocate(std::size_t nbytes) override {
    if (nbytes < threshold_) {
      return below_->allocate(nbytes);
    }
    void* base = std::malloc(nbytes + kAlignment + kHeader);
    if (base == nullptr) {
      c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DefaultCPUAllocator: not enough memory: you tried to allocate ",
                       nbytes, " bytes.");
    }
    auto first = reinterpret_cast<std::uintptr_t>(base) + kHeader;
    void* data = reinterpret_cast<void*>((first + kAlignment - 1) & ~(kAlignment - 1));
    auto words = static_cast<std::uintptr_t*>(data);
    words[-1] = reinterpret_cast<std::uintptr_t>(base);
    words[-2] = kMark;
    c10::profiledCPUMemoryReporter().New(data, nbytes);
    return {data, data, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* below_;
  std::size_t threshold_;
};

MallocBackedCpuAllocator* installed = nullptr;

}  // namespace

extern "C" {

// Installs the allocator as torch's CPU allocator (once per process; a second call changes nothing).
// Returns 1 where it is torch's CPU allocator afterwards, 0 where another allocator of a higher priority kept
// the place or c10's has no raw deleter to give foreign blocks to.
int infinity_install_cpu_allocator(std::size_t threshold) {
  if (installed == nullptr) {
    c10::Allocator* below = c10::GetCPUAllocator();
    c10_raw_deleter = below->raw_deleter();
    if (c10_raw_deleter == nullptr) {
      return 0;
    }
    installed = new MallocBackedCpuAllocator(below, threshold);  // lives as long as the process
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == installed ? 1 : 0;
}

// 1 where torch's CPU allocator is this one now (another library may have set its own since).
int infinity_cpu_allocator_is_current() {
  return installed != nullptr && c10::GetCPUAllocator() == installed ? 1 : 0;
}

// 1 where malloc is glibc's: the header check reads below c10's blocks, which only glibc's chunk layout makes
// safe, and another malloc (a preloaded one, a sanitizer's) has no reason for the workaround.
int infinity_malloc_is_glibc() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&std::malloc), &info) == 0 || info.dli_fname == nullptr) {
    return 0;
  }
  const char* name = std::strrchr(info.dli_fname, '/');
  name = name == nullptr ? info.dli_fname : name + 1;
  return std::strncmp(name, "libc.so", 7) == 0 ? 1 : 0;
}

// 1 where the block at ``data`` came from this allocator (tests).
int infinity_block_is_malloc_backed(void* data) {
  return is_ours(data) ? 1 : 0;
}

// Raw blocks through torch's CPU allocator, as oneDNN takes them (tests): a small one (c10's, freed through this
// allocator's raw deleter), a large one (ours), and one of c10's own freed through this allocator. 1 where all
// came back.
int infinity_raw_blocks_round_trip() {
  c10::Allocator* current = c10::GetCPUAllocator();
  void* small = current->raw_allocate(4096);
  void* large = current->raw_allocate(std::size_t{4} << 20);
  void* foreign = c10::GetDefaultCPUAllocator()->raw_allocate(std::size_t{4} << 20);
  bool large_is_ours = is_ours(large) && !is_ours(small) && !is_ours(foreign);
  current->raw_deallocate(small);
  current->raw_deallocate(large);
  current->raw_deallocate(foreign);
  return large_is_ours ? 1 : 0;
}

}  // extern "C"
