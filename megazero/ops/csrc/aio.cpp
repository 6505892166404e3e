// Asynchronous tensor file I/O: a pool of threads doing pread/pwrite straight on tensors' memory.
//
// A request (one tensor, one file, one offset) is cut into block_size chunks; worker threads take
// chunks from the oldest requests first, at most queue_depth per I/O thread in flight over all
// requests (thread_count x queue_depth). pread/pwrite block, so a queue depth is kept by that
// many workers: with DeepSpeed's defaults (1 thread, depth 8) eight chunks are in flight, as its
// libaio queue has, not one. A request may be submitted `after` another: none of its chunks is
// issued before that one has finished, and if that one failed it is not run at all (it fails
// with ECANCELED, its tensor untouched), e.g. a read of what a write still in flight puts. Submit
// opens the file and queues the chunks, then returns; wait blocks until a request's chunks are all
// done and returns its first error (errno, what failed) instead of throwing, so the Python side
// can raise an OSError that names the path and errno.
//
// O_DIRECT is used where it can be: the tensor's address and the file offset 4096-aligned, and the
// file system accepting open(O_DIRECT). The aligned body of the request then goes direct and the
// tail (nbytes % 4096) through a second, buffered descriptor; everything else (unaligned address
// or offset, EINVAL from open(O_DIRECT), e.g. on some tmpfs) is buffered. A direct chunk that the
// file system still rejects with EINVAL is redone buffered. No system package is needed (no
// libaio, no io_uring): plain POSIX calls on std::threads.
//
// A direct write first grows a shorter file to its end (see extend). single_submit: a request has
// at most one chunk in flight. overlap_events=false: requests run one after the other in
// submission order (the next starts when the previous has finished).
#include "op_headers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kAlign = 4096;  // O_DIRECT alignment of address, offset and length (safe for 512 and 4K sectors)

struct Chunk {
  int64_t pos;  // byte position in the tensor (the file position is offset + pos)
  int64_t len;
  bool direct;
};

struct Request {
  int64_t id = 0;
  bool write = false;
  std::string path;
  char* data = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int direct_fd = -1;
  int buffered_fd = -1;
  bool direct = false;  // whether the body goes through O_DIRECT
  std::vector<Chunk> chunks;
  size_t next = 0;  // next chunk to issue
  size_t done = 0;  // chunks finished (or skipped after an error)
  int in_flight = 0;
  bool blocked = false;               // submitted after a request not finished yet
  std::vector<Request*> dependents;   // requests submitted after this one, waiting for it
  int err = 0;
  std::string what;
  bool finished() const { return done == chunks.size(); }
  void close_files() {
    if (direct_fd >= 0) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
    direct_fd = buffered_fd = -1;
  }
};

std::string describe(const Request& r, const Chunk& c, const char* call, bool direct) {
  return std::string(call) + " of " + std::to_string(c.len) + " bytes at file offset " +
         std::to_string(r.offset + c.pos) + (direct ? " (O_DIRECT)" : " (buffered)");
}

// The whole chunk, looping over short transfers and EINTR; 0 or the errno (ENODATA: end of file
// reached before the chunk was read).
int transfer(int fd, bool write, char* data, int64_t len, int64_t file_offset) {
  int64_t moved = 0;
  while (moved < len) {
    const ssize_t n = write ? ::pwrite(fd, data + moved, static_cast<size_t>(len - moved), file_offset + moved)
                            : ::pread(fd, data + moved, static_cast<size_t>(len - moved), file_offset + moved);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return write ? EIO : ENODATA;
    moved += n;
  }
  return 0;
}

class Handle {
 public:
  Handle(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool single_submit, bool overlap_events)
      : block_size_(block_size), queue_depth_(queue_depth * thread_count), single_submit_(single_submit),
        overlap_events_(overlap_events) {
    TORCH_CHECK(block_size >= 1 && queue_depth >= 1 && thread_count >= 1,
                "aio: block_size, queue_depth and thread_count must be >= 1, got ", block_size, ", ", queue_depth,
                ", ", thread_count);
    for (int64_t i = 0; i < queue_depth_; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Handle() {
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    for (auto& kv : requests_) kv.second->close_files();
  }

  int64_t submit(const at::Tensor& tensor, const std::string& path, int64_t offset, bool write, int64_t after) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), "aio: a contiguous CPU tensor is needed");
    TORCH_CHECK(offset >= 0, "aio: offset must be >= 0, got ", offset);
    auto r = std::make_unique<Request>();
    r->write = write;
    r->path = path;
    r->data = static_cast<char*>(tensor.data_ptr());
    r->nbytes = static_cast<int64_t>(tensor.nbytes());
    r->offset = offset;
    open_files(*r);
    if (r->err == 0) plan_chunks(*r);
    std::lock_guard<std::mutex> lk(mu_);
    r->id = next_id_++;
    const int64_t id = r->id;
    Request* raw = r.get();
    requests_.emplace(id, std::move(r));
    auto before = after > 0 ? requests_.find(after) : requests_.end();
    if (!raw->finished() && before != requests_.end() && before->second.get() != raw) {
      Request* dep = before->second.get();
      if (!dep->finished()) {
        raw->blocked = true;
        dep->dependents.push_back(raw);
      } else if (dep->err != 0) {
        cancel(*raw, after);
      }
    }  // (a request already waited for has succeeded, or its waiter saw it fail)
    if (raw->finished()) {
      raw->close_files();
    } else {
      active_.push_back(raw);
      work_cv_.notify_all();
    }
    return id;
  }

  // (errno, what failed); errno 0 when the request succeeded. The request is forgotten.
  std::tuple<int, std::string> wait(int64_t id) {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = requests_.find(id);
    TORCH_CHECK(it != requests_.end(), "aio: no outstanding request ", id, " (already waited for, or never submitted)");
    Request* r = it->second.get();
    done_cv_.wait(lk, [r] { return r->finished(); });
    auto result = std::make_tuple(r->err, r->what);
    requests_.erase(it);
    return result;
  }

  bool is_direct(int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = requests_.find(id);
    TORCH_CHECK(it != requests_.end(), "aio: no outstanding request ", id);
    return it->second->direct;
  }

  // Seconds during which at least one read chunk, one write chunk, any chunk was in flight (so
  // far): bytes over these are the bandwidth while I/O was actually happening.
  std::tuple<double, double, double> busy_seconds() {
    std::lock_guard<std::mutex> lk(mu_);
    const auto now = Clock::now();
    double out[3];
    for (int k = 0; k < 3; ++k) {
      out[k] = busy_[k] + (flying_[k] > 0 ? std::chrono::duration<double>(now - since_[k]).count() : 0.0);
    }
    return std::make_tuple(out[0], out[1], out[2]);
  }

  // Blocks until every submitted request has finished (their results stay to be waited for).
  void drain() {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return active_.empty(); });
  }

 private:
  void open_files(Request& r) {
    const int flags = (r.write ? (O_WRONLY | O_CREAT) : O_RDONLY) | O_CLOEXEC;
    const bool aligned = reinterpret_cast<uintptr_t>(r.data) % kAlign == 0 && r.offset % kAlign == 0;
    const int64_t body = aligned ? r.nbytes / kAlign * kAlign : 0;
    if (body > 0) {
      r.direct_fd = ::open(r.path.c_str(), flags | O_DIRECT, 0644);
      if (r.direct_fd >= 0) {
        r.direct = true;
      } else if (errno != EINVAL) {  // EINVAL: this file system refuses O_DIRECT; buffered below
        r.err = errno;
        r.what = std::string("open for ") + (r.write ? "writing" : "reading") + " (O_DIRECT)";
        return;
      }
    }
    if (r.direct && r.write && !extend(r)) return;
    if (!r.direct || body < r.nbytes) {  // the tail, or everything; also an empty request's open
      r.buffered_fd = ::open(r.path.c_str(), flags, 0644);
      if (r.buffered_fd < 0) {
        r.err = errno;
        r.what = std::string("open for ") + (r.write ? "writing" : "reading");
        r.close_files();
      }
    }
  }

  // A direct write past the end of the file is an extending write: the file system serialises it
  // (ext4 takes the inode lock exclusively, so the chunks would not overlap) and moves the size at
  // its completion, racing the buffered tail's own size update. Growing the file first makes every
  // direct chunk a write inside the file. fallocate (mode 0) grows the size only if the range ends
  // past it, under the inode lock: it never shrinks the file, even while another request's buffered
  // write is extending it. (fstat + ftruncate could: a buffered write landing between the two was
  // cut off, seen as a short read of that piece later.) Where fallocate is not supported, ftruncate
  // under one lock over the process's extensions.
  bool extend(Request& r) {
    const int64_t end = r.offset + r.nbytes;
    if (::fallocate(r.direct_fd, 0, r.offset, r.nbytes) == 0) return true;
    if (errno != EOPNOTSUPP && errno != ENOSYS) {
      r.err = errno;
      r.what = "fallocate growing the file to " + std::to_string(end) + " bytes before O_DIRECT writes";
      r.close_files();
      return false;
    }
    static std::mutex extend_mu;
    std::lock_guard<std::mutex> lk(extend_mu);
    struct stat st;
    const bool stat_ok = ::fstat(r.direct_fd, &st) == 0;
    if (stat_ok && st.st_size >= end) return true;
    if (!stat_ok || ::ftruncate(r.direct_fd, end) != 0) {
      r.err = errno;
      r.what = std::string(stat_ok ? "ftruncate" : "fstat") + " growing the file to " + std::to_string(end) +
               " bytes before O_DIRECT writes";
      r.close_files();
      return false;
    }
    return true;
  }

  void plan_chunks(Request& r) {
    int64_t pos = 0;
    if (r.direct) {
      const int64_t body = r.nbytes / kAlign * kAlign;
      const int64_t step = (block_size_ + kAlign - 1) / kAlign * kAlign;  // chunk edges stay aligned
      for (; pos < body; pos += step) r.chunks.push_back({pos, std::min(step, body - pos), true});
      pos = body;
    }
    for (; pos < r.nbytes; pos += block_size_) r.chunks.push_back({pos, std::min(block_size_, r.nbytes - pos), false});
  }

  // The dependent of failed request `after`: failed with ECANCELED, no chunk run (mu_ held).
  static void cancel(Request& r, int64_t after) {
    r.err = ECANCELED;
    r.what = "not run: the request it was submitted after (" + std::to_string(after) + ") failed";
    r.next = r.done = r.chunks.size();
  }

  void remove_active(Request* r) {
    for (auto it = active_.begin(); it != active_.end(); ++it) {
      if (*it == r) {
        active_.erase(it);
        return;
      }
    }
  }

  // The request whose next chunk may be issued now (called with mu_ held), or nullptr.
  Request* pick() {
    if (in_flight_ >= queue_depth_) return nullptr;
    for (Request* r : active_) {
      if (!r->blocked && r->next < r->chunks.size() && !(single_submit_ && r->in_flight > 0)) return r;
      if (!overlap_events_) return nullptr;  // only the oldest unfinished request may issue
    }
    return nullptr;
  }

  void work() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      Request* r = nullptr;
      work_cv_.wait(lk, [&] { return (r = pick()) != nullptr || stop_; });
      if (r == nullptr) return;  // stopping, nothing left to issue
      const Chunk chunk = r->chunks[r->next++];
      ++r->in_flight;
      ++in_flight_;
      busy(r->write ? 1 : 0, +1);
      const bool skip = r->err != 0;  // the request already failed: its other chunks are not done
      lk.unlock();
      int err = 0;
      std::string what;
      if (!skip) {
        const char* call = r->write ? "pwrite" : "pread";
        const int fd = chunk.direct ? r->direct_fd : r->buffered_fd;
        err = transfer(fd, r->write, r->data + chunk.pos, chunk.len, r->offset + chunk.pos);
        if (err == EINVAL && chunk.direct) {  // opened with O_DIRECT but refused at I/O: redo it buffered
          err = buffered_retry(*r, chunk);
          if (err) what = describe(*r, chunk, call, false);
        } else if (err) {
          what = describe(*r, chunk, call, chunk.direct);
        }
      }
      lk.lock();
      if (err && r->err == 0) {
        r->err = err;
        r->what = what;
      }
      --r->in_flight;
      --in_flight_;
      busy(r->write ? 1 : 0, -1);
      ++r->done;
      if (r->finished()) {
        r->close_files();
        remove_active(r);
        for (Request* d : r->dependents) {  // released: run, or failed unrun if this one failed
          d->blocked = false;
          if (r->err != 0) {
            cancel(*d, r->id);
            d->close_files();
            remove_active(d);
          }
        }
        r->dependents.clear();
        done_cv_.notify_all();
      }
      work_cv_.notify_all();  // a slot is free, and maybe the next request may start
    }
  }

  int buffered_retry(Request& r, const Chunk& chunk) {
    const int fd = ::open(r.path.c_str(), (r.write ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) return errno;
    const int err = transfer(fd, r.write, r.data + chunk.pos, chunk.len, r.offset + chunk.pos);
    ::close(fd);
    return err;
  }

  using Clock = std::chrono::steady_clock;
  // kind 0 reads, 1 writes, 2 any: count in flight; time accumulated while non-zero (mu_ held)
  void busy(int kind, int delta) {
    for (int k : {kind, 2}) {
      const auto now = Clock::now();
      if (delta > 0 && flying_[k]++ == 0) since_[k] = now;
      if (delta < 0 && --flying_[k] == 0) busy_[k] += std::chrono::duration<double>(now - since_[k]).count();
    }
  }

  int64_t flying_[3] = {0, 0, 0};
  double busy_[3] = {0.0, 0.0, 0.0};
  Clock::time_point since_[3];
  const int64_t block_size_, queue_depth_;
  const bool single_submit_, overlap_events_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> active_;  // submitted, not finished, in submission order
  int64_t in_flight_ = 0;
  int64_t next_id_ = 1;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Handle>(m, "Handle")
      .def(py::init<int64_t, int64_t, int64_t, bool, bool>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("thread_count"), py::arg("single_submit"), py::arg("overlap_events"))
      .def("submit", &Handle::submit, "queue a read or write of the tensor's bytes; returns the request id",
           py::arg("tensor"), py::arg("path"), py::arg("offset"), py::arg("write"), py::arg("after") = 0)
      .def("wait", &Handle::wait, "block until the request is done; (errno, what failed), errno 0 on success",
           py::arg("request"), py::call_guard<py::gil_scoped_release>())
      .def("is_direct", &Handle::is_direct, "whether the request's aligned body goes through O_DIRECT",
           py::arg("request"))
      .def("busy_seconds", &Handle::busy_seconds,
           "(read, write, any): seconds with at least one such chunk in flight, since the handle was made")
      .def("drain", &Handle::drain, "block until every submitted request has finished",
           py::call_guard<py::gil_scoped_release>());
  m.attr("ALIGNMENT") = kAlign;
}
