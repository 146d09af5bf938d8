// Sync-free CPU-assisted LoRA invocation (Toppings §4.2, Fig. 10-bottom).
//
// The engine hands a layer's input rows to CPU workers and takes their
// result back without the host ever waiting on a stream: everything below
// is enqueued on the current CUDA stream and returns at once.
//
//   copy_to_host_and_flag  x (device) -> pinned host buffer, then a 1-thread
//                          kernel stores `value` into host-mapped flags[index]:
//                          a CPU thread polling that flag sees x complete
//                          (the stream runs the copy before the kernel; the
//                          copy's and the store's PCIe writes arrive in order).
//   wait_host_flag         a 1-thread kernel spins (volatile reads of
//                          host-mapped memory, __nanosleep between) until
//                          flags[index + i] >= value for i < count: the GPU,
//                          not the host, waits for the CPU result. With a
//                          timeout it gives up and stores `value` into
//                          flags[timeout_index], so a dead CPU worker stalls
//                          the stream for at most that long and says so; a
//                          wait that finds flags[timeout_index] already set
//                          returns at once (the later waits queued behind a
//                          dead worker cost nothing more).
//
// The result comes back with an ordinary asynchronous host-to-device copy
// enqueued after the wait (worker/cpu_lora/pool.py): the stream orders it.
// Flag values are fixed when enqueued, so these launches are not meant for
// CUDA-graph capture.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void set_flag_kernel(long long* flag, long long value) {
  __threadfence_system();  // writes ordered before this kernel land first
  *reinterpret_cast<volatile long long*>(flag) = value;
  __threadfence_system();
}

__global__ void wait_flags_kernel(const long long* flags, int count, long long value,
                                  unsigned long long timeout_ns, long long* timed_out) {
  const volatile long long* f = flags;
  // An earlier wait gave up: the workers are gone (a wait spinning when the
  // host finds out is released by the host, worker/cpu_lora/pool.py abandon).
  if (timed_out != nullptr && *reinterpret_cast<const volatile long long*>(timed_out) != 0) {
    return;
  }
  const unsigned long long start = global_ns();
  unsigned sleep_ns = 64;
  for (int i = 0; i < count; ++i) {
    while (f[i] < value) {
      // Signed: a timer read earlier than `start` (not monotonic under
      // some virtualised GPUs?) must not look like a wrapped-around age.
      const long long age = static_cast<long long>(global_ns() - start);
      if (timeout_ns != 0 && age > static_cast<long long>(timeout_ns)) {
        if (timed_out != nullptr) {
          *reinterpret_cast<volatile long long*>(timed_out) = value;
          __threadfence_system();
        }
        return;
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
      __nanosleep(sleep_ns);  // fewer PCIe reads while the CPU works
      if (sleep_ns < 2048) sleep_ns *= 2;
#endif
    }
  }
  __threadfence_system();  // the flags' reads complete before what follows
}

void check_flags(const at::Tensor& flags, int64_t index, int64_t count) {
  TORCH_CHECK(flags.device().is_cpu() && flags.scalar_type() == at::kLong &&
                  flags.is_contiguous(),
              "flags must be a contiguous int64 CPU tensor in pinned, mapped host memory");
  TORCH_CHECK(index >= 0 && count >= 1 && index + count <= flags.numel(), "flags[", index,
              ":", index + count, "] is out of range of ", flags.numel(), " flags");
}

// The device's address of host-mapped flags[index]; fails unless the memory
// is pinned and mapped (cudaHostAlloc, or cudaHostRegister with
// cudaHostRegisterMapped).
long long* mapped(const at::Tensor& flags, int64_t index) {
  void* device = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&device, flags.data_ptr(), 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the caller
    TORCH_CHECK(false, "flags are not pinned, mapped host memory (cudaHostGetDevicePointer: ",
                cudaGetErrorString(err), ")");
  }
  return static_cast<long long*>(device) + index;
}

bool is_pinned_host(const void* ptr) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

void copy_to_host_and_flag(const at::Tensor& x, const at::Tensor& dst, const at::Tensor& flags,
                           int64_t index, int64_t value) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "x must be a contiguous CUDA tensor");
  TORCH_CHECK(dst.device().is_cpu() && dst.is_contiguous() &&
                  dst.scalar_type() == x.scalar_type() && dst.numel() >= x.numel(),
              "dst must be a contiguous CPU tensor of x's dtype with room for x");
  // A copy into pageable memory would make cudaMemcpyAsync wait on the host.
  TORCH_CHECK(is_pinned_host(dst.data_ptr()), "dst must be pinned host memory");
  check_flags(flags, index, 1);
  const c10::cuda::CUDAGuard guard(x.device());
  long long* flag = mapped(flags, index);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), x.data_ptr(), x.numel() * x.element_size(),
                                 cudaMemcpyDeviceToHost, stream));
  set_flag_kernel<<<1, 1, 0, stream>>>(flag, value);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void wait_host_flag(const at::Tensor& flags, int64_t index, int64_t value, int64_t count,
                    int64_t timeout_ns, int64_t timeout_index) {
  check_flags(flags, index, count);
  TORCH_CHECK(timeout_ns >= 0, "timeout_ns must be >= 0 (0: wait forever)");
  long long* timed_out = nullptr;
  if (timeout_index >= 0) {
    check_flags(flags, timeout_index, 1);
    TORCH_CHECK(timeout_index < index || timeout_index >= index + count,
                "the timeout flag must not be one of the flags waited on");
    timed_out = mapped(flags, timeout_index);
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  wait_flags_kernel<<<1, 1, 0, stream>>>(mapped(flags, index), static_cast<int>(count), value,
                                         static_cast<unsigned long long>(timeout_ns),
                                         timed_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(loraserve_assist, m) {
  m.def("copy_to_host_and_flag(Tensor x, Tensor(a!) dst, Tensor(b!) flags, int index, "
        "int value) -> ()",
        &copy_to_host_and_flag);
  m.def("wait_host_flag(Tensor(a!) flags, int index, int value, int count=1, "
        "int timeout_ns=0, int timeout_index=-1) -> ()",
        &wait_host_flag);
}
