// The proxy's connection type (internal to src/proxy): a TCP socket, plain or under TLS.
//
// The proxy's client connections and its legs to engines are either plain HTTP or HTTPS
// (`kvbridge proxy --ssl-certfile/--ssl-keyfile` for its own port; an `https://` engine URL for
// a leg). Stream is one type for both, so the session, leg and pool code is written once: it is
// an Asio AsyncReadStream / AsyncWriteStream (Beast's reads and writes take it) whose
// lowest_layer() is the TCP socket (cancels close it, the idle and client-disconnect watches
// peek on it). A plain Stream adds one branch per operation to the plain path; a TLS one is an
// asio::ssl::stream, kept behind a pointer so that moving a Stream (the pool keeps them in
// vectors) never moves the SSL engine.
//
//   Stream plain(std::move(socket));
//   Stream tls(std::move(socket), client_ctx);  // then co_await tls.tls()->async_handshake(...)
//
// Thread-safety: as the socket's: one operation of each direction at a time, on its executor.
#pragma once

#include <boost/asio/async_result.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/system/error_code.hpp>
#include <memory>
#include <optional>
#include <utility>

namespace kvbridge::proxy {

class Stream {
 public:
  using TlsStream = boost::asio::ssl::stream<boost::asio::ip::tcp::socket>;
  using executor_type = boost::asio::ip::tcp::socket::executor_type;
  using lowest_layer_type = boost::asio::ip::tcp::socket;

  explicit Stream(boost::asio::ip::tcp::socket socket) : plain_(std::move(socket)) {}
  /// TLS over `socket` with `context` (which must outlive the stream); handshake not done yet.
  Stream(boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& context)
      : tls_(std::make_unique<TlsStream>(std::move(socket), context)) {}
  Stream(Stream&&) = default;
  Stream& operator=(Stream&&) = default;

  /// The TLS layer, nullptr for a plain stream.
  TlsStream* tls() { return tls_.get(); }
  bool is_tls() const { return tls_ != nullptr; }
  lowest_layer_type& lowest_layer() { return tls_ ? tls_->next_layer() : *plain_; }
  const lowest_layer_type& lowest_layer() const { return tls_ ? tls_->next_layer() : *plain_; }
  executor_type get_executor() { return lowest_layer().get_executor(); }

  template <typename MutableBufferSequence, typename Token>
  auto async_read_some(const MutableBufferSequence& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, std::size_t)>(
        [this](auto handler, const MutableBufferSequence& b) {
          if (tls_) {
            tls_->async_read_some(b, std::move(handler));
          } else {
            plain_->async_read_some(b, std::move(handler));
          }
        },
        token, buffers);
  }

  template <typename ConstBufferSequence, typename Token>
  auto async_write_some(const ConstBufferSequence& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, std::size_t)>(
        [this](auto handler, const ConstBufferSequence& b) {
          if (tls_) {
            tls_->async_write_some(b, std::move(handler));
          } else {
            plain_->async_write_some(b, std::move(handler));
          }
        },
        token, buffers);
  }

 private:
  std::optional<boost::asio::ip::tcp::socket> plain_;  // set for a plain stream
  std::unique_ptr<TlsStream> tls_;                     // set for a TLS stream
};

}  // namespace kvbridge::proxy
