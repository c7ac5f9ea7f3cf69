#pragma once
// Internal to local_engine: the CUDA executor, built only with BATCHLM_HAVE_CUDA.

#include <memory>
#include <string>

#include "batchlm/local_engine/executor.hpp"

namespace batchlm::local_engine {

#ifdef BATCHLM_HAVE_CUDA
// Whether a GPU can run the engine; why_not says why not.
bool cuda_device_usable(std::string& why_not);
// Whether the GPU kernels take every matrix type of `model`; why_not names the first they
// do not.
bool cuda_takes_model(const Model& model, std::string& why_not);
std::unique_ptr<Executor> make_cuda_executor(std::shared_ptr<const Model> model,
                                             const ExecutorOptions& options);
#endif

}  // namespace batchlm::local_engine
