// Small host values (a step's timesteps, a batch's row index, per-row adapter scales) onto a device
// without waiting for it.
//
// A host tensor's ordinary copy to a GPU (`t.to(device)`) is a blocking one: LibTorch waits for
// everything queued on the current stream before it returns. Inside a denoising step that makes the
// host queue the next kernels only once the GPU has run out of work. ToDeviceWithoutWaiting copies
// from pinned memory without waiting instead (the copy is queued on the current stream, and the pinned
// block is not reused before it is done); where the host cannot pin, it copies as before. On the CPU
// (and the simulated device) it is `to(device)`.
//
//   const at::Tensor index = ToDeviceWithoutWaiting(at::tensor(rows), device);
#ifndef STOWAGE_MODELS_CORE_DEVICE_COPY_H_
#define STOWAGE_MODELS_CORE_DEVICE_COPY_H_

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace stowage {

at::Tensor ToDeviceWithoutWaiting(const at::Tensor& host, const c10::Device& device);

// `values` as a float32 tensor on `device`, without waiting: filled there when they are all the same
// bits (the usual case), else ToDeviceWithoutWaiting.
at::Tensor FloatsOnDevice(const std::vector<float>& values, const c10::Device& device);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_DEVICE_COPY_H_
