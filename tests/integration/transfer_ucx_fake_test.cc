// The ucx backend's cluster-token handshake against strangers that speak raw UCP (issue 22): a
// fake client that answers the challenge with garbage, a wrong proof, nothing at all, or never,
// is refused and gets no rkey, and its reverse endpoint is released (not kept until shutdown); a
// fake server at the worker address the metadata names that proves a wrong token or reflects the
// client's own proof is refused by AddPeer before any rkey is used. Same active-message framing as
// ucx_backend.cc: AM 10 hello (header = agent name, data = worker address), AM 12 control (first
// data byte 1 challenge, 2 answer, 3 accept, 4 refuse).
#include <gtest/gtest.h>

#if __has_include(<ucp/api/ucp.h>)
#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/transfer/agent.h"
#include "kvbridge/transfer/memory.h"
#include "transfer/auth.h"

namespace kvbridge::transfer {
namespace {

constexpr unsigned kAmHello = 10, kAmControl = 12;
constexpr char kChallenge = 1, kAnswer = 2, kAccept = 3, kRefuse = 4;
constexpr const char* kToken = "ucx-s3cret";

std::string Hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (unsigned char c : s) {
    h.push_back(d[c >> 4]);
    h.push_back(d[c & 15]);
  }
  return h;
}

std::string Unhex(std::string_view h) {
  std::string s;
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    s.push_back(static_cast<char>(v(h[i]) * 16 + v(h[i + 1])));
  return s;
}

// A bare UCP worker with the backend's AM ids: what a stranger can do with UCX alone.
class FakeUcp {
 public:
  struct Am {
    unsigned id;
    std::string name, data;
    ucp_ep_h from;
  };

  FakeUcp() {
    ucp_config_t* cfg = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &cfg), UCS_OK);
    if (!std::getenv("UCX_TLS")) ucp_config_modify(cfg, "TLS", "sm,self,tcp");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
    EXPECT_EQ(ucp_init(&p, cfg, &ctx_), UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(ctx_, &wp, &worker_), UCS_OK);
    for (unsigned id : {kAmHello, 11u, kAmControl}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = id == kAmHello ? &OnAm<kAmHello> : id == 11u ? &OnAm<11u> : &OnAm<kAmControl>;
      hp.arg = this;
      EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    }
    ucp_address_t* a = nullptr;
    size_t len = 0;
    EXPECT_EQ(ucp_worker_get_address(worker_, &a, &len), UCS_OK);
    address_.assign(reinterpret_cast<char*>(a), len);
    ucp_worker_release_address(worker_, a);
  }

  ~FakeUcp() {
    Progress(200);  // let the last messages and wireups finish before closing
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t rp{};
      ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
      if (UCS_PTR_IS_PTR(r)) {
        for (int i = 0; i < 100000 && ucp_request_check_status(r) == UCS_INPROGRESS; ++i) {
          ucp_worker_progress(worker_);
        }
        ucp_request_free(r);
      }
    }
    ucp_worker_destroy(worker_);
    ucp_cleanup(ctx_);
  }

  const std::string& address() const { return address_; }

  ucp_ep_h Connect(const std::string& addr) {
    ucp_ep_params_t ep{};
    // Peer error handling as the backend's endpoints (UCX refuses asymmetric configurations).
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
    ep.err_handler.arg = nullptr;
    ucp_ep_h h = nullptr;
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &h), UCS_OK);
    eps_.push_back(h);
    return h;
  }

  // One AM with the sender's name as header (the backend's framing), sent to completion.
  void Send(ucp_ep_h ep, unsigned id, const std::string& name, const std::string& data) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, id, name.data(), name.size(), data.data(), data.size(), &rp);
    if (UCS_PTR_IS_PTR(r)) {
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (ucp_request_check_status(r) == UCS_INPROGRESS &&
             std::chrono::steady_clock::now() < end) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(r);
    }
  }

  // Progresses until an AM with data byte `ctl` (control) or of id `id` (ctl < 0) arrives or
  // `ms` pass; nullopt on timeout. Every AM seen stays in got().
  std::optional<Am> WaitFor(unsigned id, int ctl, int ms) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    size_t seen = 0;
    while (std::chrono::steady_clock::now() < end) {
      ucp_worker_progress(worker_);
      for (; seen < got_.size(); ++seen) {
        const Am& a = got_[seen];
        if (a.id == id && (ctl < 0 || (!a.data.empty() && a.data[0] == ctl))) return a;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return std::nullopt;
  }
  void Progress(int ms) { WaitFor(999, -1, ms); }
  const std::deque<Am>& got() const { return got_; }

 private:
  template <unsigned Id>
  static ucs_status_t OnAm(void* arg, const void* header, size_t hlen, void* data, size_t len,
                           const ucp_am_recv_param_t* param) {
    auto* f = static_cast<FakeUcp*>(arg);
    f->got_.push_back(
        {Id, std::string(static_cast<const char*>(header), hlen),
         std::string(static_cast<const char*>(data), len),
         (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr});
    return UCS_OK;
  }

  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::vector<ucp_ep_h> eps_;
  std::deque<Am> got_;
};

PagedKvLayout Layout() {
  PagedKvLayout l;
  l.num_layers = 2;
  l.num_blocks = 8;
  l.block_size = 4;
  l.num_kv_heads = 2;
  l.head_dim = 8;
  l.dtype = KvDtype::kFp32;
  return l;
}

struct Agent {
  HostBuffer buf;
  std::unique_ptr<TransferAgent> agent;
};

Agent MakeAgent(const std::string& name, const std::string& token) {
  AgentConfig c;
  c.name = name;
  c.backends = {"ucx"};
  c.force_backend = "ucx";
  c.model_fingerprint = "model-A";
  c.peer_timeout_ms = 2000;
  c.reply_timeout_ms = 2000;
  c.cluster_token = token;
  Agent a;
  a.buf = HostBuffer::Allocate(Layout().LayerBytes() * Layout().num_layers).value();
  std::memset(a.buf.data(), 0x5a, a.buf.size());
  a.agent = TransferAgent::Create(c).value();
  EXPECT_TRUE(a.agent->RegisterMemory(KvRegistration::FromHostBuffer(Layout(), a.buf)).ok());
  return a;
}

bool HasUcx() {
  auto b = AvailableBackends();
  return std::find(b.begin(), b.end(), "ucx") != b.end();
}

// The worker address in a ucx metadata blob ("incarnation:hexaddr;rkey,size;...").
std::string BlobAddress(const std::string& blob) {
  const size_t colon = blob.find(':'), semi = blob.find(';');
  return Unhex(blob.substr(colon + 1, semi - colon - 1));
}

template <typename Pred>
bool Eventually(Pred p, int ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!p() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return p();
}

TEST(UcxFakePeers, StrangersAnswersAreRefusedGetNoRkeysAndAreReleased) {
  if (!HasUcx()) GTEST_SKIP() << "ucx is not built in";
  Agent server = MakeAgent("b", kToken);
  const std::string addr = BlobAddress(server.agent->Metadata().value().backend_blobs.at("ucx"));
  // What the stranger answers to the challenge (nonce in hand).
  const std::vector<std::pair<std::string, std::function<std::string(const std::string&)>>> cases =
      {
          {"garbage", [](const std::string&) { return std::string("\x02garbage", 8); }},
          {"no token", [](const std::string&) { return std::string(1, kAnswer); }},
          {"wrong token",
           [](const std::string& nonce) {
             return std::string(1, kAnswer) +
                    auth::Proof("guess", auth::HandshakeContext("ucx", 0, "evil"), nonce) +
                    std::string(auth::kNonceBytes, 'c');
           }},
          {"silence", nullptr},
      };
  int64_t refused = 0;
  for (const auto& [what, answer] : cases) {
    FakeUcp fake;
    ucp_ep_h ep = fake.Connect(addr);
    fake.Send(ep, kAmHello, "evil", fake.address());
    auto challenge = fake.WaitFor(kAmControl, kChallenge, 5000);
    ASSERT_TRUE(challenge) << what << ": no challenge";
    ASSERT_EQ(challenge->data.size(), 1 + auth::kNonceBytes) << what;
    if (answer) fake.Send(ep, kAmControl, "evil", answer(challenge->data.substr(1)));
    auto refusal = fake.WaitFor(kAmControl, kRefuse, 5000);  // "silence": after peer_timeout_ms
    ASSERT_TRUE(refusal) << what << ": not refused";
    for (const auto& a : fake.got()) {
      EXPECT_FALSE(a.id == kAmControl && !a.data.empty() && a.data[0] == kAccept)
          << what << ": the stranger got an accept (the rkey table)";
    }
    ++refused;
    EXPECT_EQ(server.agent->HandshakeRefusalCounts().peers, refused) << what;
    // The refused reverse endpoint is closed and forgotten about a second later.
    EXPECT_TRUE(Eventually(
        [&] { return server.agent->HandshakeRefusalCounts().released == refused; }, 5000))
        << what << ": released " << server.agent->HandshakeRefusalCounts().released;
  }
  // A real client with the token still connects and reads.
  Agent client = MakeAgent("a", kToken);
  ASSERT_TRUE(client.agent->AddPeer(server.agent->Metadata().value()).ok());
  auto prepared = client.agent->Prepare({TransferOp::kRead, "b", {{1, 2}}});
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
  auto h = client.agent->Post(*prepared, {});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->Wait(10000));
  EXPECT_EQ(h->state(), TransferState::kDone) << h->status().ToString();
}

TEST(UcxFakePeers, AFakeServerThatCannotProveTheTokenIsRefused) {
  if (!HasUcx()) GTEST_SKIP() << "ucx is not built in";
  // The metadata of a real token-holding agent (rkeys withheld), its worker address swapped for
  // the fake's: the fake sits where the client will connect.
  Agent real = MakeAgent("b", kToken);
  Agent client = MakeAgent("a", kToken);
  for (const std::string mode : {"wrong proof", "reflected proof"}) {
    FakeUcp fake;
    AgentMetadata meta = real.agent->Metadata().value();
    std::string& blob = meta.backend_blobs.at("ucx");
    const size_t colon = blob.find(':'), semi = blob.find(';');
    blob = blob.substr(0, colon + 1) + Hex(fake.address()) + blob.substr(semi);
    Result<std::string> added = UnavailableError("not run");
    std::thread adder([&] { added = client.agent->AddPeer(meta); });
    auto hello = fake.WaitFor(kAmHello, -1, 5000);
    ASSERT_TRUE(hello) << mode;
    ucp_ep_h back = fake.Connect(hello->data);
    fake.Send(back, kAmControl, "b",
              std::string(1, kChallenge) + std::string(auth::kNonceBytes, 'n'));
    auto ans = fake.WaitFor(kAmControl, kAnswer, 5000);
    ASSERT_TRUE(ans) << mode;
    ASSERT_EQ(ans->data.size(), 1 + auth::kProofBytes + auth::kNonceBytes) << mode;
    const std::string client_proof = ans->data.substr(1, auth::kProofBytes);
    const std::string client_nonce = ans->data.substr(1 + auth::kProofBytes);
    const std::string proof =
        mode == "wrong proof"
            ? auth::Proof("another-token", auth::ServerContext("ucx", meta.incarnation, "a"),
                          client_nonce)
            : client_proof;
    // The accept with a made-up rkey table: the client must check the proof before using it.
    fake.Send(back, kAmControl, "b", std::string(1, kAccept) + proof + "00,1;00,1");
    adder.join();
    ASSERT_FALSE(added.ok()) << mode << ": a fake server was accepted";
    EXPECT_EQ(added.status().code(), StatusCode::kUnauthenticated) << added.status().ToString();
    EXPECT_NE(added.status().message().find("proof of the cluster token is wrong"),
              std::string::npos)
        << added.status().ToString();
    EXPECT_FALSE(client.agent->Prepare({TransferOp::kRead, "b", {{1, 2}}}).ok()) << mode;
  }
  EXPECT_EQ(client.agent->HandshakeRefusalCounts().servers, 2);
}

}  // namespace
}  // namespace kvbridge::transfer

#endif  // __has_include(<ucp/api/ucp.h>)
