// The experts data plane's frames (tandem/rpc/expert_wire.py describes the format and keeps the
// pure-Python reference) read and written in native code, without the GIL.
//
// A split replica makes one round trip per MoE layer per step. In Python, packing and parsing a
// frame costs a few hundred microseconds on a small VM (every op runs cold after the layer's
// weight stream); here it is a sendmsg and a few recvs into the tensors' own memory.
//
// Waiting for the peer can spin: each side polls the socket for up to `spin_us` before sleeping
// in poll(2). A sleeping vCPU is slow to wake: on the development VM a round trip around 1–2 ms
// of work on the other side costs 75–120 µs more than the work when both sides sleep, 35–50 µs
// when they poll (benchmarks/wakeup_roundtrip.py), and each MoE layer makes one. The polling
// thread yields its core at every poll (sched_yield), so where the two processes share cores the
// peer, whose turn it is, still gets them; and the waiting process's OpenMP workers are parked in
// the same wait rather than left spinning in the OpenMP runtime (wait_readable_parked). It is
// off unless asked for: polling is CPU time, counted against a container's CPU limit.
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the frames are little-endian, as this host must be");

namespace tandem {
namespace {

namespace py = pybind11;

struct Closed : std::runtime_error {  // the peer closed the connection (Python: ConnectionError)
  using std::runtime_error::runtime_error;
};
struct TimedOut : std::runtime_error {  // the socket's timeout passed (Python: TimeoutError)
  using std::runtime_error::runtime_error;
};
struct BadFrame : std::runtime_error {  // a frame that does not parse (Python: expert_wire.WireError)
  using std::runtime_error::runtime_error;
};
struct SocketError : std::runtime_error {  // any other failed socket call (Python: OSError)
  using std::runtime_error::runtime_error;
};
struct Refused : std::runtime_error {  // the peer answered with an error status (Python: wire.Refused(status, message))
  Refused(uint32_t status, const std::string& message) : std::runtime_error(message), status(status) {}
  uint32_t status;
};

#pragma pack(push, 1)
struct RequestHeader {  // expert_wire.REQUEST: "<4sIIIII"
  char magic[4];
  uint32_t dtype, layer, tokens, hidden, top_k;
};
struct ResponseHeader {  // expert_wire.RESPONSE: "<4sII"
  char magic[4];
  uint32_t status, bytes;
};
#pragma pack(pop)
static_assert(sizeof(RequestHeader) == 24 && sizeof(ResponseHeader) == 12, "frame headers are packed");

constexpr char kRequestMagic[4] = {'T', 'X', 'F', '1'};
constexpr char kResponseMagic[4] = {'T', 'X', 'R', '1'};
constexpr uint32_t kOk = 0, kInternal = 3;  // expert_wire.OK, INTERNAL
constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 30;  // expert_wire.MAX_FRAME_BYTES
constexpr uint32_t kMaxFrameTokens = uint32_t{1} << 16;  // expert_wire.MAX_FRAME_TOKENS

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_errno(const char* what) {
  const int err = errno;
  if (err == EPIPE || err == ECONNRESET) throw Closed(std::string(what) + ": " + std::strerror(err));
  throw SocketError(std::string(what) + ": " + std::strerror(err));
}

// Sleeps in poll(2) until fd is ready for `events`, for up to timeout_ms (-1: no limit).
void poll_for(int fd, short events, int64_t timeout_ms) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = poll(&p, 1, static_cast<int>(timeout_ms));
    if (r > 0) return;
    if (r == 0) throw TimedOut("timed out");
    if (errno != EINTR) throw_errno("poll");
  }
}

// Returns once fd has data (or EOF) to read: polling without sleeping (yielding the core between
// polls) for up to spin_us, then sleeping in poll(2).
// With sleep false, returns false instead once the spin ends without data.
bool wait_readable(int fd, int64_t spin_us, int64_t timeout_ms, bool sleep = true) {
  const auto until = Clock::now() + std::chrono::microseconds(spin_us);
  char byte;
  do {
    if (recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) >= 0) return true;  // data, or EOF for the reader to see
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) throw_errno("recv");
    if (spin_us > 0) sched_yield();
  } while (Clock::now() < until);
  if (!sleep) return false;
  poll_for(fd, POLLIN, timeout_ms);
  return true;
}

// wait_readable with this thread's OpenMP workers asleep too. GNU OpenMP's idle workers spin for
// milliseconds after a parallel region (GOMP_SPINCOUNT's 300000 pause loops); a process waiting
// for its peer on shared cores would keep them spinning on the cores the peer computes on. So the
// wait is itself a parallel region: thread 0 waits as wait_readable does, every other thread
// polls a flag for up to spin_us too (yielding its core) and then sleeps in poll(2) on the same
// socket, which wakes them all when the frame comes. Nothing is read inside the region (poll and
// MSG_PEEK only), so a worker still polling when thread 0 is done sees the data and leaves.
// Outside a parallel region and with more than one thread only; otherwise it is wait_readable.
bool wait_readable_parked(int fd, int64_t spin_us, int64_t timeout_ms, bool sleep = true) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) return wait_readable(fd, spin_us, timeout_ms, sleep);
  std::atomic<bool> done{false};
  bool ready = false;
  std::exception_ptr error;
  at::parallel_for(0, threads, 1, [&](int64_t i, int64_t) {
    if (i == 0) {
      try {
        ready = wait_readable(fd, spin_us, timeout_ms, sleep);
      } catch (...) {
        error = std::current_exception();
      }
      done.store(true, std::memory_order_release);
      return;
    }
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    while (spin_us > 0 && !done.load(std::memory_order_acquire) && Clock::now() < until) sched_yield();
    pollfd p{fd, POLLIN, 0};
    // In slices, so that thread 0's timeout or error (no data ever comes) lets this one out too.
    while (!done.load(std::memory_order_acquire) && poll(&p, 1, 50) == 0) {
    }
  });
  if (error) std::rethrow_exception(error);
  return ready;
}

// Exactly n bytes into buf (the socket may be blocking or not: Python sockets with a timeout are
// non-blocking underneath). Closed when the peer closes first.
void read_exact(int fd, void* buf, size_t n, int64_t timeout_ms) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      throw Closed("the peer closed the connection");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_readable(fd, 0, timeout_ms);
    } else if (errno != EINTR) {
      throw_errno("recv");
    }
  }
}

// Every byte of the iovecs, in order.
void write_all(int fd, iovec* iov, int count, int64_t timeout_ms) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t k = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        poll_for(fd, POLLOUT, timeout_ms);
        continue;
      }
      if (errno == EINTR) continue;
      throw_errno("sendmsg");
    }
    while (count > 0 && static_cast<size_t>(k) >= iov->iov_len) {
      k -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + k;
      iov->iov_len -= static_cast<size_t>(k);
    }
  }
}

at::ScalarType dtype_of(uint32_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    default: return at::ScalarType::Undefined;
  }
}

uint32_t code_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "the data plane carries float32, bfloat16 or float16 hidden states, not ", dtype);
  }
}

iovec bytes_of(const at::Tensor& t) {
  return {t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size()};
}

std::string magic_repr(const char* magic) {  // as Python prints bytes, for the error message
  std::string out = "b'";
  for (int i = 0; i < 4; ++i) {
    const unsigned char c = static_cast<unsigned char>(magic[i]);
    if (c >= 32 && c < 127 && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out + "'";
}

// The contiguous tensors of a request; the caller (expert_wire.send_request) has checked shapes and dtypes.
void send_request(int fd, int64_t layer, const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                  int64_t timeout_ms) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && ids.is_contiguous() && weights.is_contiguous() &&
                  ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.dim() == 2 &&
                  ids.sizes() == weights.sizes() && ids.size(0) == hidden.size(0),
              "send_request: hidden [T, H], ids [T, k] int64 and weights [T, k] f32, contiguous");
  const RequestHeader header{{kRequestMagic[0], kRequestMagic[1], kRequestMagic[2], kRequestMagic[3]},
                             code_of(hidden.scalar_type()), static_cast<uint32_t>(layer),
                             static_cast<uint32_t>(hidden.size(0)), static_cast<uint32_t>(hidden.size(1)),
                             static_cast<uint32_t>(ids.size(1))};
  iovec iov[4] = {{const_cast<RequestHeader*>(&header), sizeof header}, bytes_of(hidden), bytes_of(ids),
                  bytes_of(weights)};
  write_all(fd, iov, 4, timeout_ms);
}

// (layer, hidden [T, H], ids [T, k] int64, weights [T, k] f32) of the next request. It waits for
// the frame to start for as long as it takes (a server's connection idles between steps); once it
// has, each read of the rest must make progress within timeout_ms (a peer stalled mid-frame).
std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor> recv_request(int fd, int64_t spin_us, int64_t timeout_ms) {
  wait_readable_parked(fd, spin_us, /*timeout_ms=*/-1);
  RequestHeader h;
  read_exact(fd, &h, sizeof h, timeout_ms);
  const at::ScalarType dtype = dtype_of(h.dtype);
  if (std::memcmp(h.magic, kRequestMagic, 4) != 0 || dtype == at::ScalarType::Undefined)
    throw BadFrame("not an expert-forward frame (magic " + magic_repr(h.magic) + ", dtype code " +
                   std::to_string(h.dtype) + ")");
  if (h.tokens > kMaxFrameTokens)
    throw BadFrame("a frame of " + std::to_string(h.tokens) + " tokens, more than " +
                   std::to_string(kMaxFrameTokens));
  const uint64_t itemsize = c10::elementSize(dtype);
  if (uint64_t{h.tokens} * (uint64_t{h.hidden} * itemsize + uint64_t{h.top_k} * 12) > kMaxFrameBytes)
    throw BadFrame("a frame of " + std::to_string(h.tokens) + " tokens x " + std::to_string(h.hidden) +
                   " is larger than " + std::to_string(kMaxFrameBytes) + " bytes");
  const int64_t T = h.tokens, H = h.hidden, k = h.top_k;
  at::Tensor hidden = at::empty({T, H}, at::TensorOptions().dtype(dtype));
  at::Tensor ids = at::empty({T, k}, at::TensorOptions().dtype(at::kLong));
  at::Tensor weights = at::empty({T, k}, at::TensorOptions().dtype(at::kFloat));
  for (const at::Tensor* t : {&hidden, &ids, &weights}) {
    const iovec b = bytes_of(*t);
    read_exact(fd, b.iov_base, b.iov_len, timeout_ms);
  }
  return {static_cast<int64_t>(h.layer), hidden, ids, weights};
}

void send_response(int fd, int64_t status, const at::Tensor& output, const std::string& message, int64_t timeout_ms) {
  ResponseHeader header{{kResponseMagic[0], kResponseMagic[1], kResponseMagic[2], kResponseMagic[3]},
                        static_cast<uint32_t>(status), 0};
  iovec iov[2] = {{&header, sizeof header}, {}};
  if (status == kOk) {
    TORCH_CHECK(output.is_contiguous(), "send_response: the output must be contiguous");
    iov[1] = bytes_of(output);
  } else {
    iov[1] = {const_cast<char*>(message.data()), message.size()};
  }
  header.bytes = static_cast<uint32_t>(iov[1].iov_len);
  write_all(fd, iov, 2, timeout_ms);
}

// The next response: OK with the output read into `out` (its dtype and shape are what the
// request sent), or the error status and its message.
std::pair<uint32_t, std::string> recv_response_into(int fd, at::Tensor& out, int64_t spin_us, int64_t timeout_ms) {
  wait_readable_parked(fd, spin_us, timeout_ms);
  ResponseHeader h;
  read_exact(fd, &h, sizeof h, timeout_ms);
  if (std::memcmp(h.magic, kResponseMagic, 4) != 0 || h.bytes > kMaxFrameBytes)
    throw BadFrame("not an expert-forward response (magic " + magic_repr(h.magic) + ")");
  if (h.status != kOk) {
    std::string message(h.bytes, '\0');
    read_exact(fd, message.data(), message.size(), timeout_ms);
    return {h.status, message};
  }
  const uint64_t expected = static_cast<uint64_t>(out.numel()) * out.element_size();
  if (h.bytes != expected)
    throw BadFrame("response of " + std::to_string(h.bytes) + " bytes, expected " + std::to_string(expected) +
                   " for [" +
                   std::to_string(out.size(0)) + ", " + std::to_string(out.size(1)) + "] " +
                   c10::toString(out.scalar_type()));
  read_exact(fd, out.data_ptr(), expected, timeout_ms);
  return {kOk, std::string()};
}

// (status, output [T, H] of dtype when OK, the error message's bytes otherwise).
std::tuple<int64_t, at::Tensor, std::string> recv_response(int fd, at::ScalarType dtype, int64_t tokens, int64_t size,
                                                            int64_t spin_us, int64_t timeout_ms) {
  TORCH_CHECK(dtype != at::ScalarType::Undefined, "recv_response: dtype code must be 0 (f32), 1 (bf16) or 2 (f16)");
  at::Tensor out = at::empty({tokens, size}, at::TensorOptions().dtype(dtype));
  auto [status, message] = recv_response_into(fd, out, spin_us, timeout_ms);
  if (status != kOk) return {status, at::Tensor(), message};
  return {kOk, out, std::string()};
}

// The experts process's end of the data plane for the native executor: a decode-sized float32
// frame for a layer it holds, with every expert id in range, is read, computed (moe_forward) and
// answered here without Python. Any other frame (another dtype, a prefill-sized batch, anything
// that fails a check) goes back to Python, which runs the checked path and says what is wrong.
// `lock`/`unlock` let the Python path share the one lock around expert compute.
class ExpertServer {
 public:
  ExpertServer(int64_t hidden, int64_t max_tokens) : hidden_(hidden), max_tokens_(max_tokens) {}

  void add_layer(int64_t layer, int64_t kind, int64_t group, at::Tensor gu, at::Tensor gu_scale, at::Tensor gu_min,
                 at::Tensor dn, at::Tensor dn_scale, at::Tensor dn_min) {
    TORCH_CHECK(gu.dim() == 3 && dn.dim() == 3 && gu.size(0) == dn.size(0) && dn.size(1) == hidden_,
                "ExpertServer: experts must be gate_up [E, 2I, *] and down [E, hidden, *]");
    layers_[layer] = {kind, group, gu, gu_scale, gu_min, dn, dn_scale, dn_min};
  }

  void lock() { mutex_.lock(); }
  void unlock() { mutex_.unlock(); }

  // Reads frames and answers them until one is not for this end, the kernel fails, or the frames
  // stop: returns (status, (seconds of compute, tokens) of each frame served, ...): (0, frames, layer,
  // hidden, ids, weights) for a frame Python must answer, (2, frames, message) when the kernel
  // failed (answered INTERNAL), (1, frames) otherwise. Frames served back to back stay in here:
  // returning to Python between them would run the interpreter (and leave the OpenMP workers
  // spinning) on the cores the peer needs next. So that the caller's metrics stay current, it
  // returns once no next frame comes within spin_us of an answer, or flush_s after its first.
  py::tuple serve(int fd, int64_t spin_us, int64_t timeout_ms, double flush_s) {
    std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor> request;
    std::vector<std::pair<double, int64_t>> seconds;  // each frame's compute seconds and tokens
    std::string error;
    const Layer* layer = nullptr;
    {
      py::gil_scoped_release nogil;
      Clock::time_point first;  // when the first frame was answered
      for (;;) {
        if (!seconds.empty() && (std::chrono::duration<double>(Clock::now() - first).count() >= flush_s ||
                                 !wait_readable_parked(fd, spin_us, timeout_ms, /*sleep=*/false)))
          break;
        try {
          request = recv_request(fd, spin_us, timeout_ms);
        } catch (const Closed&) {
          if (seconds.empty()) throw;
          break;  // the served frames' seconds first; the next call finds the connection closed
        }
        auto& [index, hidden, ids, weights] = request;
        layer = servable(index, hidden, ids);
        if (layer == nullptr) break;
        error = answer(fd, *layer, hidden, ids, weights, timeout_ms, seconds);
        if (seconds.size() == 1) first = Clock::now();
        if (!error.empty()) break;
      }
    }
    py::list done = py::cast(seconds);
    if (!error.empty()) return py::make_tuple(2, done, error);
    if (layer == nullptr) {
      auto& [index, hidden, ids, weights] = request;
      return py::make_tuple(0, done, index, hidden, ids, weights);
    }
    return py::make_tuple(1, done);
  }

  int64_t served() const { return served_.load(); }

 private:
  struct Layer {
    int64_t kind, group;
    at::Tensor gu, gu_scale, gu_min, dn, dn_scale, dn_min;
  };

  // Computes and answers one frame; appends its compute seconds and tokens. Returns the kernel's error ("": none).
  std::string answer(int fd, const Layer& layer, const at::Tensor& hidden, const at::Tensor& ids,
                     const at::Tensor& weights, int64_t timeout_ms,
                     std::vector<std::pair<double, int64_t>>& seconds) {
    at::Tensor out = at::empty_like(hidden);
    std::string error;
    {
      std::lock_guard<std::mutex> hold(mutex_);
      const int64_t need = ids.numel() * (layer.gu.size(1) / 2);
      if (!scratch_.defined() || scratch_.numel() < need) scratch_ = at::empty({need}, hidden.options());
      const auto start = Clock::now();
      try {
        moe_forward(hidden, ids, weights, layer.kind, layer.group, layer.gu, layer.gu_scale, layer.gu_min, layer.dn,
                    layer.dn_scale, layer.dn_min, out, scratch_);
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      } catch (const std::exception& e) {
        error = e.what();
      }
      seconds.emplace_back(std::chrono::duration<double>(Clock::now() - start).count(), hidden.size(0));
    }
    ++served_;  // before the answer: the peer may look as soon as it has it
    if (error.empty())
      send_response(fd, kOk, out, std::string(), timeout_ms);
    else
      send_response(fd, kInternal, at::Tensor(), "native expert forward: " + error, timeout_ms);
    return error;
  }

  const Layer* servable(int64_t index, const at::Tensor& hidden, const at::Tensor& ids) const {
    const auto it = layers_.find(index);
    if (it == layers_.end() || hidden.scalar_type() != at::kFloat || hidden.size(1) != hidden_ ||
        hidden.size(0) == 0 || hidden.size(0) > max_tokens_)
      return nullptr;
    const int64_t experts = it->second.gu.size(0);
    if (ids.size(1) > experts) return nullptr;  // more experts a token than there are: Python refuses it
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0, n = ids.numel(); i < n; ++i)
      if (id[i] < 0 || id[i] >= experts) return nullptr;
    return &it->second;
  }

  const int64_t hidden_, max_tokens_;
  std::unordered_map<int64_t, Layer> layers_;
  std::mutex mutex_;
  at::Tensor scratch_;
  std::atomic<int64_t> served_{0};
};

PyObject* refused_type = nullptr;  // wire.Refused, made by bind_data_plane

}  // namespace

void remote_experts(int fd, int64_t layer, const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                    at::Tensor& out, int64_t spin_us, int64_t timeout_ms) {
  TORCH_CHECK(out.sizes() == hidden.sizes() && out.scalar_type() == hidden.scalar_type() && out.is_contiguous(),
              "remote_experts: out must be contiguous and of hidden's shape and dtype");
  send_request(fd, layer, hidden, ids, weights, timeout_ms);
  auto [status, message] = recv_response_into(fd, out, spin_us, timeout_ms);
  if (status != kOk) throw Refused(status, message);
}

void bind_data_plane(py::module& m) {
  py::module w = m.def_submodule("wire", "the experts data plane's frames (tandem.rpc.expert_wire), without the GIL");
  py::register_exception<Closed>(w, "Closed", PyExc_ConnectionError);
  py::register_exception<TimedOut>(w, "TimedOut", PyExc_TimeoutError);
  py::register_exception<BadFrame>(w, "BadFrame", PyExc_RuntimeError);
  py::register_exception<SocketError>(w, "SocketError", PyExc_OSError);
  // Refused carries the status: args (status, message). The class lives as long as the module.
  refused_type = py::exception<Refused>(w, "Refused", PyExc_RuntimeError).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Refused& e) {
      PyErr_SetObject(refused_type,
                      py::make_tuple(e.status, py::bytes(e.what()).attr("decode")("utf-8", "replace")).ptr());
    }
  });
  using nogil = py::call_guard<py::gil_scoped_release>;
  w.def("send_request", &send_request, py::arg("fd"), py::arg("layer"), py::arg("hidden"), py::arg("ids"),
        py::arg("weights"), py::arg("timeout_ms"), nogil());
  w.def("recv_request", &recv_request, py::arg("fd"), py::arg("spin_us"), py::arg("timeout_ms"), nogil());
  w.def("send_response", &send_response, py::arg("fd"), py::arg("status"), py::arg("output"), py::arg("message"),
        py::arg("timeout_ms"), nogil());
  w.def(
      "recv_response",
      [](int fd, uint32_t dtype_code, int64_t tokens, int64_t size, int64_t spin_us, int64_t timeout_ms) -> py::tuple {
        std::tuple<int64_t, at::Tensor, std::string> r;
        {
          py::gil_scoped_release nogil;
          r = recv_response(fd, dtype_of(dtype_code), tokens, size, spin_us, timeout_ms);
        }
        auto& [status, out, message] = r;
        if (status == kOk) return py::make_tuple(status, out);
        return py::make_tuple(status, py::bytes(message).attr("decode")("utf-8", "replace"));
      },
      py::arg("fd"), py::arg("dtype_code"), py::arg("tokens"), py::arg("size"), py::arg("spin_us"),
      py::arg("timeout_ms"));
  py::class_<ExpertServer>(w, "ExpertServer", "the experts end of the data plane for the native executor")
      .def(py::init<int64_t, int64_t>(), py::arg("hidden"), py::arg("max_tokens"))
      .def("add_layer", &ExpertServer::add_layer, py::arg("layer"), py::arg("kind"), py::arg("group"),
           py::arg("gate_up"), py::arg("gate_up_scale"), py::arg("gate_up_min"), py::arg("down"),
           py::arg("down_scale"), py::arg("down_min"))
      .def("lock", &ExpertServer::lock, nogil())
      .def("unlock", &ExpertServer::unlock)
      .def("serve", &ExpertServer::serve, py::arg("fd"), py::arg("spin_us"), py::arg("timeout_ms"),
           py::arg("flush_s"))
      .def_property_readonly("served", &ExpertServer::served);
}

}  // namespace tandem
