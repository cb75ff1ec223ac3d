#include "torch_catch.h"

#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "decent_dp/bucket.h"
#include "decent_dp/bucket_set.h"
#include "decent_dp/detail/order_statistics.h"
#include "decent_dp/env.h"
#include "decent_dp/exchange.h"
#include "decent_dp/optim/adam.h"

using namespace decent_dp;

namespace {

BucketEntry entry(size_t i, int64_t numel, c10::ScalarType t = c10::kFloat) {
  return BucketEntry{i, numel, t, c10::Device(c10::kCPU)};
}

}  // namespace

TEST_CASE("bucket plan: alignment, cap boundaries, order", "[bucket]") {
  CHECK(align_numel(0) == 0);
  CHECK(align_numel(1) == 32);
  CHECK(align_numel(32) == 32);
  CHECK(align_numel(33) == 64);
  // float32: 32 elements = 128 bytes per aligned slot. Cap 256 bytes = two slots.
  auto plan =
      plan_buckets({entry(5, 10), entry(4, 20), entry(3, 40), entry(2, 1), entry(1, 7)}, 256);
  REQUIRE(plan.size() == 3);
  CHECK(plan[0].params == std::vector<size_t>{5, 4});  // 128 + 128 = 256 reaches the cap
  CHECK(plan[0].offsets == std::vector<int64_t>{0, 32});
  CHECK(plan[0].numel == 64);
  CHECK(plan[1].params == std::vector<size_t>{3});  // 64 elements = 256 bytes: closes alone
  CHECK(plan[1].numel == 64);
  CHECK(plan[2].params == std::vector<size_t>{2, 1});  // the rest, still open at the end
  CHECK(plan[2].bytes() == 256);
  // The parameter that crosses the cap stays in the bucket.
  auto crossing = plan_buckets({entry(0, 10), entry(1, 100)}, 200);
  REQUIRE(crossing.size() == 1);
  CHECK(crossing[0].params == std::vector<size_t>{0, 1});
  // A huge cap makes one bucket; each parameter gets its own when the cap is tiny.
  CHECK(plan_buckets({entry(0, 5), entry(1, 5), entry(2, 5)}, 1 << 30).size() == 1);
  CHECK(plan_buckets({entry(0, 5), entry(1, 5), entry(2, 5)}, 1).size() == 3);
  CHECK_THROWS_WITH(plan_buckets({entry(0, 5)}, 0),
                    Catch::Contains("bucket cap must be > 0 bytes, got 0"));
}

TEST_CASE("bucket plan: dtypes never mix", "[bucket]") {
  auto plan = plan_buckets({entry(0, 8, c10::kFloat), entry(1, 8, c10::kDouble),
                            entry(2, 8, c10::kFloat), entry(3, 8, c10::kBFloat16)},
                           1 << 20);
  REQUIRE(plan.size() == 3);
  CHECK(plan[0].dtype == c10::kFloat);
  CHECK(plan[0].params == std::vector<size_t>{0, 2});
  CHECK(plan[1].dtype == c10::kDouble);
  CHECK(plan[1].params == std::vector<size_t>{1});
  CHECK(plan[2].dtype == c10::kBFloat16);
  CHECK(plan[2].bytes() == 64);
}

TEST_CASE("bucket storage: views share the blocks, channels-last keeps its strides", "[bucket]") {
  torch::manual_seed(0);
  auto conv =
      torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
  auto bias = torch::randn({4}).requires_grad_(true);
  const auto conv_values = conv.detach().clone();
  conv.mutable_grad() = torch::ones_like(conv);
  auto plan = plan_buckets({entry(0, conv.numel()), entry(1, bias.numel())}, 1 << 20);
  REQUIRE(plan.size() == 1);
  auto storage = make_bucket_storage(plan[0], {conv, bias}, /*as_view=*/true);
  CHECK(storage.params.numel() == align_numel(108) + align_numel(4));
  CHECK(conv.is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK(conv.strides() == conv_values.strides());
  CHECK(conv.is_alias_of(storage.params));
  CHECK(bias.is_alias_of(storage.params));
  CHECK(conv.grad().is_alias_of(storage.grads));
  CHECK(torch::equal(conv, conv_values));
  CHECK(conv.grad().sum().item<double>() == 108.0);  // the existing gradient was copied in
  CHECK(bias.grad().is_alias_of(storage.grads));     // gradients always live in the block
  CHECK(bias.grad().abs().sum().item<double>() == 0.0);
  // Padding is zero and the views are where the plan says.
  CHECK(storage.params.narrow(0, 108, 128 - 108).abs().sum().item<double>() == 0.0);
  CHECK(storage.params[128].item<float>() == bias[0].item<float>());
  // Writing the block is visible through the parameter.
  torch::NoGradGuard no_grad;
  storage.params.narrow(0, 128, 4).fill_(7.0);
  CHECK(bias.sum().item<double>() == 28.0);
}

TEST_CASE("bucket storage: a block that starts inside its storage holds the views", "[bucket]") {
  // An allocator may hand out a block that starts past its storage's first element (a
  // slice of a larger buffer); the views are placed relative to the block.
  torch::manual_seed(3);
  auto conv =
      torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
  auto bias = torch::randn({4}).requires_grad_(true);
  const auto conv_values = conv.detach().clone();
  const auto bias_values = bias.detach().clone();
  auto plan = plan_buckets({entry(0, conv.numel()), entry(1, bias.numel())}, 1 << 20);
  auto sliced = [](int64_t numel, const at::TensorOptions& options) {
    return at::zeros({numel + 5}, options).narrow(0, 5, numel);
  };
  auto storage = make_bucket_storage(plan[0], {conv, bias}, /*as_view=*/true, true, sliced);
  REQUIRE(storage.params.storage_offset() == 5);
  CHECK(conv.strides() == conv_values.strides());
  CHECK(torch::equal(conv, conv_values));
  CHECK(torch::equal(storage.params.narrow(0, 128, 4), bias_values));
  CHECK(
      torch::equal(storage.params.narrow(0, 0, 108), conv_values.permute({0, 2, 3, 1}).flatten()));
  CHECK(storage.params.narrow(0, 108, 128 - 108).abs().sum().item<double>() == 0.0);
  CHECK(conv.grad().storage_offset() == storage.grads.storage_offset());
  CHECK(bias.grad().storage_offset() == storage.grads.storage_offset() + 128);
  CHECK(storage.comm_views[1].storage_offset() == storage.comm.storage_offset() + 128);
  torch::NoGradGuard no_grad;
  storage.params.narrow(0, 128, 4).fill_(7.0);
  CHECK(bias.sum().item<double>() == 28.0);
}

TEST_CASE("bucket storage: swapping the parameter and communication blocks", "[bucket]") {
  torch::manual_seed(1);
  auto conv =
      torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
  auto bias = torch::randn({4}).requires_grad_(true);
  auto plan = plan_buckets({entry(0, conv.numel()), entry(1, bias.numel())}, 1 << 20);
  auto storage = make_bucket_storage(plan[0], {conv, bias}, /*as_view=*/true);
  torch::NoGradGuard no_grad;
  REQUIRE(storage.comm_views.size() == 2);
  CHECK(storage.comm_views[0].strides() == conv.strides());
  CHECK(storage.comm_views[0].is_alias_of(storage.comm));
  const auto incoming = torch::randn({storage.comm.numel()});
  incoming.narrow(0, 108, 128 - 108).zero_();  // padding stays zero
  incoming.narrow(0, 132, incoming.numel() - 132).zero_();
  storage.comm.copy_(incoming);
  const auto old_block = storage.params;
  const auto grad_before = conv.grad();
  const auto* conv_impl = conv.unsafeGetTensorImpl();
  swap_param_and_comm_blocks(storage, {conv, bias});
  CHECK(conv.unsafeGetTensorImpl() == conv_impl);  // the same parameter, new data
  CHECK(conv.is_alias_of(storage.params));
  CHECK(bias.is_alias_of(storage.params));
  CHECK(storage.comm.is_same(old_block));
  CHECK(torch::equal(storage.params, incoming));
  CHECK(conv.strides() == storage.comm_views[0].strides());
  CHECK(conv.is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK(torch::equal(bias, incoming.narrow(0, 128, 4)));
  CHECK(conv.grad().is_same(grad_before));  // gradients stay where they were
  CHECK(storage.param_views[0].is_alias_of(storage.params));
  CHECK(storage.comm_views[1].is_alias_of(storage.comm));
  CHECK_THROWS_WITH(swap_param_and_comm_blocks(storage, {conv}),
                    Catch::Contains("expected 2 tensors to rebind, got 1"));
}

TEST_CASE("bucket storage: a fused optimizer keeps its flat state across block swaps", "[bucket]") {
  // Two identical flat buckets step the same gradients; one swaps blocks before every step
  // (with the same values in both blocks), the other does not: bit-identical parameters, and
  // the swapping one keeps its moment blocks (no reallocation, no reset).
  auto make = [](std::vector<at::Tensor>& params) {
    torch::manual_seed(2);
    params = {torch::randn({16, 8}).requires_grad_(true), torch::randn({16}).requires_grad_(true)};
    auto plan = plan_buckets({entry(0, 128), entry(1, 16)}, 1 << 20);
    return make_bucket_storage(plan[0], params, /*as_view=*/true);
  };
  std::vector<at::Tensor> pa, pb;
  auto sa = make(pa);
  auto sb = make(pb);
  optim::AdamW oa(pa, optim::AdamWOptions(1e-2).weight_decay(0.1));
  optim::AdamW ob(pb, optim::AdamWOptions(1e-2).weight_decay(0.1));
  const void* moment = nullptr;
  for (int step = 0; step < 5; ++step) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(100 + step);
    const auto g = torch::randn({sa.grads.numel()});
    g.narrow(0, 128, 16).zero_();  // padding of w's slot
    g.narrow(0, 144, g.numel() - 144).zero_();
    sa.grads.copy_(g);
    sb.grads.copy_(g);
    sb.comm.copy_(sb.params);
    swap_param_and_comm_blocks(sb, pb);
    oa.step();
    ob.step();
    CHECK(torch::equal(pa[0], pb[0]));
    CHECK(torch::equal(pa[1], pb[1]));
    auto& state =
        static_cast<optim::AdamFamilyParamState&>(*ob.state().at(pb[0].unsafeGetTensorImpl()));
    if (moment == nullptr)
      moment = state.exp_avg().data_ptr();
    CHECK(state.exp_avg().data_ptr() == moment);
    CHECK(state.step() == step + 1);
  }
  CHECK(ob.last_flat_groups() == 1);
}

TEST_CASE("shutdown waits one deadline for all buckets, not one per bucket", "[bucket]") {
  // Four one-parameter buckets whose exchanges never finish (a peer stopped taking part).
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<size_t> order;
  for (size_t i = 0; i < 4; ++i) {
    params.push_back(torch::zeros({64}).requires_grad_(true));
    names.push_back("p" + std::to_string(i));
    order.push_back(i);
  }
  auto binding = decent_dp::make_param_binding(true);
  decent_dp::BucketSetOptions o;
  o.bucket_cap_mb = 1e-9;  // every parameter closes its own bucket
  o.bind_grads = false;
  decent_dp::BucketSet set;
  set.build(order, params, names, *binding, o);
  REQUIRE(set.size() == 4);
  for (auto& b : set) {
    b.work = std::make_shared<decent_dp::Work>("exchange that never ends",
                                               std::vector<at::Tensor>{}, std::chrono::minutes(10));
  }
  const auto t0 = std::chrono::steady_clock::now();
  decent_dp::Exchange::drain(set, std::chrono::milliseconds(400));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // One deadline in total: well under the 4 x 0.4 s that one timeout per bucket would take.
  CHECK(s >= 0.35);
  CHECK(s < 1.2);
  // A finished exchange costs nothing.
  for (auto& b : set)
    b.work->finish();
  const auto t1 = std::chrono::steady_clock::now();
  decent_dp::Exchange::drain(set, std::chrono::milliseconds(400));
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() < 0.2);
}

TEST_CASE("a wait of the longest timeout waits instead of timing out at once", "[work]") {
  // now() + milliseconds::max() overflows the clock: the deadline must saturate.
  auto work = std::make_shared<Work>("test operation", std::vector<at::Tensor>{},
                                     std::chrono::milliseconds::max());
  std::thread finisher([work] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    work->finish();
  });
  CHECK_NOTHROW(work->wait());
  CHECK_NOTHROW(work->wait(std::chrono::milliseconds::max()));
  finisher.join();
}

// Run by ctest with DECENT_DP_TIMEOUT_MS set far beyond any representable deadline.
TEST_CASE("a timeout beyond the longest allowed is refused, naming the variable", "[.env]") {
  CHECK_THROWS_WITH(env::timeout_ms(),
                    Catch::Contains("DECENT_DP_TIMEOUT_MS must be an integer in [1, "
                                    "1000000000000], got '9223372036854775000'"));
}

TEST_CASE("trimmed mean: direct formulas on hand-made rows", "[aggregator]") {
  using decent_dp::TrimmedMeanAggregator;
  decent_dp::topology::Group g;
  auto run = [&g](int64_t b, const at::Tensor& rows) {
    g.ranks.clear();
    for (int64_t m = 0; m < rows.size(0); ++m)
      g.ranks.push_back(static_cast<int>(m));
    at::Tensor out = at::empty({rows.size(1)});
    TrimmedMeanAggregator(b).aggregate(rows, 0, g, out);
    return out;
  };
  // Odd k = 5, b = 1: per column drop the largest and the smallest, average three.
  const at::Tensor rows5 = torch::tensor({{1.0f, 10.0f, -3.0f},
                                          {2.0f, 10.0f, 100.0f},
                                          {3.0f, 10.0f, 0.0f},
                                          {4.0f, 10.0f, 1.0f},
                                          {1e9f, 10.0f, 2.0f}});
  CHECK(run(1, rows5).equal(torch::tensor({3.0f, 10.0f, 1.0f})));  // ties: equal columns stay
  // b = 2 of k = 5 is the median.
  CHECK(run(2, rows5).equal(torch::tensor({3.0f, 10.0f, 1.0f})));
  // b = 0 is the plain mean of the rows.
  CHECK(torch::allclose(run(0, rows5), rows5.mean(0)));
  // Even k = 4, b = 1: the mean of the two middle values.
  const at::Tensor rows4 = torch::tensor({{0.0f, 5.0f}, {8.0f, 5.0f}, {2.0f, -7.0f}, {4.0f, 9.0f}});
  CHECK(run(1, rows4).equal(torch::tensor({3.0f, 5.0f})));
  // A single member keeps its own value; k <= 2b is an error naming the group.
  CHECK(run(3, torch::tensor({{1.5f, 2.5f}})).equal(torch::tensor({1.5f, 2.5f})));
  CHECK_THROWS_WITH(run(1, rows4.narrow(0, 0, 2)),
                    Catch::Contains("needs groups of more than 2 members; group [0,1] has 2"));
  CHECK_THROWS_AS(TrimmedMeanAggregator(-1), decent_dp::InvalidArgument);
  CHECK(TrimmedMeanAggregator(2).name() == "trimmed-mean(b=2)");
}

TEST_CASE("trimmed mean: the topology check names the first group that is too small",
          "[aggregator]") {
  using decent_dp::TrimmedMeanAggregator;
  auto complete5 = decent_dp::topology::make_topology("complete", 5, 1);
  CHECK_NOTHROW(TrimmedMeanAggregator(2).check(*complete5));  // 5 > 2 * 2
  auto complete4 = decent_dp::topology::make_topology("complete", 4, 1);
  CHECK_THROWS_WITH(
      TrimmedMeanAggregator(2).check(*complete4),
      Catch::Contains("topology 'complete' has group [0,1,2,3] (4 members) in slot 0"));
  auto ring = decent_dp::topology::make_topology("ring", 8, 1);
  CHECK_NOTHROW(TrimmedMeanAggregator(0).check(*ring));
  CHECK_THROWS_WITH(TrimmedMeanAggregator(1).check(*ring), Catch::Contains("topology 'ring'"));
}

TEST_CASE("sorting network: every 0-1 input of up to 16 rows comes out sorted", "[aggregator]") {
  // The 0-1 principle: a comparator network that sorts every sequence of zeros and ones
  // sorts every sequence. Column c holds the bits of c, so all 2^k inputs run at once, and
  // position m of a sorted column is 1 exactly when m >= k - popcount(c).
  for (int k = 1; k <= 16; ++k) {
    INFO("k " << k);
    const int64_t n = int64_t{1} << k;
    at::Tensor rows = at::empty({k, n});
    auto a = rows.accessor<float, 2>();
    for (int m = 0; m < k; ++m)
      for (int64_t c = 0; c < n; ++c)
        a[m][c] = static_cast<float>((c >> m) & 1);
    const at::Tensor ones = rows.sum(0);
    at::Tensor out = at::empty({n});
    for (int m = 0; m < k; ++m) {
      decent_dp::detail::sorted_range_sum(rows.data_ptr<float>(), n, k, n, m, m + 1, 1.0f,
                                          out.data_ptr<float>());
      CHECK(out.equal(ones.ge(k - m).to(at::kFloat)));
    }
    // Batcher's comparator count: 19 at k = 8, 63 at k = 16.
    if (k == 8)
      CHECK(decent_dp::detail::sorting_network(8).size() == 19);
    if (k == 16)
      CHECK(decent_dp::detail::sorting_network(16).size() == 63);
  }
}

TEST_CASE("sorting network: order statistics equal ATen's sort, ties, infinities and NaN",
          "[aggregator]") {
  torch::manual_seed(3);
  for (int k : {2, 3, 5, 7, 8, 9, 17, 33, 64}) {
    for (int64_t n : {1, 255, 256, 1000}) {
      INFO("k " << k << " n " << n);
      // Rounded values make ties common; a few infinities and NaNs (sorted last by ATen).
      at::Tensor rows = torch::randn({k, n}).mul_(4).round_();
      at::Tensor u = torch::rand({k, n});
      rows.masked_fill_(u < 0.03, std::numeric_limits<float>::infinity());
      rows.masked_fill_(u > 0.97, -std::numeric_limits<float>::infinity());
      rows.masked_fill_((u > 0.5) & (u < 0.53), std::numeric_limits<float>::quiet_NaN());
      const at::Tensor sorted = std::get<0>(rows.sort(0));
      at::Tensor out = at::empty({n});
      for (int m = 0; m < k; ++m) {
        decent_dp::detail::sorted_range_sum(rows.data_ptr<float>(), n, k, n, m, m + 1, 1.0f,
                                            out.data_ptr<float>());
        const at::Tensor want = sorted[m];
        CHECK(out.isnan().equal(want.isnan()));
        CHECK(out.nan_to_num(0, 1e30, -1e30).equal(want.nan_to_num(0, 1e30, -1e30)));
      }
      // A strided view (rows further apart than n) and double rows.
      at::Tensor wide = torch::zeros({k, n + 7}, at::kDouble);
      wide.narrow(1, 0, n).copy_(rows);
      at::Tensor outd = at::empty({n}, at::kDouble);
      const int lo = k / 3, hi = k - k / 3;
      decent_dp::detail::sorted_range_sum(wide.data_ptr<double>(), n + 7, k, n, lo, hi,
                                          static_cast<double>(hi - lo), outd.data_ptr<double>());
      const at::Tensor wantd =
          std::get<0>(wide.narrow(1, 0, n).sort(0)).narrow(0, lo, hi - lo).sum(0) / (hi - lo);
      CHECK(outd.isnan().equal(wantd.isnan()));
      CHECK(torch::allclose(outd.nan_to_num(0, 1e30, -1e30), wantd.nan_to_num(0, 1e30, -1e30),
                            1e-12, 0));
    }
  }
}

TEST_CASE("median and trimmed mean agree with ATen's sort on every path", "[aggregator]") {
  torch::manual_seed(5);
  decent_dp::topology::Group g;
  for (int k : {1, 2, 3, 4, 8, 11, 64, 65}) {  // 65: beyond the network, ATen's sort
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf}) {  // half: ATen's sort
      INFO("k " << k << " dtype " << dtype);
      g.ranks.resize(static_cast<size_t>(k));
      for (int m = 0; m < k; ++m)
        g.ranks[static_cast<size_t>(m)] = m;
      const int64_t n = 777;
      const at::Tensor rows = torch::randn({k, n}).to(dtype);
      const at::Tensor sorted = std::get<0>(rows.to(at::kDouble).sort(0));
      at::Tensor out = at::empty({n}, dtype);
      decent_dp::MedianAggregator().aggregate(rows, 0, g, out);
      const at::Tensor median =
          k % 2 == 1 ? sorted[k / 2] : (sorted[k / 2 - 1] + sorted[k / 2]) / 2;
      const double tol = dtype == at::kHalf ? 1e-3 : 1e-6;
      CHECK(torch::allclose(out.to(at::kDouble), median, tol, tol));
      for (int64_t b : {0, 1, 3}) {
        if (k > 1 && k <= 2 * b)
          continue;
        decent_dp::TrimmedMeanAggregator(b).aggregate(rows, 0, g, out);
        const at::Tensor want = k == 1 ? sorted[0] : sorted.narrow(0, b, k - 2 * b).mean(0);
        CHECK(torch::allclose(out.to(at::kDouble), want, tol, tol));
      }
    }
  }
}

TEST_CASE("trimmed mean drops a member that sends NaN or infinity", "[aggregator]") {
  decent_dp::topology::Group g;
  g.ranks = {0, 1, 2, 3, 4};
  at::Tensor rows = torch::arange(5 * 300, at::kFloat).view({5, 300}).remainder(7);
  rows[1].fill_(std::numeric_limits<float>::quiet_NaN());
  rows[3].fill_(-std::numeric_limits<float>::infinity());
  at::Tensor out = at::empty({300});
  decent_dp::TrimmedMeanAggregator(1).aggregate(rows, 0, g, out);
  // Per column the NaN is the largest and -inf the smallest: rows 0, 2 and 4 remain.
  const at::Tensor honest = torch::stack({rows[0], rows[2], rows[4]}).mean(0);
  CHECK(torch::allclose(out, honest));
}
