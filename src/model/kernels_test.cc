#include "model/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "model/numerics.h"

namespace kvbridge::model_internal {
namespace {

std::vector<float> RandomVec(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Against a double reference, each element obeys the classic dot-product bound
// |y - ref| <= gamma_k * sum_i |x_i w_i|, gamma_k = k u / (1 - k u), u = 2^-24.
TEST(MatMulNT, MatchesDoubleReferenceWithinDotProductBound) {
  std::mt19937 rng(7);
  for (int k : {1, 7, 8, 9, 16, 31, 64, 67, 256, 1000}) {
    for (int m : {1, 3, 4, 5, 13}) {
      for (int n : {1, 2, 3, 4, 7}) {
        auto x = RandomVec(static_cast<size_t>(m) * k, rng);
        auto w = RandomVec(static_cast<size_t>(n) * k, rng);
        std::vector<float> y(static_cast<size_t>(m) * n);
        MatMulNT(x.data(), m, k, w.data(), n, k, k, y.data(), n);
        const double u = std::ldexp(1.0, -24);
        const double gamma = k * u / (1 - k * u);
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < n; ++j) {
            double ref = 0, mag = 0;
            for (int p = 0; p < k; ++p) {
              ref += static_cast<double>(x[i * k + p]) * w[j * k + p];
              mag += std::fabs(static_cast<double>(x[i * k + p]) * w[j * k + p]);
            }
            EXPECT_LE(std::fabs(y[i * n + j] - ref), gamma * mag)
                << "m" << m << " n" << n << " k" << k;
          }
        }
      }
    }
  }
}

// The property the forward pass is built on: a row's result does not depend on how many other
// rows and columns are computed with it, nor on where they sit in the tiles.
TEST(MatMulNT, RowResultIndependentOfBatchShape) {
  std::mt19937 rng(11);
  for (int k : {5, 64, 67, 200}) {
    const int n = 11;
    auto w = RandomVec(static_cast<size_t>(n) * k, rng);
    auto x = RandomVec(static_cast<size_t>(17) * k, rng);
    std::vector<float> alone(n);
    MatMulNT(x.data(), 1, k, w.data(), n, k, k, alone.data(), n);
    for (int m = 1; m <= 17; ++m) {
      for (int offset = 0; offset < m; offset += 3) {
        // Row 0 of x placed at row `offset` of an m-row batch.
        std::vector<float> xb(static_cast<size_t>(m) * k);
        for (int i = 0; i < m; ++i) {
          std::memcpy(xb.data() + static_cast<size_t>(i) * k,
                      x.data() + static_cast<size_t>(i == offset ? 0 : (i % 16) + 1) * k, k * 4);
        }
        std::vector<float> y(static_cast<size_t>(m) * n);
        MatMulNT(xb.data(), m, k, w.data(), n, k, k, y.data(), n);
        ASSERT_EQ(0, std::memcmp(alone.data(), y.data() + static_cast<size_t>(offset) * n, n * 4))
            << "k=" << k << " m=" << m << " offset=" << offset;
        // Column subsets too: column j computed alone.
        for (int j = 0; j < n; ++j) {
          float one;
          MatMulNT(xb.data() + static_cast<size_t>(offset) * k, 1, k, w.data() + j * k, 1, k, k,
                   &one, 1);
          ASSERT_EQ(0, std::memcmp(&one, &alone[j], 4));
        }
      }
    }
  }
}

TEST(MatMulNT, PortablePathIsBitwiseEqualToDispatchedPath) {
  std::mt19937 rng(3);
  for (int k : {1, 8, 13, 64, 129}) {
    const int m = 9, n = 10;
    auto x = RandomVec(static_cast<size_t>(m) * k, rng);
    auto w = RandomVec(static_cast<size_t>(n) * k, rng);
    std::vector<float> a(m * n), b(m * n);
    MatMulNT(x.data(), m, k, w.data(), n, k, k, a.data(), n);
    MatMulNTPortable(x.data(), m, k, w.data(), n, k, k, b.data(), n);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4))
        << "k=" << k << " path " << KernelPath();
  }
}

TEST(MatMulNT, ReductionOrderIsTheDocumentedOne) {
  // k = 11: lanes 0..7 hold one product each, then the tree, then the 3-element tail.
  std::vector<float> x(11), w(11, 1.0f);
  const float vals[11] = {1e8f, 1.0f, -1e8f, 3.0f, 0.5f, 7.0f, 1.5f, -2.0f, 1e-3f, 5.0f, -1e-3f};
  for (int i = 0; i < 11; ++i) x[i] = vals[i];
  float lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = vals[l];
  const float s0 = lanes[0] + lanes[4], s1 = lanes[1] + lanes[5], s2 = lanes[2] + lanes[6],
              s3 = lanes[3] + lanes[7];
  float expect = (s0 + s2) + (s1 + s3);
  for (int p = 8; p < 11; ++p) expect = std::fma(vals[p], 1.0f, expect);
  EXPECT_EQ(Dot(x.data(), w.data(), 11), expect);
}

// Every path this CPU can run, for every weight type, against the portable path: bitwise equal
// on shapes that exercise every tile edge (odd rows, partial panels, K tails, row strides
// wider than K, the large-m packed kernel and the small-m one).
TEST(MatMulNT, EveryPathAndWeightTypeBitwiseEqualToPortable) {
  std::mt19937 rng(5);
  const std::vector<KernelIsa> isas = {KernelIsa::kAvx2, KernelIsa::kAvx512};
  int tested = 0;
  for (KernelIsa isa : isas) {
    if (!KernelIsaSupported(isa)) continue;
    ++tested;
    for (WeightType wt : {WeightType::kF32, WeightType::kBf16, WeightType::kF16}) {
      // k 1037 and 2100: the packed kernel splits K into 2 and 3 blocks; m 130 at k 2100:
      // several row blocks (large k: fewer m and n, to keep the sanitizer build quick).
      for (int k : {1, 7, 8, 13, 64, 67, 200, 1037, 2100}) {
        const bool big_k = k > 1000;
        for (int m : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 40, 130}) {
          if ((m == 130 && k != 2100) || (big_k && m != 1 && m != 9 && m != 17 && m != 130)) {
            continue;
          }
          for (int n : {1, 3, 8, 9, 17}) {
            if (big_k && n != 3 && n != 9) continue;
            const int ldx = k + 3, ldw = k + 5, ldy = n + 2;
            auto x = RandomVec(static_cast<size_t>(m) * ldx, rng);
            auto wf = RandomVec(static_cast<size_t>(n) * ldw, rng);
            std::vector<uint16_t> wh(wf.size());
            for (size_t i = 0; i < wf.size(); ++i) {
              wh[i] = wt == WeightType::kBf16 ? FloatToBf16(wf[i]) : FloatToFp16(wf[i]);
            }
            const WeightPtr w =
                wt == WeightType::kF32 ? WeightPtr{wf.data(), wt} : WeightPtr{wh.data(), wt};
            std::vector<float> a(static_cast<size_t>(m) * ldy, -7.0f), b(a);
            MatMulNTWith(isa, x.data(), m, ldx, w, n, ldw, k, a.data(), ldy);
            MatMulNTWith(KernelIsa::kPortable, x.data(), m, ldx, w, n, ldw, k, b.data(), ldy);
            ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4))
                << KernelIsaName(isa) << " " << WeightTypeName(wt) << " m" << m << " n" << n << " k"
                << k;
          }
        }
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << "this CPU has neither AVX2+FMA+F16C nor AVX-512";
}

// Narrow weights are widened exactly: bf16/fp16 weights give the same bits as their fp32
// widening.
TEST(MatMulNT, NarrowWeightsEqualTheirFp32Widening) {
  std::mt19937 rng(9);
  const int m = 19, n = 13, k = 75;
  auto x = RandomVec(static_cast<size_t>(m) * k, rng);
  auto wf = RandomVec(static_cast<size_t>(n) * k, rng);
  for (WeightType wt : {WeightType::kBf16, WeightType::kF16}) {
    std::vector<uint16_t> wh(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) {
      wh[i] = wt == WeightType::kBf16 ? FloatToBf16(wf[i]) : FloatToFp16(wf[i]);
    }
    std::vector<float> widened(wf.size());
    WidenWeights(WeightPtr{wh.data(), wt}, static_cast<int64_t>(wh.size()), widened.data());
    for (size_t i = 0; i < wh.size(); ++i) {
      ASSERT_EQ(widened[i], wt == WeightType::kBf16 ? Bf16ToFloat(wh[i]) : Fp16ToFloat(wh[i]));
    }
    std::vector<float> a(static_cast<size_t>(m) * n), b(a.size());
    MatMulNT(x.data(), m, k, WeightPtr{wh.data(), wt}, n, k, k, a.data(), n);
    MatMulNT(x.data(), m, k, widened.data(), n, k, k, b.data(), n);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << WeightTypeName(wt);
  }
}

// The vector exp is model_internal::Exp bitwise: a dense sweep of [-110, 95] (every special
// branch: underflow to 0, the two-step subnormal range, the k = 128 overflow step, inf) plus
// +-inf and NaN.
TEST(ElementwiseKernels, ExpArrayBitwiseEqualToExp) {
  std::vector<float> x;
  for (float v = -110.0f; v < 95.0f; v += 0.0037f) x.push_back(v);
  for (float v :
       {0.0f, -0.0f, 88.72283935546875f, 88.7228f, -103.972084045410156f, -87.3f, -87.4f, -100.5f,
        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN(), 1e-30f, -1e-30f}) {
    x.push_back(v);
  }
  for (KernelIsa isa : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!KernelIsaSupported(isa)) continue;
    std::vector<float> y(x.size());
    ExpArrayWith(isa, x.data(), static_cast<int>(x.size()), y.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = Exp(x[i]);
      ASSERT_EQ(0, std::memcmp(&y[i], &want, 4))
          << KernelIsaName(isa) << " x=" << x[i] << " got " << y[i] << " want " << want;
    }
  }
}

TEST(ElementwiseKernels, SiluMulAndOnlineSoftmaxBitwiseEqualToPortable) {
  std::mt19937 rng(21);
  for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!KernelIsaSupported(isa)) continue;
    for (int n : {1, 7, 8, 37, 1000}) {
      auto g = RandomVec(n, rng), up = RandomVec(n, rng);
      for (auto& v : g) v *= 30.0f;
      auto a = g, b = g;
      SiluMulWith(isa, a.data(), up.data(), n);
      SiluMulWith(KernelIsa::kPortable, b.data(), up.data(), n);
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), n * 4)) << KernelIsaName(isa) << " n" << n;
    }
    for (int hd : {16, 64, 67}) {
      for (int n : {1, 5, 16}) {
        auto v = RandomVec(static_cast<size_t>(n) * hd, rng);
        auto s0 = RandomVec(n, rng);
        for (auto& e : s0) e *= 40.0f;
        auto acc0 = RandomVec(hd, rng);
        for (float mx0 : {-std::numeric_limits<float>::infinity(), 3.0f, 90.0f}) {
          auto sa = s0, sb = s0, acca = acc0, accb = acc0;
          float mxa = mx0, mxb = mx0, dena = 2.5f, denb = 2.5f;
          OnlineSoftmaxChunkWith(isa, sa.data(), n, 0.125f, v.data(), hd, &mxa, &dena, acca.data());
          OnlineSoftmaxChunkWith(KernelIsa::kPortable, sb.data(), n, 0.125f, v.data(), hd, &mxb,
                                 &denb, accb.data());
          ASSERT_EQ(0, std::memcmp(acca.data(), accb.data(), hd * 4)) << hd << " " << n;
          ASSERT_EQ(0, std::memcmp(sa.data(), sb.data(), n * 4));
          ASSERT_EQ(0, std::memcmp(&mxa, &mxb, 4));
          ASSERT_EQ(0, std::memcmp(&dena, &denb, 4));
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvbridge::model_internal
