// TiedNet: a linear encoder whose weight a tied decoder uses again, and a head. With
// `register_twice` the weight is also registered as "dec_w", so LibTorch's
// named_parameters() lists the one tensor under two names, as a model with tied weights
// does. Shared by the tied-weights tests of training and of checkpoints.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace decent_dp {
namespace testing {

struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl(int64_t in, int64_t out, uint64_t seed, bool register_twice = true) {
    torch::manual_seed(seed);
    enc = register_module("enc", torch::nn::Linear(in, in));
    head = register_module("head", torch::nn::Linear(in, out));
    if (register_twice) {
      register_parameter("dec_w", enc->weight);
    }
  }
  // Inputs are flattened past the batch dimension.
  at::Tensor forward(const at::Tensor& x) {
    const auto h = torch::tanh(enc(x.flatten(1)));
    return head(torch::tanh(torch::nn::functional::linear(h, enc->weight)));
  }
  torch::nn::Linear enc{nullptr}, head{nullptr};
};
TORCH_MODULE(TiedNet);

}  // namespace testing
}  // namespace decent_dp
